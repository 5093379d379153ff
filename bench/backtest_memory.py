"""Peak memory and time of `sentinel backtest LOG --json` on a long loss log.

    python bench/backtest_memory.py [--steps 300000]

Writes a loss-only JSON-lines log of ``--steps`` steps (a power-law descent, noise, a recovered
spike every 997 steps) to a temporary file and runs the real command on it in a child process;
reports the child's peak resident memory (``ru_maxrss``) and wall time. The log is read as it is
judged (``sentinel.backtest.iter_trace``), so memory should not grow with the number of steps:
run it at two sizes and compare.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SENTINEL = [sys.executable, "-m", "sentinel"]


def write_log(path: Path, steps: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for s in range(1, steps + 1):
            x = 3.0 + 4.0 * s ** -0.3 + rng.gauss(0, 0.05)
            if s % 997 == 0:
                x *= 1.5
            f.write(json.dumps({"step": s, "loss": round(x, 4), "wall_ms": s * 100}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300_000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "long.jsonl"
        write_log(log, a.steps)
        t0 = time.perf_counter()
        p = subprocess.run(SENTINEL + ["backtest", str(log), "--json"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parents[1])
        wall = time.perf_counter() - t0
        if p.returncode:
            sys.exit(f"backtest failed: {p.stderr.strip()}")
        out = json.loads(p.stdout)
        peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        print(f"{a.steps} steps ({log.stat().st_size / 2**20:.1f} MiB): {out['records']} judged, {len(out['flagged'])} flagged, "
              f"{len(out['actions'])} actions; peak RSS {peak_mib:.0f} MiB, {wall:.1f} s")


if __name__ == "__main__":
    main()
