"""The sentinel's offline tools: ``replay-batch`` and ``verify-resume``.

These are the only sentinel modules that import the trainer: they rebuild a run's exact training
state from its checkpoints and step log (``RUN_DIR/steps.jsonl``) with no trainer running.

* :mod:`sentinel.offline.replay`  - reproduce the batch of one step and name its culprit samples;
* :mod:`sentinel.offline.verify`  - prove that a resume from a checkpoint reproduces the run;
* :mod:`sentinel.offline.worker`  - the per-rank entry point (``torchrun ... -m sentinel.offline.worker``)
  used for runs recorded with more than one rank, so DDP gradient averaging is replayed for real.

This package's ``__init__`` stays torch-free: the CLI uses it to validate input (run dir, step log,
world size) before paying for ``import torch``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sentinel.contract.rundir import STEPS

# Comparison tolerance. On CPU a replay is bitwise: floats are compared with ``==``. CUDA kernels
# (atomics, split-K GEMMs, bf16 autocast) are not run-to-run bitwise, so on CUDA two values agree
# when |a - b| <= CUDA_ATOL + CUDA_RTOL * |b|.
CUDA_RTOL = 1e-3
CUDA_ATOL = 1e-6


class OfflineError(Exception):
    """A one-line, user-facing reason an offline tool cannot run (bad input): exit code 2."""


ProgressFn = Callable[[int, int, str], None]  # (done, total, description)


def same(a: float | None, b: float | None, device_type: str) -> bool:
    """Do a replayed and a recorded value agree? Bitwise (``==``) on CPU, CUDA_RTOL on CUDA.
    Two NaNs agree (a NaN step replayed as NaN is reproduced); NaN vs a number never does."""
    if a is None or b is None:
        return a is None and b is None
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if device_type != "cuda":
        return a == b
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= CUDA_ATOL + CUDA_RTOL * abs(b)


def tolerance_text(device_type: str) -> str:
    return "bitwise (==)" if device_type != "cuda" else f"rtol {CUDA_RTOL:g}, atol {CUDA_ATOL:g}"


@dataclass
class RunLog:
    """What the CLI needs to know about a run before importing torch."""

    run_dir: Path
    records: dict  # step -> StepRecord (authoritative), of the steps ``open_run`` was asked to keep
    world_size: int
    run_id: str
    first: int | None = None  # the log's first and last authoritative step
    last: int | None = None
    rejected: list[str] = field(default_factory=list)  # unreadable lines of the log, skipped

    def warn_rejected(self) -> None:
        """One stderr line about the log's unreadable lines: skipped, as the other readers skip them."""
        if self.rejected:
            import sys

            print(f"warning: skipped {len(self.rejected)} unreadable line(s) of the step log; first: {self.rejected[0]} "
                  "(a resume or rollback record among them would change which record of a step counts)", file=sys.stderr)

    def span(self) -> str:
        return f"steps {self.first}..{self.last}" if self.last is not None else "no steps"


def open_run(run: str | os.PathLike, keep: Callable[[int], bool] = lambda step: False) -> RunLog:
    """Validate a run directory and read its step log (torch-free), in one streamed pass: the
    authoritative records of the steps ``keep`` names, the first and last step, and the world size
    and run id of the last record. (Read whole, a long run's log was gigabytes in memory.)"""
    from sentinel.client.steplog import scan
    from sentinel.protocol import SchemaError
    from trainer.config import ConfigError, load_run_config

    run_dir = Path(run)
    if not run_dir.exists():
        raise OfflineError(f"run directory not found: {run_dir}")
    if not run_dir.is_dir():
        raise OfflineError(f"not a directory: {run_dir}")
    try:
        cfg = load_run_config(run_dir)
    except ConfigError as e:
        raise OfflineError(str(e)) from None
    log = run_dir / STEPS
    if not log.is_file():
        raise OfflineError(f"{run_dir} has no step log (steps.jsonl)")
    rejected: list[str] = []
    try:
        got = scan(log, keep, rejected=rejected)
    except SchemaError as e:
        raise OfflineError(str(e)) from None
    last = got.last_record if got.last is not None else None
    world = int(last.world_size or 1) if last is not None else 1
    run_id = cfg.run_id or (last.run if last is not None else run_dir.resolve().name)
    return RunLog(run_dir=run_dir, records=got.records, world_size=world, run_id=run_id, first=got.first, last=got.last,
                  rejected=rejected)


def precheck_checkpoint(run_dir: Path, *, exact: int | None = None, before: int | None = None) -> int:
    """Find and verify (sha256 against the manifest) the checkpoint a tool will restore, in this
    process: multi-rank runs fail fast on bad input instead of after launching ranks."""
    from trainer.checkpoint import Checkpointer, CheckpointError

    ck = Checkpointer(run_dir, rank=0, world_size=1, keep_last=1, keep_every=0,
                      barrier=lambda: None, all_ok=lambda ok: ok, log=lambda m: None)
    if exact is not None:
        try:
            return ck.exact(exact).step
        except CheckpointError as e:
            msg = str(e)
            raise OfflineError(msg if msg.startswith("no checkpoint") else f"checkpoint {msg}") from None
    passed: list[str] = []
    ck.log = passed.append
    found = ck.newest_valid(at_or_before=before)
    if found is None:
        why = f" ({'; '.join(m.removeprefix('warning: checkpoint ').split(';')[0] for m in passed)})" if passed else ""
        raise OfflineError(f"no valid checkpoint at or before step {before} in {run_dir / 'checkpoints'}{why}")
    return found.step


# ------------------------------------------------------------------------------------ workers


def launch_workers(
    world_size: int,
    argv: list[str],
    *,
    progress: ProgressFn | None = None,
    timeout: float | None = None,
) -> dict:
    """Run ``python -m sentinel.offline.worker ARGV`` on ``world_size`` ranks under torchrun and
    return the JSON result that rank 0 wrote. The rendezvous uses ``--standalone`` (a free port
    picked by torchrun). Worker output goes to a log file; its tail is shown if the workers die
    without a result. Errors reported by the workers come back as :class:`OfflineError`.
    """
    with tempfile.TemporaryDirectory(prefix="sentinel-offline-") as tmp:
        out = Path(tmp) / "result.json"
        prog = Path(tmp) / "progress"
        logf = Path(tmp) / "workers.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               "-m", "sentinel.offline.worker", *argv, "--out", str(out), "--progress-file", str(prog)]
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, set explicitly to keep its log quiet
        env["PYTHONUNBUFFERED"] = "1"
        with open(logf, "wb") as lf:
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
            deadline = time.monotonic() + timeout if timeout else None
            try:
                while proc.poll() is None:
                    if progress is not None:
                        _poll_progress(prog, progress)
                    if deadline and time.monotonic() > deadline:
                        raise OfflineError(f"offline workers did not finish within {timeout:.0f}s")
                    time.sleep(0.1)
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        if progress is not None:
            _poll_progress(prog, progress)
        if out.is_file():
            res = json.loads(out.read_text())
            if "error" in res:
                raise OfflineError(res["error"])
            return res
        tail = [ln for ln in logf.read_text(errors="replace").splitlines() if ln.strip()]
        useful = [ln for ln in tail if "error" in ln.lower() or "Error" in ln] or tail
        last = useful[-1].strip() if useful else "no output"
        raise OfflineError(f"offline workers exited with code {proc.returncode} and no result ({last[:300]})")


def _poll_progress(path: Path, progress: ProgressFn) -> None:
    try:
        text = path.read_text()
    except OSError:
        return
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return
    try:
        d = json.loads(lines[-1])
        progress(int(d["done"]), int(d["total"]), str(d.get("desc", "")))
    except (ValueError, KeyError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def file_progress(path: str | os.PathLike | None) -> ProgressFn | None:
    """A progress callback for workers: rank 0 rewrites one JSON line the parent polls."""
    if not path:
        return None
    p = Path(path)

    def report(done: int, total: int, desc: str) -> None:
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps({"done": done, "total": total, "desc": desc}) + "\n")
        os.replace(tmp, p)

    return report
