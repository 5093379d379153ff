"""Per-rank entry point of the offline tools for runs recorded with more than one rank.

    torchrun --standalone --nproc-per-node W -m sentinel.offline.worker replay RUN --step N --out F
    torchrun --standalone --nproc-per-node W -m sentinel.offline.worker verify RUN --from-step C --out F

Every rank rebuilds its own part of the run (its micro-batches, its RNG stream, DDP's gradient
averaging) and runs the same code; rank 0 writes the JSON result to ``--out`` — or
``{"error": "..."}`` for a user-facing problem. Workers exit 0 either way, so torchrun never
prints a traceback for an expected error; the CLI reads the file and reports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sentinel.offline.worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("replay")
    r.add_argument("run_dir")
    r.add_argument("--step", type=int, required=True)
    r.add_argument("--checkpoint", type=int, default=None)
    r.add_argument("--top", type=int, default=5)
    r.add_argument("--rank-by", default="loss")
    r.add_argument("--timeline", type=int, default=None)
    v = sub.add_parser("verify")
    v.add_argument("run_dir")
    v.add_argument("--from-step", type=int, required=True)
    v.add_argument("--steps", type=int, default=5)
    v.add_argument("--drill", action="store_true")
    for sp in (r, v):
        sp.add_argument("--out", required=True, help="rank 0 writes the JSON result here")
        sp.add_argument("--progress-file", default=None, help="rank 0 reports progress here (one JSON line)")
    return p


def _write(path: str, obj: dict) -> None:
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(obj, allow_nan=True, default=str))
    os.replace(tmp, out)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from sentinel.offline import OfflineError, file_progress
    from trainer import dist as tdist
    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError, load_run_config
    from trainer.data import DataError
    from trainer.train import TrainingError

    rank = int(os.environ.get("RANK", "0"))
    result: dict
    env = None
    try:
        cfg = load_run_config(args.run_dir)
        env = tdist.init(cfg.device)
        progress = file_progress(args.progress_file) if env.is_main else None
        warn = (lambda m: print(m, file=sys.stderr, flush=True)) if env.is_main else (lambda m: None)
        if args.cmd == "replay":
            from sentinel.offline.replay import replay

            result = replay(env, Path(args.run_dir), args.step, checkpoint=args.checkpoint, top_k=args.top, rank_by=args.rank_by,
                            timeline=args.timeline,
                            progress=progress, warn=warn)
        else:
            from sentinel.offline.verify import verify_resume

            result = verify_resume(env, Path(args.run_dir), args.from_step, steps=args.steps, drill=args.drill,
                                   progress=progress, warn=warn)
    except (OfflineError, CheckpointError, TrainingError, DataError, ConfigError) as e:
        result = {"error": str(e)}
    except Exception as e:  # unexpected: the traceback goes to the workers' log, one line to the CLI
        traceback.print_exc()
        result = {"error": f"offline worker failed on rank {rank}: {e.__class__.__name__}: {e}"}
    if rank == 0:
        _write(args.out, result)
    tdist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
