"""Where a cold checkpoint load spends its time: marks inside ``Trainer.load_checkpoint``, 1 rank.

    python bench/probes/load_timeline.py [--preset tiny] [--rounds 100] [--warm]

Trains ``--preset`` for 3 steps, saves, then loads that checkpoint ``--rounds`` times, each time with
its files dropped from the page cache first (``--warm``: left in it), and prints the median time from
the start of the load at which each mark was reached: the manifest read and checked, the files
announced, each file parsed while it is read (``_parse_early``) and its checksum, verification done,
every piece gathered (``_read``), applied (``_restore``), the load returned. Findings:
docs/benchmarks/checkpoint-cost.md.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: checkpoint_arms
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from checkpoint_arms import drop_from_page_cache

import sentinel.contract.fsio as fsio
import trainer.checkpoint as ck
import trainer.checkpoint_verify as cv
import trainer.checkpointing as cp
from trainer import dist as tdist
from trainer.config import resolve
from trainer.train import Trainer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--warm", action="store_true", help="leave the files in the page cache")
    args = ap.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="load-timeline-"))
    cfg = resolve(preset=args.preset, config_file=None, saved=None, overrides={
        "max_steps": 3, "checkpoint.every": 3, "checkpoint.initial": False, "telemetry.enabled": False,
        "eval.every": 0, "device": "cpu"})
    env = tdist.init("cpu")
    t = Trainer(cfg, run_dir, env)
    t.fit()
    files = [p for p in (run_dir / "checkpoints" / ck.step_dir_name(3)).iterdir() if p.is_file()]

    marks: list[tuple[str, float]] = []
    start = [0.0]

    def wrap(owner, name: str, label, before: str | None = None) -> None:
        fn = getattr(owner, name)

        def timed(*a, **k):
            if before:
                marks.append((before, time.perf_counter() - start[0]))
            out = fn(*a, **k)
            marks.append((label(a) if callable(label) else label, time.perf_counter() - start[0]))
            return out

        setattr(owner, name, timed)

    wrap(cv, "_read_json", lambda a: f"{Path(a[0]).name} read")
    wrap(cv, "check_manifest", "manifest checked")
    wrap(fsio, "announce", "files announced", before="announcing")
    wrap(fsio, "_mapped_checksum_matches", lambda a: f"{Path(a[0]).name} hashed")
    wrap(cp.TrainerCheckpoints, "_parse_early", "headers parsed while reading (_parse_early)")
    wrap(cp, "verify_share", "verified")
    wrap(cp.TrainerCheckpoints, "_read", "pieces parsed and checked (_read)")
    wrap(cp.TrainerCheckpoints, "_restore", "pieces applied (_restore)")

    seen: dict[tuple[int, str], list[float]] = collections.defaultdict(list)
    for _ in range(args.rounds):
        if not args.warm:
            drop_from_page_cache(files)
        marks.clear()
        start[0] = time.perf_counter()
        t.load_checkpoint(3)
        marks.append(("returned", time.perf_counter() - start[0]))
        for i, (name, at) in enumerate(marks):
            seen[(i, name)].append(at)
    print(f"{args.preset}, {'warm' if args.warm else 'cold'}, median of {args.rounds} loads (ms from the start):")
    for (_, name), at in sorted(seen.items()):
        print(f"  {statistics.median(at) * 1e3:7.3f}  {name}")
    shutil.rmtree(run_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
