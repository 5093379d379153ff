"""``python -m trainer``: train a GPT; restart with the same --run-dir to resume exactly.

  python -m trainer --preset tiny --run-dir runs/demo --max-steps 200 --ckpt-every 50
  torchrun --nproc-per-node 2 -m trainer --preset tiny --run-dir runs/ddp
  torchrun --nproc-per-node 2 -m trainer --preset tiny --run-dir runs/fsdp --fsdp
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, like our own errors, not usage + error
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m trainer",
        description="Distributed GPT pretraining with full-state checkpoints and bitwise-exact resume.",
        epilog="Any config field can be set with --set path=value (e.g. --set optim.lr=1e-3). "
        "Restarting with the same --run-dir resumes from the newest valid checkpoint.",
    )
    p.add_argument("--run-dir", required=True, metavar="DIR", help="run directory (created if missing)")
    p.add_argument("--preset", choices=["tiny", "small", "gpt2-124m"], help="model/recipe preset (default: tiny, or the run's saved config)")
    p.add_argument("--config", metavar="YAML", help="YAML config file layered over the preset")
    p.add_argument("--max-steps", type=int, metavar="N")
    p.add_argument("--ckpt-every", type=int, metavar="K", help="checkpoint every K steps (0: only at the end)")
    p.add_argument("--seed", type=int)
    p.add_argument("--data", metavar="DIR", help="prepared dataset dir (default: the bundled Shakespeare corpus)")
    p.add_argument("--micro-batch", type=int, metavar="B")
    p.add_argument("--grad-accum", type=int, metavar="A")
    p.add_argument("--lr", type=float)
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--async-ckpt", action="store_true", help="snapshot to CPU and write checkpoints in the background")
    p.add_argument("--keep-last", type=int, metavar="N")
    p.add_argument("--keep-every", type=int, metavar="K")
    p.add_argument("--eval-every", type=int, metavar="N")
    p.add_argument("--skip", action="append", default=[], metavar="LO:HI", help="skip sample ids [LO, HI) (repeatable)")
    p.add_argument("--inject-fault", action="append", default=[], metavar="KIND@LO[:HI]",
                   help="drill: garbage|lr|nan on sample ids [LO, HI) (HI exclusive, like --skip); "
                        "lr takes a factor: lr@ID:F or lr@LO:HI:F; the old inclusive LO-HI form is deprecated; "
                        "slow@RANK:SECONDS makes one rank sleep in every step (a straggler); "
                        "mixture drills: corrupt_source@NAME:FROM_STEP, reweight@NAME:FACTOR:FROM_STEP")
    p.add_argument("--telemetry", choices=["on", "off"], help="Prometheus endpoints and the bus (default on)")
    p.add_argument("--redis-url", metavar="URL", help="control bus: redis[s]://..., or 'embedded' for one in the run dir")
    p.add_argument("--metrics-host", metavar="ADDR")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="base port; rank r serves PORT+local_rank (0: free ports)")
    p.add_argument("--peak-flops", type=float, metavar="FLOPS", help="override the device's peak FLOP/s for MFU")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"])
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override any config field")
    return p


def _overrides(args) -> dict:
    import yaml

    from trainer.config import ConfigError, Fault, SourceFault

    o: dict = {}
    simple = {
        "max_steps": "max_steps", "ckpt_every": "checkpoint.every", "seed": "seed", "data": "data.dir",
        "micro_batch": "data.micro_batch_size", "grad_accum": "data.grad_accum", "lr": "optim.lr",
        "keep_last": "checkpoint.keep_last", "keep_every": "checkpoint.keep_every", "eval_every": "eval.every",
        "redis_url": "telemetry.redis_url", "metrics_host": "telemetry.metrics_host",
        "metrics_port": "telemetry.metrics_port", "peak_flops": "telemetry.peak_flops", "device": "device",
    }
    for attr, path in simple.items():
        v = getattr(args, attr)
        if v is not None:
            o[path] = v
    if args.fsdp:
        o["parallelism"] = "fsdp"
    if args.async_ckpt:
        o["checkpoint.async_save"] = True
    if args.telemetry:
        o["telemetry.enabled"] = args.telemetry == "on"
    if args.skip:
        ranges = []
        for s in args.skip:
            try:
                lo, hi = (int(x) for x in s.split(":"))
            except ValueError:
                raise ConfigError(f"--skip {s!r}: expected LO:HI (sample ids [LO, HI), HI excluded, as everywhere)") from None
            ranges.append([lo, hi])
        o["data.skip"] = ranges
    if args.inject_fault:  # mixture drills (corrupt_source@, reweight@) are keyed to a source, not ids
        by_id = [Fault.parse(f).model_dump() for f in args.inject_fault if not SourceFault.matches(f)]
        by_source = [SourceFault.parse(f).model_dump() for f in args.inject_fault if SourceFault.matches(f)]
        if by_id:
            o["faults"] = by_id
        if by_source:
            o["source_faults"] = by_source
    for item in args.set:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected PATH=VALUE")
        k, v = item.split("=", 1)
        o[k.strip()] = yaml.safe_load(v)
    return o


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from trainer.config import ConfigError, load_yaml, resolve

    run_dir = Path(args.run_dir)
    try:
        saved = load_yaml(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else None
        cfg = resolve(preset=args.preset, config_file=args.config, saved=saved, overrides=_overrides(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from trainer import dist as tdist
    from trainer.checkpoint import CheckpointError
    from trainer.data import DataError
    from trainer.train import Trainer, TrainingError

    env = tdist.init(cfg.device)
    if cfg.deterministic:
        from trainer.determinism import make_deterministic

        make_deterministic(env.device.type)
    try:
        Trainer(cfg, run_dir, env).fit()
    except (DataError, CheckpointError, TrainingError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:  # storage outside the handled paths (run dir, config, targets): full, read-only, gone
        where = f": {e.filename}" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # our own one-line errors from other layers (e.g. sentinel.bus.BusError: no secret)
        if type(e).__module__.startswith(("sentinel.", "trainer.")) and type(e).__name__.endswith("Error"):
            print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr, flush=True)
            return 2
        raise
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        tdist.shutdown()
    return 0


if __name__ == "__main__":
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A torchrun worker leaves without interpreter finalization. Its process group is destroyed
        # and every file is flushed and closed by now, but the DDP reducer and the trainer still hold
        # gloo work objects; freeing those while the interpreter is being torn down now and then ends
        # in std::terminate ("terminate called without an active exception", exit -6) on one rank
        # after a clean run (seen on 2-rank DDP and FSDP runs). Nothing is left to finalize.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
