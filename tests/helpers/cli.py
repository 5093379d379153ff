"""The operator CLI in tests: in process through click's CliRunner, or as a process with the trainer's environment,
and the one finished 30-step run the CLI tests share (``base_run``, copied by ``run_copy``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel.cli import main
from sentinel.protocol import StepRecord
from tests.helpers.trainer import REPO, copy_run, trainer_env

SENTINEL = [sys.executable, "-m", "sentinel"]


def cli(*args: str, input: str | None = None):
    res = CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)
    return res


def cli_json(*args: str) -> dict:
    res = cli(*args, "--json")
    assert res.exit_code == 0, (res.exit_code, res.output, res.stderr)
    return json.loads(res.stdout)


def sentinel_proc(*args: str, timeout: float = 120, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = trainer_env()
    env.update(env_extra or {})
    return subprocess.run([*SENTINEL, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def base_run(refs) -> Path:
    """One 30-step run for the session (the CLI and offline tests share it through conftest):
    ``refs`` trains it once; the tests read it, or a copy (``run_copy``)."""
    return refs("--max-steps", "30", "--ckpt-every", "10", "--keep-last", "10", "--eval-every", "10")


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    return copy_run(base_run, tmp_path / "run")


def step_records(run_dir: Path) -> dict[int, StepRecord]:
    from sentinel.rundir import effective_steps, read_records

    return {r.step: r for r in effective_steps(read_records(run_dir))}


def one_line_error(res, *contains: str, rc: int = 2) -> str:
    """The one ``error: ...`` line of a failed command (subprocess or CliRunner result), exit 2."""
    code = res.returncode if isinstance(res, subprocess.CompletedProcess) else res.exit_code
    err = res.stderr
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == rc and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-3000:])
    assert "Traceback" not in err + (res.stdout or "")
    for c in contains:
        assert c in lines[0], lines[0]
    return lines[0]
