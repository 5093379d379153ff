"""``python -m trainer``: train a GPT; restart with the same --run-dir to resume exactly.

  python -m trainer --preset tiny --run-dir runs/demo --max-steps 200 --ckpt-every 50
  torchrun --nproc-per-node 2 -m trainer --preset tiny --run-dir runs/ddp
  torchrun --nproc-per-node 2 -m trainer --preset tiny --run-dir runs/fsdp --fsdp
"""

from __future__ import annotations

import argparse
import os
import stat
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
    p.add_argument("--max-steps", type=int, metavar="N", help="train until optimizer step N (a resumed run goes on to N)")
    p.add_argument("--ckpt-every", type=int, metavar="K", help="checkpoint every K steps (0: only at the end)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed: model init and data order")
    p.add_argument("--data", metavar="DIR", help="prepared dataset dir (default: the bundled Shakespeare corpus)")
    p.add_argument("--micro-batch", type=int, metavar="B", help="sequences per rank per forward/backward (data.micro_batch_size)")
    p.add_argument("--grad-accum", type=int, metavar="A", help="micro-batches accumulated per optimizer step (data.grad_accum)")
    p.add_argument("--lr", type=float, metavar="LR", help="peak learning rate of the schedule (optim.lr)")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (fully_shard) instead of DDP")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (inductor; the first steps pay the compilation)")
    p.add_argument("--async-ckpt", action="store_true", help="snapshot to CPU and write checkpoints in the background")
    p.add_argument("--keep-last", type=int, metavar="N", help="keep the newest N checkpoints, delete older ones (checkpoint.keep_last)")
    p.add_argument("--keep-every", type=int, metavar="K",
                   help="also keep every checkpoint whose step is a multiple of K, forever (checkpoint.keep_every)")
    p.add_argument("--eval-every", type=int, metavar="N", help="validate (per slice, plus the probe sets) every N steps (eval.every)")
    p.add_argument("--skip", action="append", default=[], metavar="LO:HI", help="skip sample ids [LO, HI) (repeatable)")
    p.add_argument("--inject-fault", action="append", default=[], metavar="KIND@LO[:HI]",
                   help="drill: garbage|lr|nan on sample ids [LO, HI) (HI exclusive, like --skip); "
                        "lr takes a factor: lr@ID:F or lr@LO:HI:F; the old inclusive LO-HI form is deprecated; "
                        "slow@RANK:SECONDS makes one rank sleep in every step (a straggler); "
                        "mixture drills: corrupt_source@NAME:FROM_STEP, reweight@NAME:FACTOR:FROM_STEP")
    p.add_argument("--telemetry", choices=["on", "off"], help="Prometheus endpoints and the bus (default on)")
    p.add_argument("--redis-url", metavar="URL", help="control bus: redis[s]://..., or 'embedded' for one in the run dir")
    p.add_argument("--metrics-host", metavar="ADDR", help="address the Prometheus endpoints bind (0.0.0.0 for a Prometheus on another host)")
    p.add_argument("--metrics-port", type=int, metavar="PORT", help="base port; rank r serves PORT+local_rank (0: free ports)")
    p.add_argument("--peak-flops", type=float, metavar="FLOPS", help="override the device's peak FLOP/s for MFU")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where to train (default auto: CUDA when available)")
    p.add_argument("--set", action="append", default=[], metavar="PATH=VALUE", help="override any config field")
    return p


def _overrides(args) -> dict:
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
    if args.compile:
        o["compile"] = True
    if args.async_ckpt:
        o["checkpoint.async_save"] = True
    if args.telemetry:
        o["telemetry.enabled"] = args.telemetry == "on"
    if args.skip:
        o["data.skip"] = [_skip_range(s) for s in args.skip]
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
        o[k.strip()] = _yaml_value(k.strip(), v)
    return o


def _skip_range(text: str) -> list[int]:
    """``--skip LO:HI`` as [lo, hi], refused in one line unless 0 <= LO < HI (as `sentinel skip-list`)."""
    from trainer.config import MAX_SAMPLE_ID, ConfigError

    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--skip {text!r}: expected LO:HI (sample ids [LO, HI), HI excluded, as everywhere)") from None
    if not 0 <= lo < hi <= MAX_SAMPLE_ID:
        why = ("an empty or reversed range" if lo >= hi else "a negative sample id" if lo < 0
               else "a sample id past int64")
        raise ConfigError(f"--skip {text!r}: {why}; need 0 <= LO < HI <= {MAX_SAMPLE_ID} (HI excluded)")
    return [lo, hi]


def _yaml_value(key: str, text: str):
    """The value of ``--set KEY=TEXT``, parsed as YAML with the safe loader (plain data: no
    ``!!python/...`` tags); anything it refuses is one line, not the parser's multi-line report."""
    from sentinel.contract.yamlio import YamlError, parse_yaml
    from trainer.config import ConfigError

    try:
        return parse_yaml(text)
    except YamlError as e:
        raise ConfigError(f"--set {key}: not a valid YAML value ({e.reason})") from None


def _not_utf8(args) -> str | None:
    """The first flag whose text is not UTF-8 (bytes the shell passed through as lone surrogates).
    Every value ends up in config.yaml, steps.jsonl, the bus or a Prometheus label, all UTF-8."""
    for name, value in vars(args).items():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, str):
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return f"--{name.replace('_', '-')} {v.encode('utf-8', 'backslashreplace').decode()!r}: not valid UTF-8 text"
    return None


def _run_dir_problem(run_dir: str) -> str | None:
    """Why ``--run-dir`` cannot be a run directory, checked before anything is created in it.
    ``""`` would be the current directory (Path("") is "."): refused, never turned into a run dir."""
    if not run_dir.strip():
        return "--run-dir is empty: name the run directory (it is created if missing)"
    try:
        st = os.stat(run_dir)
    except FileNotFoundError:
        return None  # created by the trainer
    except OSError as e:  # a name too long, a parent that is a file, a symlink loop, no permission
        return f"--run-dir: {e.strerror or type(e).__name__}" + (f" ({run_dir[:80]}...)" if len(run_dir) > 80 else f": {run_dir}")
    if not stat.S_ISDIR(st.st_mode):
        return f"--run-dir {run_dir}: exists and is not a directory"
    return None


def _cuda_problem(device: str) -> str | None:
    """``--device cuda`` on a machine without a usable GPU: one line before the run dir is touched
    (torch.cuda.set_device would raise deep inside torch)."""
    if device != "cuda":
        return None
    import torch

    if not torch.cuda.is_available():
        return "CUDA is not available on this machine (--device cuda); use --device cpu or auto"
    return None


def _memory_problem(cfg) -> str | None:
    """A model on the CPU that cannot fit this machine's memory (fp32 weights, gradients and two Adam
    moments: 16 bytes a parameter), said before anything is allocated: past it, the kernel's OOM
    killer ends the process with no message (and takes memory from whatever runs beside it)."""
    import torch

    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        return None
    m = cfg.model
    params = 12 * m.n_layer * m.d_model**2 + ((m.vocab_size or 65536) + m.seq_len) * m.d_model
    need = 16 * params
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    if need <= total:
        return None
    return (f"a model of ~{params:.3g} parameters needs ~{need / 2**30:,.0f} GiB on the CPU (weights, gradients, "
            f"Adam moments); this machine has {total / 2**30:,.0f} GiB: lower model.n_layer / model.d_model")


def _raised_in(e: BaseException, module: str, function: str) -> bool:
    """Whether ``e`` went through ``module.function`` on its way up (its traceback has that frame)."""
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == function and frame.f_globals.get("__name__") == module:
            return True
        tb = tb.tb_next
    return False


def _metrics_serve_problem(e: OSError, cfg, local_rank: int) -> str | None:
    """The metrics endpoint could not be served (a host that does not resolve or is not ours, a port
    in use or not allowed): say which address and which flags, not only the OS's words. None for an
    OSError from anywhere else."""
    if not _raised_in(e, "sentinel.client.metrics", "serve"):
        return None
    host, base = str(cfg.telemetry.metrics_host), cfg.telemetry.metrics_port
    port = base + local_rank if base else 0
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in host[:80]) + ("..." if len(host) > 80 else "")
    addr = f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"
    rank = f", the base port + local rank {local_rank}" if base and local_rank else ""
    why = e.strerror or " ".join(str(e).split()) or type(e).__name__
    return f"cannot serve metrics on {addr} (--metrics-host/--metrics-port{rank}): {why}"


def _say(msg: str) -> None:
    """``error: MSG`` on stderr, always one line (a newline in a flag or a path is shown escaped)."""
    print("error: " + str(msg).replace("\r", "\\r").replace("\n", "\\n"), file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from sentinel.client.extras import missing_module

    if (missing := missing_module(("torch",), "python -m trainer")) is not None:
        _say(missing + " (for CUDA, install your torch build first)")
        return 2
    from trainer.config import ConfigError, load_yaml, resolve

    # every check that can refuse the flags runs before the run dir (lock, step log) is created
    bad = _not_utf8(args) or _run_dir_problem(args.run_dir)
    if bad:
        _say(bad)
        return 2
    run_dir = Path(args.run_dir)
    try:
        saved_path = run_dir / "config.yaml"
        saved = load_yaml(saved_path) if os.path.lexists(saved_path) else None
        cfg = resolve(preset=args.preset, config_file=args.config, saved=saved, overrides=_overrides(args))
    except ConfigError as e:
        _say(e)
        return 2
    bad = _cuda_problem(cfg.device) or _memory_problem(cfg)
    if bad:
        _say(bad)
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
        _say(e)
        return 2
    except MemoryError:
        _say("out of memory (the model, the batch or the guard window is larger than this machine holds)")
        return 2
    except RuntimeError as e:  # torch's allocator: "[enforce fail at alloc_cpu.cpp] ... can't allocate memory"
        if _lost_peer(e):  # another rank (or node) died mid-collective: one line, then torchrun ends the job
            _say(f"a collective failed: another rank or node is gone ({' '.join(str(e).split())[-160:]}); "
                 "restart the job to resume from the newest checkpoint")
            return 2
        if "allocate" not in str(e) or "memory" not in str(e):
            raise
        _say(f"out of memory: {' '.join(str(e).split())[-200:]}")
        return 2
    except OSError as e:  # storage outside the handled paths (run dir, config, targets): full, read-only, gone
        bad = _metrics_serve_problem(e, cfg, env.local_rank)
        if bad:
            _say(bad)
            return 2
        where = f": {e.filename}" if e.filename else ""
        _say(f"{e.strerror or e}{where}")
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


def _lost_peer(e: BaseException) -> bool:
    """A collective broken by a peer that died (gloo: connection reset or closed; NCCL: a remote error)."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        s in text for s in ("Connection reset by peer", "Connection closed by peer", "remote process exited", "Broken pipe"))


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
