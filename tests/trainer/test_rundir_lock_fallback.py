"""The run dir lock on a filesystem without ``flock`` (Lustre without ``-o flock`` answers ENOSYS).

There is no Lustre here, so the one fake is ``fcntl.flock`` raising ``OSError(ENOSYS)`` (and, for
a filesystem with no locks at all, ``fcntl.lockf`` too), set in real child processes: a holder that
takes the lock and waits, and a contender that must be refused while the holder lives, with one
warning line and never a traceback.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainer import rundir_lock

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import errno, fcntl, sys
    def refuse(*a, **k):
        raise OSError(errno.ENOSYS, "Function not implemented")
    fcntl.flock = refuse
    if sys.argv[2] == "nolocks":
        fcntl.lockf = refuse
    from trainer import rundir_lock
    try:
        rundir_lock.acquire(sys.argv[1])
    except rundir_lock.RunDirBusy as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(3)
    print("locked", flush=True)
    sys.stdin.read()  # hold the lock until the test closes stdin
""")


def _child(run: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(run), mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _holder(run: Path, mode: str) -> subprocess.Popen:
    p = _child(run, mode)
    assert p.stdout.readline().strip() == "locked", p.stderr.read()
    return p


def _contend(run: Path, mode: str) -> subprocess.CompletedProcess:
    p = _child(run, mode)
    out, err = p.communicate("", timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _release(p: subprocess.Popen) -> str:
    _, err = p.communicate("", timeout=60)
    assert p.returncode == 0, err
    return err


@pytest.mark.parametrize("mode, fallback", [("noflock", "POSIX record locks"), ("nolocks", "owner file")])
def test_without_flock_one_trainer_holds_the_run_dir_and_a_second_is_refused(tmp_path, mode, fallback):
    run = tmp_path / "run"
    run.mkdir()
    holder = _holder(run, mode)
    try:
        second = _contend(run, mode)
        assert second.returncode == 3, second
        assert "Traceback" not in second.stderr
        err = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
        assert len(err) == 1 and f"pid {holder.pid} on " in err[0] and "in use by another trainer" in err[0], second.stderr
    finally:
        warned = _release(holder)
    lines = warned.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "ENOSYS" in lines[0] and fallback in lines[0], warned
    # released at exit: the next trainer takes it
    again = _contend(run, mode)
    assert again.returncode == 0 and again.stdout.strip() == "locked", again
    assert not (run / rundir_lock.OWNER_NAME).exists()


def test_without_any_lock_a_killed_owner_on_this_host_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = _holder(run, "nolocks")
    holder.send_signal(signal.SIGKILL)
    holder.communicate(timeout=30)
    left = json.loads((run / rundir_lock.OWNER_NAME).read_text())
    assert left["pid"] == holder.pid  # SIGKILL ran no exit handler: the owner file stays behind
    again = _contend(run, "nolocks")
    assert again.returncode == 0 and again.stdout.strip() == "locked", again
    assert f"removing the stale {rundir_lock.OWNER_NAME} of pid {holder.pid}" in again.stderr
    assert "Traceback" not in again.stderr


def test_an_owner_on_another_host_is_never_taken_over(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir_lock.OWNER_NAME).write_text(json.dumps({"pid": 1, "host": "node-7", "since": 0}))

    def refuse(*a, **k):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(rundir_lock.fcntl, "flock", refuse)
    monkeypatch.setattr(rundir_lock.fcntl, "lockf", refuse)
    with pytest.raises(rundir_lock.RunDirBusy, match=r"pid 1 on node-7.*if that trainer is dead, remove"):
        rundir_lock.acquire(run)
