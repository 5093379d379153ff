"""Shared helpers for the trainer acceptance tests (tests/trainer/, and every test that needs a trained run).

Everything runs the real trainer in subprocesses (``python -m trainer`` or ``torchrun``), on CPU,
against one prepared Shakespeare dataset shared by the whole pytest session.

* ``dataset`` fixture        - the prepared dataset dir (prepared once per session, on disk).
* ``trainer_cmd``            - argv for 1 rank (python) or N ranks (torchrun --standalone: a free port each time).
* ``run_trainer``            - run to completion, return the CompletedProcess.
* ``reference_run``          - an uninterrupted run, cached per argument list for the session.
* ``run_and_kill``           - start a run and SIGKILL every process of it at a (seeded) random moment,
                               optionally while a checkpoint is being written.
* ``trajectory`` / ``assert_same_trajectory`` - compare the authoritative step records bitwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# fields of a StepRecord that must be bitwise identical between a reference and a resumed run
EXACT_FIELDS = (
    "loss", "loss_max_rank", "rank_losses", "grad_norm", "param_digest", "batch_fingerprint",
    "sample_ids", "lr", "tokens", "batch_tokens", "skipped", "skip_reason", "source_loss", "val_slice_loss", "probe_loss",
)

# the common knobs: tiny model, no telemetry, every step digested
BASE_ARGS = ("--preset", "tiny", "--telemetry", "off")


# ------------------------------------------------------------------ environment / data
def trainer_env(data_dir: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"  # 2 ranks on 2 cores; the same in every run so results are comparable
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "0"
    for k in ("SENTINEL_REDIS_URL", "SENTINEL_SECRET", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if data_dir is not None:
        env["SENTINEL_DATA_DIR"] = str(data_dir)
    return env


def shared_base(factory: pytest.TempPathFactory) -> Path:
    """The base temp dir of this pytest session, shared by its xdist workers too (each worker's own base
    temp dir is a child of it): what is cached there is built once a session, not once a worker."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def exclusive(path: Path):
    """An exclusive lock beside ``path`` for the block: a second worker building the same thing waits for it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def session_root(factory: pytest.TempPathFactory) -> Path:
    """A dir shared by every module (and every xdist worker) of this pytest session."""
    root = shared_base(factory) / "trainer-acceptance"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    """The default Shakespeare corpus, prepared once per session (idempotent across modules)."""
    from trainer.data import ensure_prepared

    path = session_root(tmp_path_factory) / "shakespeare-byte"
    with exclusive(path):
        return ensure_prepared(path)


@pytest.fixture(scope="session")
def refs(tmp_path_factory, dataset):
    """``refs(*args, nproc=1)``: the run dir of an uninterrupted run, cached for the session."""
    root = session_root(tmp_path_factory) / "refs"

    def get(*args: str, nproc: int = 1) -> Path:
        return reference_run(root, dataset, list(args), nproc=nproc)

    return get


# ------------------------------------------------------------------ commands
def trainer_cmd(run_dir: Path, *args: str, nproc: int = 1) -> list[str]:
    tail = ["-m", "trainer", "--run-dir", str(run_dir), *args]
    if nproc == 1:
        return [PYTHON, *tail]
    # --standalone: c10d rendezvous on localhost with a free port chosen at each start
    return [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "0", *tail]


def run_trainer(run_dir: Path, *args: str, nproc: int = 1, data_dir: Path | None = None, timeout: float = 180,
                preexec_fn=None, check: bool = False) -> subprocess.CompletedProcess:
    p = subprocess.run(trainer_cmd(run_dir, *args, nproc=nproc), env=trainer_env(data_dir), cwd=REPO,
                       capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)
    if check and p.returncode != 0:
        raise AssertionError(f"trainer failed (rc {p.returncode}):\nSTDOUT:\n{p.stdout[-3000:]}\nSTDERR:\n{p.stderr[-5000:]}")
    return p


def reference_run(root: Path, data_dir: Path, args: list[str], *, nproc: int = 1) -> Path:
    key = hashlib.sha256(json.dumps([args, nproc]).encode()).hexdigest()[:12]
    run_dir = root / f"ref-{nproc}r-{key}"
    if (run_dir / ".complete").is_file():
        return run_dir
    with exclusive(run_dir):  # another xdist worker may be training the same run: wait for it
        if (run_dir / ".complete").is_file():
            return run_dir
        shutil.rmtree(run_dir, ignore_errors=True)
        run_trainer(run_dir, *BASE_ARGS, "--data", str(data_dir), *args, nproc=nproc, data_dir=data_dir, check=True)
        (run_dir / ".complete").write_text(json.dumps(args))
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    """Copy a run dir (to corrupt or resume it without touching the cached original)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".complete"))
    return dst


# ------------------------------------------------------------------ killing at random moments
def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces/parens, so split after the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            out.append(int(d.name))
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def kill_all(proc: subprocess.Popen, known: list[int] | None = None) -> None:
    """SIGKILL the run: its process group and every descendant (torchrun starts each worker in its own
    session, so killing the agent's group alone would orphan the workers). ``known``: descendants
    found beforehand, killed first without the (slow) /proc scan, so the kill lands where it was aimed;
    without them the scan comes first (once the agent is dead its workers belong to init, and a scan
    after the kill would miss them: an orphaned rank ran on and restarted the embedded bus after a
    test's teardown had stopped it)."""
    pids = list(known) if known is not None else descendants(proc.pid)
    for pid in [*pids, proc.pid]:
        for fn in (os.killpg, os.kill):
            try:
                fn(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    pids += [p for p in descendants(proc.pid) if p not in pids]
    for pid in [*pids, proc.pid]:
        for fn in (os.killpg, os.kill):
            try:
                fn(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait(timeout=30)
    deadline = time.time() + 10  # make sure no worker survives to write after we resume
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() and _state(p) != "Z" for p in pids):
        time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rfind(")") + 2:].split()[0]
    except OSError:
        return "Z"


def last_step(steps_path: Path) -> int:
    """Step number of the last complete step record in steps.jsonl (0 if none)."""
    try:
        with open(steps_path, "rb") as f:  # the tail is enough: records are < 2 KB
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - 16384))
            data = f.read()
    except FileNotFoundError:
        return 0
    end = data.rfind(b"\n")
    while end > 0:
        start = data.rfind(b"\n", 0, end) + 1
        line = data[start:end]
        if b'"kind":"step"' in line:
            return int(json.loads(line)["step"])
        if b'"kind":"' in line and b'"kind":"marker"' not in line:  # resume/rollback: nothing of this timeline yet
            return int(json.loads(line)["from_step"])
        end = start - 1
    return 0


@dataclass
class Kill:
    killed: bool  # False: the run finished before the kill moment came
    at_step: int  # last step record on disk when killed
    tmp_dirs: list[str] = field(default_factory=list)  # .tmp-step-* left behind: the kill landed in a write
    output: str = ""


def run_and_kill(run_dir: Path, args: list[str], *, rng: random.Random, kill_step: int, nproc: int = 1,
                 data_dir: Path | None = None, during_checkpoint: bool = False, timeout: float = 180) -> Kill:
    """Start the trainer, wait until ``kill_step`` steps are on disk, then SIGKILL it: after a random
    delay of up to ~30 ms, or (``during_checkpoint``) as soon as a ``.tmp-step-*`` dir appears."""
    log = run_dir.parent / f"{run_dir.name}.kill-{time.time_ns()}.log"
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    steps = run_dir / "steps.jsonl"
    ckroot = run_dir / "checkpoints"
    delay = rng.uniform(0.0, 0.03)
    with open(log, "w") as out:
        proc = subprocess.Popen(trainer_cmd(run_dir, *args, nproc=nproc), env=trainer_env(data_dir), cwd=REPO,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        armed_at = None
        known: list[int] = []
        try:
            while True:
                if proc.poll() is not None:
                    return Kill(False, last_step(steps), output=log.read_text())
                if time.time() > deadline:
                    raise AssertionError(f"trainer did not reach step {kill_step} in {timeout}s:\n{log.read_text()[-3000:]}")
                if armed_at is None and last_step(steps) >= kill_step:
                    known = descendants(proc.pid) if nproc > 1 else []  # the workers, found before the moment
                    armed_at = time.time()
                if armed_at is not None:
                    if during_checkpoint:
                        if ckroot.is_dir() and any(ckroot.glob(".tmp-step-*")):
                            break
                        if time.time() - armed_at > 20:
                            raise AssertionError("no checkpoint write seen within 20 s; is --ckpt-every small?")
                    elif time.time() - armed_at >= delay:
                        break
                time.sleep(0.001)
        finally:
            if proc.poll() is None:
                kill_all(proc, known)
    tmp = sorted(p.name for p in ckroot.glob(".tmp-step-*")) if ckroot.is_dir() else []
    return Kill(True, last_step(steps), tmp, log.read_text())


# ------------------------------------------------------------------ trajectories
def trajectory(run_dir: Path) -> dict[int, dict]:
    from sentinel.client.steplog import authoritative

    return {s: {f: getattr(r, f) for f in EXACT_FIELDS} for s, r in authoritative(run_dir / "steps.jsonl").items()}


FAILURES = Path(os.environ.get("SENTINEL_TEST_FAILURES", "/tmp/sentinel-test-failures"))


def assert_same_trajectory(ref_dir: Path, run_dir: Path, n_steps: int, context: str = "") -> None:
    """Bitwise comparison of the authoritative records. On a mismatch both run dirs are copied to
    $SENTINEL_TEST_FAILURES (default /tmp/sentinel-test-failures) so a rare failure can be diagnosed."""
    try:
        _compare(ref_dir, run_dir, n_steps)
    except AssertionError as e:
        keep = FAILURES / f"{run_dir.parent.name}-{time.strftime('%H%M%S')}"
        for d, name in ((ref_dir, "ref"), (run_dir, "run")):
            shutil.copytree(d, keep / name, dirs_exist_ok=True, ignore_dangling_symlinks=True)
        markers = [f"{r.kind}@{r.from_step}" for r in records(run_dir) if getattr(r, "kind", "step") not in ("step", "marker")]
        raise AssertionError(f"{e}\n  timeline markers {markers}; {context}; run dirs kept in {keep}") from None


def _compare(ref_dir: Path, run_dir: Path, n_steps: int) -> None:
    ref, got = trajectory(ref_dir), trajectory(run_dir)
    assert sorted(ref) == list(range(1, n_steps + 1)), f"reference has steps {sorted(ref)}"
    assert sorted(got) == list(range(1, n_steps + 1)), f"resumed run has steps {sorted(got)}"
    for s in ref:
        for f in EXACT_FIELDS:
            a, b = ref[s][f], got[s][f]
            # bitwise: compare the exact repr (NaN-safe, -0.0-safe)
            assert repr(a) == repr(b), f"step {s}: {f} differs: reference {a!r}, resumed {b!r}"
        assert got[s]["param_digest"], f"step {s}: no param_digest"


def records(run_dir: Path) -> list:
    from sentinel.client.steplog import read

    return list(read(run_dir / "steps.jsonl"))


def checkpoint_steps(run_dir: Path) -> list[int]:
    from trainer.checkpoint import list_checkpoints

    return sorted(s for s, _ in list_checkpoints(run_dir / "checkpoints"))


def assert_one_line_error(p: subprocess.CompletedProcess, *, rc: int = 2, contains: str | None = None) -> str:
    """stderr is exactly one line ``error: ...``, the exit code is ``rc``, and nothing printed a traceback."""
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{p.stderr[-3000:]}"
    assert lines[0].startswith("error: "), lines[0]
    assert p.returncode == rc, f"rc {p.returncode}: {p.stderr}"
    if contains:
        assert contains in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------ live runs
def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    """Poll ``cond()`` until it is truthy (returned), failing on timeout or when ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def read_steps(run_dir: Path) -> list[dict]:
    """Every complete record of a live run's steps.jsonl (a line being written is left out)."""
    p = run_dir / "steps.jsonl"
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip() and line.endswith("}")]
