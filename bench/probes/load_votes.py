"""One vote a load or two: a 2-rank checkpoint load with every file verified by every rank, against shares.

    python bench/probes/load_votes.py [--preset tiny] [--loads 200]

Launches itself under ``torchrun --standalone --nproc-per-node 2`` (gloo on CPU), trains ``--preset``
for 3 steps, saves, then loads that checkpoint ``--loads`` times each way, interleaved (one vote, two
votes, raw read; then backwards), the page cache dropped before each: one vote is
``checkpoint.verify_whole_max_bytes`` above the state's size (every rank hashes every file, one vote
after the read), two is the knob at 0 (each rank hashes a share, a vote before any rank reads a file
it did not hash, another before the state is applied). Prints the slowest rank's median and p90 for
each. Findings: docs/benchmarks/checkpoint-cost.md (change 24).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(args) -> None:
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import torch
    import torch.distributed as dist
    from checkpoint_arms import drop_from_page_cache, read_through

    from trainer import dist as tdist
    from trainer.checkpoint import step_dir_name
    from trainer.config import resolve
    from trainer.train import Trainer

    env = tdist.init("cpu")
    run_dir = Path(args.run_dir)
    cfg = resolve(preset=args.preset, config_file=None, saved=None, overrides={
        "max_steps": 3, "checkpoint.every": 3, "checkpoint.initial": False, "telemetry.enabled": False,
        "eval.every": 0, "device": "cpu"})
    t = Trainer(cfg, run_dir, env)
    t.fit()
    env.barrier()
    files = [p for p in (run_dir / "checkpoints" / step_dir_name(3)).iterdir() if p.is_file()]

    arms = {"one vote": 1 << 62, "two votes": 0, "raw read": None}
    took: dict[str, list[float]] = {k: [] for k in arms}
    names = list(arms)
    for i in range(args.loads):
        for name in names if i % 2 == 0 else names[::-1]:
            if arms[name] is not None:
                t.cfg.checkpoint.verify_whole_max_bytes = arms[name]
            drop_from_page_cache(files)
            env.barrier()
            t0 = time.perf_counter()
            if arms[name] is None:
                read_through(files)
            else:
                assert t.load_checkpoint(3) == 3
            x = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(x, op=dist.ReduceOp.MAX)  # the slowest rank's: the next step waits for it
            took[name].append(float(x) * 1e3)
    if env.is_main:
        print(f"{args.preset}, 2 ranks, {args.loads} loads each, the slowest rank's time:")
        for name, v in took.items():
            v = sorted(v)
            print(f"  {name:9s}  median {statistics.median(v):6.3f} ms   p90 {v[int(0.9 * len(v))]:6.3f} ms")
    env.barrier()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--loads", type=int, default=200)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)  # set for the workers
    args = ap.parse_args()
    if args.run_dir:
        worker(args)
        return 0
    import subprocess

    run_dir = tempfile.mkdtemp(prefix="load-votes-")
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               __file__, "--preset", args.preset, "--loads", str(args.loads), "--run-dir", run_dir]
        return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
