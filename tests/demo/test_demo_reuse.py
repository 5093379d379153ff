"""`sentinel demo` on a used run dir, with a trainer that fails, and under SIGTERM: one line, no
waiting on a dead trainer, nothing written into another run, no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# the real `sentinel demo`, with one flag the trainer refuses (it exits 2 at once, as a trainer that
# cannot start does): everything else - the embedded bus, the sentinel, the CLI - is the real thing
FAILING_TRAINER = (
    "import sys, sentinel.drill as d\n"
    "cmd = d.trainer_command\n"
    "d.trainer_command = lambda *a: cmd(*a) + ['--no-such-flag']\n"
    "from sentinel.cli import main\n"
    "sys.argv[0] = 'sentinel'\n"
    "main()\n"
)


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else b"<dir>") for p in sorted(d.rglob("*"))}


def _procs_of(run_dir: Path, *, but: int) -> list[int]:
    """Pids whose command line names ``run_dir`` (the trainer: torchrun and its ranks), except ``but``."""
    out = []
    for e in os.listdir("/proc"):
        if e.isdigit() and int(e) != but:
            try:
                cmd = Path(f"/proc/{e}/cmdline").read_bytes()
                state = Path(f"/proc/{e}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
            except OSError:
                continue
            if str(run_dir).encode() in cmd and state != b"Z":
                out.append(int(e))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z"


@pytest.mark.parametrize("compare", [False, True])
def test_demo_refuses_a_used_run_dir_and_touches_nothing(tmp_path, compare):
    run_dir = tmp_path / "copy-of-a-run"
    used = tmp_path / "copy-of-a-run-clean" if compare else run_dir
    run_dir.mkdir()
    used.mkdir(exist_ok=True)
    (used / "steps.jsonl").write_text('{"kind": "step"}\n')
    (used / "checkpoints").mkdir()
    before = _tree(tmp_path)
    p = subprocess.run([sys.executable, "-m", "sentinel", "demo", "--run-dir", str(run_dir)]
                       + (["--compare"] if compare else []), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr
    assert "not empty" in p.stderr and str(used) in p.stderr
    assert "--compare" in p.stderr if compare else "--run-dir" in p.stderr
    assert p.stdout == ""
    assert _tree(tmp_path) == before  # no bus/, rules, trainer.log or report written into it


@pytest.mark.slow
def test_run_drill_does_not_wait_for_the_sentinel_after_the_trainer_failed(tmp_path):
    """A run dir with steps already (a copied run) and a trainer that fails at once: the drill used to
    wait 60 s for a sentinel to evaluate steps nobody would ever publish."""
    from sentinel.drill import DrillSpec, run_drill
    from sentinel.embedded import stop_embedded
    from sentinel.protocol import StepRecord

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    rec = StepRecord(run="r", step=150, loss=3.0, loss_max_rank=3.0, grad_norm=1.0, lr=1e-3, tokens=1000,
                     batch_fingerprint="x", time=time.time())
    (run_dir / "steps.jsonl").write_text(rec.model_dump_json() + "\n")
    t0 = time.monotonic()
    try:
        res = run_drill(DrillSpec(run_dir=run_dir, steps=20, ranks=1, drill_step=10, extra_args=["--no-such-flag"]))
    finally:
        stop_embedded(run_dir)
    assert res.returncode == 2
    assert time.monotonic() - t0 < 40, "waited for the sentinel to catch up with a trainer that had failed"


@pytest.mark.slow
def test_demo_with_a_failing_trainer_prints_only_the_error(tmp_path):
    run_dir = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-c", FAILING_TRAINER, "demo", "--run-dir", str(run_dir), "--ranks", "1",
                        "--steps", "20", "--drill-step", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "what happened" not in p.stdout and "Look closer" not in p.stdout  # no table for a drill that never ran
    assert "Traceback" not in p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1, p.stderr
    assert str(run_dir / "trainer.log") in err[0]
    assert "unrecognized arguments: --no-such-flag" in err[0]  # the trainer's own last error line
    pid = int((run_dir / "bus" / "server.pid").read_text()) if (run_dir / "bus" / "server.pid").exists() else None
    assert pid is None or not _alive(pid), "the embedded bus was left running"


@pytest.mark.slow
def test_sigterm_stops_the_trainer_ranks_and_the_embedded_bus(tmp_path):
    run_dir = tmp_path / "demo"
    p = subprocess.Popen([sys.executable, "-m", "sentinel", "demo", "--run-dir", str(run_dir), "--steps", "100000",
                          "--drill-step", "50000"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    leftovers: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not (run_dir / "steps.jsonl").exists():  # the trainer's ranks are training
            assert p.poll() is None and time.monotonic() < deadline, "the demo did not start training"
            time.sleep(0.2)
        trainer = _procs_of(run_dir, but=p.pid)
        assert len(trainer) == 3  # torchrun and its two ranks (each in a session of its own)
        bus_pid = int((run_dir / "bus" / "server.pid").read_text())
        leftovers = trainer + [bus_pid]
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
        stderr = p.stderr.read()
        assert rc == 143, stderr
        assert "Traceback" not in stderr and "error: terminated by SIGTERM" in stderr
        deadline = time.monotonic() + 5
        while [x for x in leftovers if _alive(x)] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [x for x in leftovers if _alive(x)] == [], "processes left running after SIGTERM"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid in leftovers:  # what a failed run of this test would leave behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
