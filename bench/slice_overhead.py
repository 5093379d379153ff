"""What does the per-source training loss cost a step? Same trainer, per-source sums on and off, A/B.

    python bench/slice_overhead.py [--preset small] [--block 10] [--pairs 6] [--sources 3] [--json]

One in-process trainer (single rank, ``--telemetry off``, no eval, no checkpoints) on a mixture
dataset of ``--sources`` synthetic sources prepared in a temporary dir. After a warm-up block, steps
run in blocks of ``--block`` with the per-source path on (per-sample losses, a ``[sources, B]``
one-hot matmul into a ``[sources]`` sum, the sum riding the loss gather and the readback) and off
(the plain mean loss, as for a single-source dataset), in ABBA order so slow drift of a shared
machine hits both arms alike. Reported: per-pair on/off ratio of the mean step wall time and of the
process CPU time per step (less sensitive to neighbours on a shared machine), with min/median/max. The model,
data and sampler stream are the same in both arms (only which ids each
block sees differs), so the ratio isolates the per-source bookkeeping.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _corpus(root: Path, k: int) -> Path:
    rnd = random.Random(k)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"[k * 5 % 30:][:12]
    words = ["".join(rnd.choice(letters) for _ in range(rnd.randint(2, 8))) for _ in range(400)]
    d = root / f"src{k}"
    d.mkdir(parents=True)
    (d / "doc.txt").write_text("".join(" ".join(rnd.choice(words) for _ in range(8)) + "\n" for _ in range(6000)))
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--block", type=int, default=10, help="steps per arm per block")
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--sources", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch

    from trainer.config import resolve
    from trainer.data import parse_source, prepare_dataset
    from trainer.dist import DistEnv
    from trainer.train import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="slice-overhead-") as tmp:
        root = Path(tmp)
        specs = [parse_source(f"s{k}={_corpus(root, k)}:1") for k in range(args.sources)]
        prepare_dataset(root / "data", sources=specs)
        cfg = resolve(preset=args.preset, overrides={
            "data.dir": str(root / "data"), "max_steps": 10_000, "eval.every": 0, "checkpoint.every": 0,
            "telemetry.enabled": False, "device": "cpu",
        })  # fmt: skip
        sigterm = signal.getsignal(signal.SIGTERM)
        tr = Trainer(cfg, root / "run", DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
        signal.signal(signal.SIGTERM, sigterm)
        tr.start()
        tr.model.train()

        def block(per_source: bool) -> tuple[float, float]:
            tr.per_source = per_source
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.block):
                tr._one_step(0.0)
            return (time.perf_counter() - t0) / args.block, (time.process_time() - c0) / args.block

        block(True)
        block(False)  # warm-up: allocator, both code paths
        rows = []
        for i in range(args.pairs):
            order = (True, False) if i % 2 == 0 else (False, True)
            t = {arm: block(arm) for arm in order}
            rows.append({"pair": i + 1, "on_s": t[True][0], "off_s": t[False][0], "ratio": t[True][0] / t[False][0],
                         "on_cpu_s": t[True][1], "off_cpu_s": t[False][1], "cpu_ratio": t[True][1] / t[False][1]})
        tr.steplog.close()
    ratios = [r["ratio"] for r in rows]
    cpu = [r["cpu_ratio"] for r in rows]
    out = {"preset": args.preset, "sources": args.sources, "block": args.block, "machine": platform.machine(),
           "pairs": rows, "min": min(ratios), "median": statistics.median(ratios), "max": max(ratios),
           "cpu_min": min(cpu), "cpu_median": statistics.median(cpu), "cpu_max": max(cpu)}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print("| pair | wall on / off (ms) | wall on/off | CPU on / off (ms) | CPU on/off |\n|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['pair']} | {r['on_s'] * 1e3:.1f} / {r['off_s'] * 1e3:.1f} | {r['ratio']:.4f} | "
                  f"{r['on_cpu_s'] * 1e3:.1f} / {r['off_cpu_s'] * 1e3:.1f} | {r['cpu_ratio']:.4f} |")
        print(f"| **min / median / max** | | **{out['min']:.4f} / {out['median']:.4f} / {out['max']:.4f}** | | "
              f"**{out['cpu_min']:.4f} / {out['cpu_median']:.4f} / {out['cpu_max']:.4f}** |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
