"""Error messages that name what is wrong: the trainer's metrics address, a --text that is no text
file, a malformed incident on the bus, a RUN_DIR that is a file, and an unknown run id on a bus full
of hostile ids. Each one line, a non-zero exit, never a traceback or a flood."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sentinel import bus
from sentinel.protocol import Keys
from tests.helpers.cli import cli, one_line_error
from tests.helpers.trainer import REPO, assert_one_line_error, trainer_env


def trainer(run_dir: Path, *args: str, data: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--preset", "tiny",
                           "--max-steps", "1", "--data", str(data), *args],
                          cwd=REPO, env=trainer_env(data), capture_output=True, text=True, timeout=180)


# ------------------------------------------------------------------ trainer: the metrics address
def test_trainer_metrics_port_in_use_names_the_address_and_flags(tmp_path, dataset):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = trainer(tmp_path / "run", "--metrics-port", str(port), data=dataset)
    line = assert_one_line_error(p, contains=f"cannot serve metrics on 127.0.0.1:{port}")
    assert "--metrics-host/--metrics-port" in line and "in use" in line


def test_trainer_metrics_host_that_does_not_resolve_names_it(tmp_path, dataset):
    p = trainer(tmp_path / "run", "--metrics-host", "999.1.1.1", "--metrics-port", "0", data=dataset)
    assert_one_line_error(p, contains="cannot serve metrics on 999.1.1.1:0 (--metrics-host/--metrics-port): ")


# ------------------------------------------------------------------ data prepare: --text that is no text file
@pytest.mark.parametrize("what, want", [("dir", "is a directory"), ("/dev/zero", "is not a regular file")])
def test_prepare_text_that_is_not_a_regular_file_says_what_it_is(tmp_path, what, want):
    src = tmp_path / "texts" if what == "dir" else Path(what)
    if what == "dir":
        src.mkdir()
        (src / "a.txt").write_text("hello\n")
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "trainer.data", "prepare", "--out", str(out), "--text", str(src)],
                       cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=60)
    line = assert_one_line_error(p, contains=f"text file {src} {want}")
    assert "does not exist" not in line
    assert not out.exists()


def test_prepare_source_that_is_a_device_says_so_and_writes_nothing(tmp_path):
    """``--source x=/dev/zero`` was read as a directory with no text files in it."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "trainer.data", "prepare", "--out", str(out), "--source", "x=/dev/zero"],
                       cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=60)
    line = assert_one_line_error(p, contains="source path /dev/zero is not a regular file or a directory")
    assert "directory /dev/zero" not in line
    assert not out.exists()


# ------------------------------------------------------------------ approve: a malformed incident on the bus
def test_approve_a_malformed_incident_names_run_incident_and_entry(embedded_bus):
    r = bus.connect(embedded_bus.url)
    bus.register_run(r, "run", {"run_dir": str(embedded_bus.run_dir)})
    k = Keys("run")
    r.hset(k.incidents, "run-t0-s101", '{"id": "run-t0-s101", "state": "awaiting_approval"}')  # no run, rule, steps
    line = one_line_error(cli("approve", "run-t0-s101", "--run", str(embedded_bus.run_dir)))
    assert "run run:" in line and "incident run-t0-s101" in line and "malformed" in line and "Incident." in line
    assert r.xlen(k.approvals) == 0  # nothing approved


# ------------------------------------------------------------------ sentinel run: a RUN_DIR that is a file
def test_run_on_a_regular_file_says_not_a_directory(tmp_path):
    f = tmp_path / "steps.jsonl"
    f.write_text("{}\n")
    line = one_line_error(cli("run", str(f)))
    assert line == f"error: not a directory: {f}"
    # a missing run dir is created (the sentinel may start first); one under a missing parent is a typo
    assert "does not exist either" in one_line_error(cli("run", str(tmp_path / "typo" / "nope")))
    assert not (tmp_path / "typo").exists()


# ------------------------------------------------------------------ an unknown run id on a bus of hostile ids
def test_unknown_run_id_error_is_capped(redis_server):
    r = bus.connect(redis_server.url)
    # anyone with bus access can register ids: 256 characters each (the most a run id may have), and
    # characters that reorder or hide text on a terminal (U+202E: right-to-left override)
    hostile = ["a" * 256, "b\u202eevil"] + [f"run-{i:03d}-" + "z" * 240 for i in range(40)]
    r.sadd(Keys.RUNS, *hostile)
    line = one_line_error(cli("status", "nosuchrun", "--redis-url", redis_server.url))
    assert "not known" in line and "and 32 more" in line
    assert len(line) < 1000, len(line)
    assert "\u202e" not in line and "\\u202e" in line  # escaped, not sent to the terminal
    assert "a" * 65 not in line and "z" * 65 not in line  # each id cut short
    # the id asked for is cut short too
    line = one_line_error(cli("status", "y" * 5000, "--redis-url", redis_server.url))
    assert len(line) < 1000 and "y" * 65 not in line
