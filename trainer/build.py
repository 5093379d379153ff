"""Building a Trainer's parts: the model (single, DDP or FSDP2) and its optimizer, and the telemetry
edges (Prometheus /metrics and its file-SD targets, the control bus). Each sets the trainer's attributes
that ``trainer/train.py`` reads."""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from trainer import rng
from trainer.errors import TrainingError
from trainer.model import GPT
from trainer.optim import build_optimizer
from trainer.phases import PhaseClock


def _timed_allreduce(clock: PhaseClock, bucket):
    """DDP's default gradient all-reduce (average over ranks), stamping when each bucket is ready: the
    last stamp ends this rank's forward/backward, what follows until backward returns is waiting."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    clock.grads_ready()
    return allreduce_hook(None, bucket)


def compile_model(model: torch.nn.Module, *, per_block: bool) -> None:
    """``torch.compile`` in place (``Module.compile``), before DDP or FSDP2 wrap the model: the module
    objects, their parameters and ``state_dict``'s keys stay what they were, so checkpoints are the
    same files with or without it, and a run may be resumed either way (its numerics then differ by
    rounding: an exact resume keeps the setting, which the saved config does). DDP's hooks see the
    gradients of the compiled backward as of any other. With FSDP2 each block is compiled on its own
    (``per_block``), as torchtitan does, so that FSDP2's all-gathers stay outside the graphs; else the
    whole model is one graph (one for training, one for evaluation)."""
    for module in (model.blocks if per_block else [model]):
        module.compile()


def _check_attention(cfg, env) -> None:
    """``model.attention: triton`` needs CUDA and the triton package: without CUDA the model uses SDPA
    (said once), without the package the start stops in one line."""
    if cfg.model.attention != "triton":
        return
    if env.device.type != "cuda":
        if env.is_main:
            print(f"note: model.attention triton runs on CUDA only; this {env.device.type} run uses SDPA", flush=True)
        return
    try:
        import trainer.attention_triton  # noqa: F401
    except ImportError as e:
        raise TrainingError(f"model.attention: triton needs the triton package ({e}); pip install triton, "
                            "or set model.attention=sdpa") from None


def setup_model(tr) -> None:
    cfg, env = tr.cfg, tr.env
    _check_attention(cfg, env)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg.model).to(env.device)
    tr.n_params = model.num_params(non_embedding=True)
    tr.raw_model = model
    if cfg.compile:
        compile_model(model, per_block=cfg.parallelism == "fsdp")
    if cfg.parallelism == "fsdp":
        from torch.distributed.fsdp import fully_shard

        if env.distributed:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        tr.model = model
    elif env.distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        tr.model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
        tr.model.register_comm_hook(tr.clock, _timed_allreduce)
    else:
        tr.model = model
    rng.seed_all(cfg.seed, env.rank)
    tr.opt = build_optimizer(model, cfg.optim)
    tr.autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if env.device.type == "cuda" else contextlib.nullcontext()
    )


def setup_telemetry(tr) -> None:
    cfg, env = tr.cfg, tr.env
    if not cfg.telemetry.enabled:
        return
    from sentinel.client.metrics import TrainerMetrics
    from trainer.telemetry.mfu import flops_per_token, peak_flops

    m = cfg.model

    def fpt(seq_len: int) -> float:  # the attention term grows with the sequence length in effect
        return flops_per_token(n_params_non_embedding=tr.n_params, n_layer=m.n_layer, d_model=m.d_model,
                               seq_len=seq_len, vocab_size=m.vocab_size)
    tr.flops_per_token = fpt
    dev_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
    dtype = "bf16" if env.device.type == "cuda" else "fp32"
    tr.peak = peak_flops(dev_name, dtype, cfg.telemetry.peak_flops)
    tr.metrics = TrainerMetrics(
        run=tr.run_id, rank=env.rank, world_size=env.world_size, model=cfg.preset or "custom",
        parallelism=cfg.parallelism if env.distributed else "single", device=dev_name or env.device.type, dtype=dtype,
        # training_info's gpu_uuid joins a rank to the DCGM exporter's series of its GPU
        gpu_uuid=str(torch.cuda.get_device_properties(env.device).uuid) if env.device.type == "cuda" else None,
    )
    tr.metrics.set_slices(tr.ds.source_names)
    if not tr.ds.is_mixture:  # a mixture's weights are set at its first step (drills may move them)
        tr.metrics.set_mixture_weights({tr.ds.source_names[0]: 1.0})
    base = cfg.telemetry.metrics_port
    port = tr.metrics.serve(cfg.telemetry.metrics_host, base + env.local_rank if base else 0)
    publish_targets(tr, port)
    if env.is_main and cfg.telemetry.redis_url:
        connect_bus(tr, cfg.telemetry.redis_url)


def publish_targets(tr, port: int) -> None:
    from sentinel.client.targets import write_targets

    host = tr.cfg.telemetry.metrics_host
    if tr.env.distributed:
        gathered: list = [None] * tr.env.world_size
        dist.all_gather_object(gathered, (host, port, tr.env.rank), group=tr.env.control_group)
    else:
        gathered = [(host, port, 0)]
    if tr.env.is_main:
        write_targets(tr.run_dir, tr.run_id, gathered)


def connect_bus(tr, url: str) -> None:
    from sentinel.bus import load_secret
    from sentinel.client.bus import BusClient

    reconnect = None
    if url == "embedded":
        from sentinel.embedded import ensure_embedded

        url = ensure_embedded(tr.run_dir)
        run_dir = tr.run_dir

        def reconnect() -> str:  # the embedded bus's supervisor: a dead bus is restarted from its AOF
            return ensure_embedded(run_dir)
    tr.secret = load_secret(tr.run_dir)
    # from the persisted stream position (else the stream start): directives are also deduplicated by
    # id against directives.jsonl, and a rejected entry is never read again after a restart
    tr.bus = BusClient(url, tr.run_id, tr.secret, start_after_id="0-0",
                         cursor_file=tr.run_dir / "directives.cursor", reconnect=reconnect)
    tr.bus_url = url
    # from the bus client's I/O thread, and again whenever the bus has lost it (never fails the run)
    tr.bus.register({"run_dir": str(tr.run_dir.resolve()), "world_size": tr.env.world_size,
                       "model": tr.cfg.preset or "custom", "started": time.time()})

# ================================================================== state
