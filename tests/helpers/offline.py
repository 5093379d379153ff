"""Shared by the offline-tool tests (replay-batch, verify-resume): real runs built once per session."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

PY = sys.executable


def make_run(factory, name: str, *extra: str, ranks: int = 1, steps: int = 20, every: int = 10) -> Path:
    """A real tiny run under the session's shared base temp dir, built once (by one xdist worker) and reused by name."""
    from tests.helpers.trainer import exclusive, shared_base

    run = shared_base(factory) / "offline-runs" / name
    if (run / ".complete").is_file():
        return run
    with exclusive(run):
        if (run / ".complete").is_file():
            return run
        from trainer.data import ensure_prepared

        with exclusive(shared_base(factory) / "offline-data"):
            data = ensure_prepared(shared_base(factory) / "offline-data")
        shutil.rmtree(run, ignore_errors=True)
        launcher = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else [PY]
        cmd = [*launcher, "-m", "trainer", "--preset", "tiny", "--run-dir", str(run), "--max-steps", str(steps),
               "--ckpt-every", str(every), "--telemetry", "off", "--data", str(data), *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        (run / ".complete").write_text(name)
    return run
