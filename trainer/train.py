"""The training loop: one optimizer step at a time, with everything needed to stop and resume exactly.

Single process:      python -m trainer --preset tiny --run-dir runs/a --max-steps 100
Distributed (CPU):   torchrun --nproc-per-node 2 -m trainer --preset tiny --run-dir runs/a
FSDP2:               torchrun --nproc-per-node 2 -m trainer --preset tiny --run-dir runs/b --fsdp

State at a step boundary, S_t = (params, optimizer moments + step counts, scheduler step, RNG of
every rank, data cursor, grad-accumulation position, skip list, guard statistics, tokens seen), is
exactly what a checkpoint holds; ``TrainState`` carries the host-side part of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from sentinel.contract.rundir import STEPS, RunFileError
from sentinel.contract.rundir import read_skip_removals as _read_skip_removals
from sentinel.protocol import (
    MAX_RECORD_BYTES,
    PENDING_ROLLBACK,
    SKIP_REMOVED,
    Ack,
    CheckpointInfo,
    Directive,
    MarkerRecord,
    SchemaError,
    StepRecord,
    TimelineRecord,
    loads_bounded,
    merge_ranges,
    pending_rollback_error,
    read_regular_file,
    subtract_ranges,
)
from trainer import faults as drills
from trainer import rng, rundir_lock, seqlen
from trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    check_optimizer_state,
    check_rng,
    check_tensors,
    list_checkpoints,
    load_torch,
    manifest_digest,
    read_train_state,
    step_dir_name,
    verify,
)
from trainer.config import TrainConfig, dump
from trainer.data import DataError, MixtureSampler, SkipList, TokenDataset, batch_fingerprint, ensure_prepared, sampler_for
from trainer.dist import DistEnv
from trainer.guard import REASONS, StepGuard
from trainer.model import GPT
from trainer.optim import build_optimizer, lr_at
from trainer.phases import RANK_PHASES, PhaseClock, as_dict
from trainer.readback import StepReadback
from trainer.slices import MixtureWeights, SliceEval, describe_change, lr_phase_markers, source_onehot
from sentinel.client.steplog import StepLog, clean_text


class TrainingError(Exception):
    """A one-line, user-facing reason the run cannot start or continue."""


def _read_pending_plan(path: Path) -> tuple[dict | None, str | None]:
    """(plan, None) from ``pending_rollback.json`` (written by ``sentinel rollback`` offline), or
    (None, why) when it is not one: a hostile or corrupt plan is refused in one line, not applied
    half-way and not silently dropped (the operator asked for a rollback)."""
    fix = "fix it or write a new plan with `sentinel rollback`, then start again"
    try:  # bounded: a symlink to /dev/zero or a FIFO is refused, not read forever (sentinel.protocol.read_regular_file)
        plan = loads_bounded(read_regular_file(path, MAX_RECORD_BYTES), path.name)  # not UTF-8, not JSON, too deep: one line
    except OSError as e:
        return None, f"{path} is unreadable ({e.strerror or e}): {fix}"
    except SchemaError as e:
        return None, f"{path} is unreadable ({e}): {fix}"
    bad = pending_rollback_error(plan)
    empty = None if bad else next((r for r in plan.get("ranges", []) if r[1] <= r[0]), None)
    if empty is not None:  # what `sentinel rollback --skip` refuses ("need 0 <= LO < HI"): a damaged plan
        bad = f"range {empty} is empty or reversed; need lo < hi"
    if bad:
        return None, f"{path} is malformed ({bad}): {fix}"
    return plan, None


def read_skip_removals(run_dir: Path) -> tuple[list[tuple[int, int]] | None, str | None]:
    """(ranges, None) from ``skiplist.removed.json`` (``sentinel skip-list remove``; [] or no file: none),
    or (None, why) when it is unreadable or malformed: refused in one line like a bad plan (the operator asked)."""
    try:
        return _read_skip_removals(run_dir), None
    except RunFileError as e:
        return None, f"{e}: fix or delete it, then start again"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    tokens: int = 0  # tokens trained (global, excluding skipped steps)
    timeline: int = 0  # +1 at every resume or rollback
    accum_pos: int = 0  # micro-batches of the current step already done (0 at every step boundary)


@dataclass
class Directives:
    """Host-side control flags, identical on every rank after the broadcast."""

    paused: bool = False
    stop: bool = False
    applied: set[str] = field(default_factory=set)


def _log(env: DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


def param_digest_tensor(params) -> torch.Tensor:
    """Cheap, exact, order-independent fingerprint of the parameters, computed on the device.

    Per parameter: the sum of its raw bits read as int32 words and as int16 half-words (for 2-byte
    dtypes: int16 and int8), accumulated in int64. Each sum is one read pass with no temporaries
    (about 1/16 of the cost of a bit-mixing product). Integer sums are associative, so the digest
    is the same for any reduction order or sharding: FSDP sums the shard digests with an all-reduce.
    Two word sizes make offsetting changes (a +d in one word, a -d in another) much less likely to
    cancel in both.
    """
    out = []
    for p in params:
        t = p.detach()
        if hasattr(t, "to_local"):
            t = t.to_local()
        t = t.contiguous().reshape(-1)
        wide, narrow = (torch.int32, torch.int16) if t.element_size() == 4 else (torch.int16, torch.int8)
        out.append(torch.stack([t.view(wide).sum(dtype=torch.int64), t.view(narrow).sum(dtype=torch.int64)]))
    return torch.stack(out).reshape(-1) if out else torch.zeros(2, dtype=torch.int64)


def _timed_allreduce(clock: PhaseClock, bucket):
    """DDP's default gradient all-reduce (average over ranks), stamping when each bucket is ready: the
    last stamp ends this rank's forward/backward, what follows until backward returns is waiting."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    clock.grads_ready()
    return allreduce_hook(None, bucket)


def digest_hex(values) -> str:
    arr = np.asarray(values if isinstance(values, list) else [values], dtype=np.int64)
    return hashlib.sha256(arr.tobytes()).hexdigest()[:16]


class Trainer:
    def __init__(self, cfg: TrainConfig, run_dir: Path, env: DistEnv, *, offline: bool = False):
        """``offline=True`` builds the same model/optimizer/data/guard for replay tools, with no side
        effects on the run dir: no config write, no step log, no telemetry, no bus."""
        self.cfg, self.run_dir, self.env = cfg, Path(run_dir), env
        self.offline = offline
        self._stop_signal: str | bool = False  # the signal's name once SIGTERM/SIGINT arrived
        if not offline:  # from the start: a SIGTERM during setup still ends in a checkpoint, not a kill
            self._install_signals()
        self.run_id = cfg.run_id or clean_text(self.run_dir.resolve().name)  # a byte name: \udcff escapes
        self.state = TrainState()
        self.ctl = Directives()
        self._last_ckpt_time: float | None = None
        # the newest valid checkpoint (step, time) and consecutive failed saves since: bounds the work a
        # failing disk can put at risk (checkpoint.max_age_steps / max_age_seconds)
        self._good_ckpt = (0, time.time())
        self._ckpt_failed = 0
        self._throughput: deque = deque(maxlen=20)
        self._rejected_seen = 0
        self._removals_applied = False  # skiplist.removed.json was applied: deleted at the next checkpoint
        self._ckpt_group = None  # lazily created gloo group for FSDP2 async checkpoints
        self.unloadable: list[str] = []  # why each checkpoint the last load_checkpoint passed over failed

        # the dataset first: a bad --data (or one too small for a batch) is refused before anything is
        # created in the run dir; the run dir's own state (the skip list) is read once its lock is held
        self._setup_data()
        self._setup_run_dir()
        self._load_skiplist()
        self.clock = PhaseClock(env.device)  # before the model: DDP's comm hook stamps gradient readiness
        self._setup_model()
        self.guard = StepGuard(cfg.guard, env.device)
        self.readback = StepReadback(env.device)
        self.ckpt = Checkpointer(
            self.run_dir, rank=env.rank, world_size=env.world_size,
            keep_last=cfg.checkpoint.keep_last, keep_every=cfg.checkpoint.keep_every,
            barrier=env.barrier, all_ok=env.all_ok, log=lambda m: print(m, flush=True),
        )
        self.steplog = StepLog(self.run_dir / STEPS, log=lambda m: print(m, flush=True)) if env.is_main and not offline else None
        self.metrics = self.bus = self.secret = self.flops_per_token = self.peak = None
        if not offline:
            self._setup_telemetry()

    # ================================================================== setup
    def _setup_run_dir(self) -> None:
        if self.offline:
            if not self.run_dir.is_dir():
                raise TrainingError(f"run dir not found: {self.run_dir}")
            return
        busy = None
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            try:  # rank 0 only: torchrun's other ranks of this run share its lock
                self._lock_fd = rundir_lock.acquire(self.run_dir)
            except rundir_lock.RunDirBusy as e:
                busy = str(e)
        busy = self.env.broadcast_object(busy)  # every rank of the second trainer exits, with one line
        if busy:
            raise TrainingError(busy)
        # written once start() has restored (or begun) the run: a start that fails (e.g. --data of a
        # different dataset) must not overwrite the config a plain `--run-dir` resume relies on
        self._config_text = dump(self.cfg)

    def _setup_data(self) -> None:
        cfg = self.cfg
        data_dir = Path(cfg.data.dir) if cfg.data.dir else None
        if data_dir is None:
            if self.env.is_main:
                data_dir = ensure_prepared()
            self.env.barrier()
            data_dir = ensure_prepared()
        self.data_dir = data_dir
        self.ds = TokenDataset.open(data_dir)
        vocab = cfg.model.vocab_size or self.ds.vocab_size
        if vocab < self.ds.vocab_size:
            raise TrainingError(f"model.vocab_size {vocab} is smaller than the dataset's vocabulary ({self.ds.vocab_size})")
        cfg.model.vocab_size = vocab
        n = self.ds.num_samples(cfg.model.seq_len)
        if n < self.global_batch:
            raise TrainingError(f"dataset {data_dir} has {n} samples of length {cfg.model.seq_len}, fewer than one global batch ({self.global_batch})")
        self.n_sources = len(self.ds.sources)
        self.per_source = self.n_sources > 1  # one slice: its loss is the step loss, nothing to compute
        try:
            self.mix_weights = MixtureWeights(self.ds, cfg)
            self.sampler = sampler_for(self.ds, cfg.model.seq_len, cfg.seed, self.mix_weights.at(1))
        except DataError as e:
            raise TrainingError(str(e)) from None
        self.weights_now: dict[str, float] | None = None  # normalised weights of the last step trained
        self.seq_now: int | None = None  # tokens per sequence of the last step trained (seq_len schedule)
        self.step_source_sums: torch.Tensor | None = None  # per-source loss sums of the last train_step
        self.slice_eval = None
        if cfg.eval.every:
            self.slice_eval = SliceEval(self.ds, cfg.model.seq_len, cfg.data.micro_batch_size, cfg.eval.batches,
                                        cfg.eval.probe_samples, log=lambda m: _log(self.env, m))
        self.val = self.slice_eval.batches if self.slice_eval else []

    def _load_skiplist(self) -> None:
        # the skip list only grows: config + the run dir's file (which the sentinel may have grown)
        self.skip = SkipList.load(self.run_dir / "skiplist.json")
        if self.cfg.data.skip:
            self.skip.add(self.cfg.data.skip)

    @property
    def global_batch(self) -> int:
        d = self.cfg.data
        return d.micro_batch_size * d.grad_accum * self.env.world_size

    def _setup_model(self) -> None:
        cfg, env = self.cfg, self.env
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        model = GPT(cfg.model).to(env.device)
        self.n_params = model.num_params(non_embedding=True)
        self.raw_model = model
        if cfg.parallelism == "fsdp":
            from torch.distributed.fsdp import fully_shard

            if env.distributed:
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            self.model = model
        elif env.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)
            self.model.register_comm_hook(self.clock, _timed_allreduce)
        else:
            self.model = model
        rng.seed_all(cfg.seed, env.rank)
        self.opt = build_optimizer(model, cfg.optim)
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if env.device.type == "cuda" else contextlib.nullcontext()
        )

    def _setup_telemetry(self) -> None:
        cfg, env = self.cfg, self.env
        if not cfg.telemetry.enabled:
            return
        from sentinel.client.metrics import TrainerMetrics
        from trainer.telemetry.mfu import flops_per_token, peak_flops

        m = cfg.model

        def fpt(seq_len: int) -> float:  # the attention term grows with the sequence length in effect
            return flops_per_token(n_params_non_embedding=self.n_params, n_layer=m.n_layer, d_model=m.d_model,
                                   seq_len=seq_len, vocab_size=m.vocab_size)
        self.flops_per_token = fpt
        dev_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
        dtype = "bf16" if env.device.type == "cuda" else "fp32"
        self.peak = peak_flops(dev_name, dtype, cfg.telemetry.peak_flops)
        self.metrics = TrainerMetrics(
            run=self.run_id, rank=env.rank, world_size=env.world_size, model=cfg.preset or "custom",
            parallelism=cfg.parallelism if env.distributed else "single", device=dev_name or env.device.type, dtype=dtype,
        )
        self.metrics.set_slices(self.ds.source_names)
        if not self.ds.is_mixture:  # a mixture's weights are set at its first step (drills may move them)
            self.metrics.set_mixture_weights({self.ds.source_names[0]: 1.0})
        base = cfg.telemetry.metrics_port
        port = self.metrics.serve(cfg.telemetry.metrics_host, base + env.local_rank if base else 0)
        self._publish_targets(port)
        if env.is_main and cfg.telemetry.redis_url:
            self._connect_bus(cfg.telemetry.redis_url)

    def _publish_targets(self, port: int) -> None:
        from sentinel.client.targets import write_targets

        host = self.cfg.telemetry.metrics_host
        if self.env.distributed:
            gathered: list = [None] * self.env.world_size
            dist.all_gather_object(gathered, (host, port, self.env.rank), group=self.env.control_group)
        else:
            gathered = [(host, port, 0)]
        if self.env.is_main:
            write_targets(self.run_dir, self.run_id, gathered)

    def _connect_bus(self, url: str) -> None:
        from sentinel.bus import load_secret
        from sentinel.client.bus import BusClient

        reconnect = None
        if url == "embedded":
            from sentinel.embedded import ensure_embedded

            url = ensure_embedded(self.run_dir)
            run_dir = self.run_dir

            def reconnect() -> str:  # the embedded bus's supervisor: a dead bus is restarted from its AOF
                return ensure_embedded(run_dir)
        self.secret = load_secret(self.run_dir)
        # from the persisted stream position (else the stream start): directives are also deduplicated by
        # id against directives.jsonl, and a rejected entry is never read again after a restart
        self.bus = BusClient(url, self.run_id, self.secret, start_after_id="0-0",
                             cursor_file=self.run_dir / "directives.cursor", reconnect=reconnect)
        self.bus_url = url
        # from the bus client's I/O thread, and again whenever the bus has lost it (never fails the run)
        self.bus.register({"run_dir": str(self.run_dir.resolve()), "world_size": self.env.world_size,
                           "model": self.cfg.preset or "custom", "started": time.time()})

    # ================================================================== state
    def _train_state(self) -> dict:
        return {
            "run": self.run_id,
            "step": self.state.step,
            "tokens": self.state.tokens,
            "timeline": self.state.timeline,
            "grad_accum_pos": self.state.accum_pos,
            "sampler": self.sampler.state_dict(),
            "skiplist": [list(r) for r in self.skip.ranges],
            "guard": self.guard.state_dict(),
            "scheduler": {"kind": "warmup_cosine", "step": self.state.step, "max_steps": self.cfg.max_steps},
            "world_size": self.env.world_size,
            "dataset_fingerprint": self.ds.fingerprint,
            "faults": [f.model_dump() for f in self.cfg.faults],
            "source_faults": [f.model_dump() for f in self.cfg.source_faults],
            "mixture_weights": self.weights_now,
            "seq_len": self.cfg.model.seq_len,
            "train_seq_len": self.seq_now,
            "last_checkpoint_time": time.time(),
        }

    def save_checkpoint(self) -> None:
        cfg, env = self.cfg, self.env
        self._flush_readback()
        meta = {"run": self.run_id, "timeline": self.state.timeline, "tokens": self.state.tokens,
                "dataset_fingerprint": self.ds.fingerprint}
        per_rank = {f"rng-rank{env.rank}.pt": rng.capture()}
        shared: dict = {"train_state.json": self._train_state()}
        dcp_writer = dcp_async_writer = None
        async_save = cfg.checkpoint.async_save
        if cfg.parallelism == "fsdp" and env.distributed:
            from torch.distributed.checkpoint import save as dcp_save
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(self.model, self.opt)
            dcp_writer = lambda d: dcp_save({"model": msd, "optim": osd}, checkpoint_id=str(d))  # noqa: E731
            if async_save:
                from torch.distributed.checkpoint import async_save as dcp_async_save

                if self._ckpt_group is None:  # DCP's background collectives get their own gloo group
                    self._ckpt_group = dist.new_group(backend="gloo")
                group = self._ckpt_group
                dcp_async_writer = lambda d: dcp_async_save(  # noqa: E731
                    {"model": msd, "optim": osd}, checkpoint_id=str(d), process_group=group)
        else:
            msd, osd = self.raw_model.state_dict(), self.opt.state_dict()
            if async_save:  # snapshot to CPU now; the background thread writes while training goes on
                msd = {k: v.detach().to("cpu", copy=True) for k, v in msd.items()}
                osd = _cpu_copy(osd)
            shared["model.pt"] = msd
            shared["optim.pt"] = osd
        step = self.state.step
        self.ckpt.save(step, shared=shared, per_rank=per_rank, meta=meta, dcp_writer=dcp_writer,
                       dcp_async_writer=dcp_async_writer, async_save=async_save, on_done=self._on_checkpoint_done(step))

    def _on_checkpoint_done(self, step: int):
        def done(ok: bool, seconds: float, size: int, path: Path | None) -> None:
            now = time.time()
            if ok:
                self._last_ckpt_time = now
                self._good_ckpt, self._ckpt_failed = (step, now), 0
                if self._removals_applied and self.env.is_main:  # a checkpoint without them: they stick now
                    (self.run_dir / SKIP_REMOVED).unlink(missing_ok=True)
                    self._removals_applied = False
            else:
                self._ckpt_failed += 1
            if self.metrics:
                self.metrics.on_checkpoint(ok=ok, seconds=seconds, size_bytes=size, timestamp=now)
            if ok and path is not None:
                _log(self.env, f"checkpoint step {step} saved ({size / 1e6:.1f} MB, {seconds:.2f}s)")
                if self.bus:
                    manifest = json.loads((path / "manifest.json").read_text())
                    self.bus.register_checkpoint(CheckpointInfo(
                        run=self.run_id, step=step, path=str(path.resolve()), created=now, bytes=size,
                        manifest_sha256=manifest_digest(manifest), world_size=self.env.world_size,
                        timeline=self.state.timeline, tokens=self.state.tokens,
                    ))
                    # retention may have deleted older checkpoints: the bus must not offer them as rollback targets
                    self.bus.retain_checkpoints(s for s, _ in list_checkpoints(self.ckpt.root))
        return done

    def load_checkpoint(self, step: int | None = None, *, restore_skiplist: bool = True) -> int | None:
        """Restore S_t from the newest valid checkpoint (or exactly ``step``); return its step or None.

        Every candidate is verified and fully read and checked in memory before any state is touched;
        one that fails on any rank is reported in one line and the previous one is tried (an exact
        ``step`` fails instead). All ranks take the same decision at each candidate."""
        env = self.env
        self.ckpt.wait()
        if step is not None:
            path = self.ckpt.root / step_dir_name(step)
            if not path.is_dir():
                raise CheckpointError(f"no checkpoint at step {step} in {self.ckpt.root}")
            candidates = [(step, path)]
        else:
            candidates = list_checkpoints(self.ckpt.root, strays=True)
        self.unloadable = []
        for ck_step, path in candidates:
            why = None
            try:
                loaded = self._read_checkpoint(ck_step, path)
            except CheckpointError as e:
                loaded, why = None, str(e)
            if env.all_ok(why is None):
                self._restore(loaded, restore_skiplist=restore_skiplist)
                return ck_step
            why = why or f"{path.name}: rejected by another rank"
            if step is not None:
                raise CheckpointError(why)
            self.unloadable.append(why)
            _log(env, f"warning: checkpoint {why}; falling back to the previous one")
        return None

    def _read_checkpoint(self, step: int, path: Path) -> dict:
        """Everything this rank needs from one checkpoint, verified and checked, nothing applied yet."""
        env = self.env
        manifest = verify(path)
        ts = read_train_state(path, step)
        if ts["dataset_fingerprint"] != self.ds.fingerprint:
            raise TrainingError(
                f"dataset fingerprint mismatch: checkpoint {path.name} was trained on {ts['dataset_fingerprint']}, "
                f"this data is {self.ds.fingerprint} ({self.data_dir})"
            )
        if ts["world_size"] != env.world_size:
            raise TrainingError(
                f"checkpoint {path.name} was written by {ts['world_size']} ranks, this run has {env.world_size}; "
                "exact resume needs the same world size"
            )
        seq = self.cfg.model.seq_len
        if ts.get("seq_len", seq) != seq or ts["sampler"]["num_samples"] != self.sampler.num_samples:
            # not a bad checkpoint to fall back from: every checkpoint of the run would fail the same way
            was = f"seq_len {ts['seq_len']}" if "seq_len" in ts else f"{ts['sampler']['num_samples']} samples"
            raise TrainingError(f"checkpoint {path.name} was trained at {was}, this run has seq_len {seq} "
                                f"({self.sampler.num_samples} samples): a run cannot change model.seq_len (the position "
                                "table and every sample id depend on it); train shorter sequences first with "
                                "data.seq_len_schedule, or start a new run dir")
        if ts["guard"]["window"] != self.cfg.guard.window:
            raise TrainingError(f"checkpoint {path.name} has a guard window of {ts['guard']['window']}, "
                                f"this run {self.cfg.guard.window}; cannot resume exactly")
        out = {"ts": ts, "path": path, "manifest": manifest}
        rng_state = load_torch(path / f"rng-rank{env.rank}.pt")
        check_rng(rng_state, f"{path.name}: rng-rank{env.rank}.pt")
        out["rng"] = rng_state
        if not (path / "dcp").is_dir():
            out["model"] = load_torch(path / "model.pt")
            check_tensors(out["model"], self.raw_model.state_dict(), f"{path.name}: model.pt")
            out["optim"] = load_torch(path / "optim.pt")
            check_optimizer_state(out["optim"], self.opt, f"{path.name}: optim.pt")
        return out

    def _restore(self, ck: dict, *, restore_skiplist: bool) -> None:
        ts, path = ck["ts"], ck["path"]
        if "model" in ck:
            self.raw_model.load_state_dict(ck["model"])
            self.opt.load_state_dict(ck["optim"])
        else:
            from torch.distributed.checkpoint import load as dcp_load
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(self.model, self.opt)
            sd = {"model": msd, "optim": osd}
            try:  # DCP validates its shards against .metadata itself; a failure is one line, not a traceback
                dcp_load(sd, checkpoint_id=str(path / "dcp"))
                set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise CheckpointError(f"{path.name}: sharded state (dcp/) could not be loaded: {first[:300]}") from None
        rng.restore(ck["rng"])
        self.sampler.load_state_dict(ts["sampler"])
        # the weights the checkpointed step trained with: a different config makes a mixture_change marker
        self.weights_now = ts.get("mixture_weights")
        # likewise the length it trained at (checkpoints from before schedules: model.seq_len); the
        # initial state (step 0) trained nothing, and must come back as a fresh start has it
        self.seq_now = ts.get("train_seq_len") or (ts.get("seq_len") if ts["step"] else None)
        self.guard.load_state_dict(ts["guard"])
        if restore_skiplist:
            self.skip.add([tuple(r) for r in ts["skiplist"]])
        self.state = TrainState(step=ts["step"], tokens=ts["tokens"], timeline=self.state.timeline, accum_pos=ts["grad_accum_pos"])
        self._last_ckpt_time = ck["manifest"].get("created")
        self._good_ckpt, self._ckpt_failed = (self.state.step, time.time()), 0

    # ================================================================== control
    def _poll_control(self) -> list[dict]:
        """Rank 0 reads verified directives; every rank gets the same list at the same step boundary."""
        items: list[dict] = []
        if self.env.is_main and self.bus:
            items = [d.model_dump(mode="json") for d in self.bus.poll_directives()]
            # forged/unsigned/expired directives never get here: the bus client rejects, acks and counts them
            if self.metrics and self.bus.rejected != self._rejected_seen:
                self._rejected_seen = self.bus.rejected
                self.metrics.set_directives_rejected(self.bus.rejected_by_reason)
        if self.env.distributed:
            items = self.env.broadcast_object(items)
        return items

    def _apply(self, d: Directive) -> None:
        env = self.env
        if d.id in self.ctl.applied:
            self._ack(d, "duplicate", "already applied")
            return
        detail = None
        status = "applied"
        try:  # bounds (int64 ids) are checked before anything changes: a bad range refuses the directive
            SkipList(d.ranges)
        except DataError as e:
            status, detail = "failed", str(e)
        if status != "applied":
            pass
        elif d.kind == "skip-samples":
            self.skip.add(d.ranges)
            self._persist_skiplist()
            detail = f"skip list now covers {len(self.skip)} samples"
        elif d.kind == "rollback":
            if d.to_step is None:
                status, detail = "failed", "rollback without to_step"
            else:
                self.skip.add(d.ranges)
                self._persist_skiplist()
                try:
                    self.rollback(d.to_step, reason=d.reason, directive_id=d.id, ranges=d.ranges)
                    detail = f"resumed at step {self.state.step}, timeline {self.state.timeline}"
                except (CheckpointError, TrainingError) as e:
                    status, detail = "failed", str(e)
        elif d.kind == "checkpoint-now":
            self.save_checkpoint()
        elif d.kind in ("pause", "resume"):
            self.ctl.paused = d.kind == "pause"
            if self.bus:  # on the heartbeat: a paused run is not a hung one (sentinel status, hang rule)
                self.bus.set_paused(self.ctl.paused)
        elif d.kind == "stop":
            self.ctl.stop = True
        self.ctl.applied.add(d.id)
        if env.is_main:
            with open(self.run_dir / "directives.jsonl", "a") as f:
                entry = {"id": d.id, "kind": d.kind, "status": status, "step": self.state.step,
                         "timeline": self.state.timeline, "time": time.time(), "issuer": d.issuer,
                         "reason": d.reason, "incident_id": d.incident_id}
                if d.ranges:  # what it put on the skip list: `sentinel skip-list RUN show` says why each range is there
                    entry["ranges"] = [list(r) for r in d.ranges]
                f.write(json.dumps(entry) + "\n")
        if self.metrics and status == "applied":
            self.metrics.on_directive(d.kind, True)
        self._ack(d, status, detail)
        _log(env, f"directive {d.kind} ({d.id[:8]}): {status}" + (f" — {detail}" if detail else ""))

    def _ack(self, d: Directive, status: str, detail: str | None) -> None:
        if self.env.is_main and self.bus:
            self.bus.ack(Ack(run=self.run_id, directive_id=d.id, kind=d.kind, status=status,
                             step=self.state.step, timeline=self.state.timeline, detail=detail))

    def _persist_skiplist(self) -> None:
        if self.env.is_main:
            self.skip.save(self.run_dir / "skiplist.json")
            if self.bus:
                self.bus.set_skiplist(self.skip.ranges)

    def _load_applied_directives(self) -> None:
        p = self.run_dir / "directives.jsonl"
        ids: set[str] = set()
        if self.env.is_main and p.is_file():
            with open(p, "rb") as f:  # a crash can cut a line (and a UTF-8 character) short: such lines are skipped
                for line in f:
                    with contextlib.suppress(ValueError, KeyError, TypeError, IndexError, RecursionError):
                        did = json.loads(line)["id"]
                        if isinstance(did, str):
                            ids.add(did)
        self.ctl.applied = set(self.env.broadcast_object(sorted(ids)))

    def rollback(self, to_step: int, *, reason: str | None, directive_id: str | None, ranges) -> None:
        """Reload the full state of checkpoint ``to_step`` in-process; the skip list is kept (it only grows)."""
        self._flush_readback()
        loaded = self.load_checkpoint(to_step, restore_skiplist=False)
        assert loaded == to_step
        self.state.timeline += 1
        self._mark("rollback", to_step, reason=reason, directive_id=directive_id, ranges=ranges)
        if self.metrics:
            self.metrics.on_rollback()

    def _mark(self, kind: str, from_step: int, *, reason=None, directive_id=None, ranges=(), checkpoint=None) -> None:
        if not self.env.is_main:
            return
        # the reason and id come from a plan file or a directive: any text, maybe not UTF-8 (steplog.clean_text)
        rec = TimelineRecord(kind=kind, run=self.run_id, from_step=from_step, timeline=self.state.timeline,
                             time=time.time(), reason=clean_text(reason), directive_id=clean_text(directive_id),
                             skip_ranges=merge_ranges(ranges), checkpoint=checkpoint)
        self.steplog.write(rec)
        if self.bus:
            self.bus.publish_step(rec)

    # ================================================================== start / resume
    def start(self) -> None:
        env = self.env
        self.ckpt.clean_partial()
        env.barrier()
        self._load_applied_directives()
        removed = self._read_skip_removals()  # a bad file is refused here, before any record is logged
        pending = self.run_dir / PENDING_ROLLBACK
        plan, bad = None, None
        fresh = False
        if env.is_main and os.path.lexists(pending):  # a FIFO or a dangling link is refused too, not ignored
            plan, bad = _read_pending_plan(pending)
        plan, bad = env.broadcast_object((plan, bad))
        if bad:  # every rank stops with the same line; the plan stays on disk for the operator to fix
            raise TrainingError(bad)
        if plan is not None:
            self.skip.add([tuple(r) for r in plan.get("ranges", [])])
            self._persist_skiplist()
            self.load_checkpoint(int(plan["to_step"]), restore_skiplist=True)
            self.skip.add([tuple(r) for r in plan.get("ranges", [])])
            self._apply_skip_removals(removed, keep=[tuple(r) for r in plan.get("ranges", [])])
            self.state.timeline = self._previous_timeline() + 1
            self._mark("rollback", self.state.step, reason=plan.get("reason"), directive_id=plan.get("id"),
                       ranges=plan.get("ranges", []), checkpoint=f"step-{self.state.step:08d}")
            if env.is_main:
                pending.unlink()
                if self.metrics:
                    self.metrics.on_rollback()
            _log(env, f"rollback prepared offline: resumed from step {self.state.step}")
        else:
            resumed = self.load_checkpoint()
            if resumed is None and self.unloadable:
                raise TrainingError(self._unloadable_message())
            if resumed is None:
                gone = self._checkpoints_gone()
                if gone:
                    raise TrainingError(gone)
            self._apply_skip_removals(removed, keep=[])
            if resumed is None:
                self.state.timeline = self._previous_timeline() + 1
                self._mark("start", 0)
                _log(env, f"run {self.run_id}: fresh start")
                fresh = True
            else:
                self.state.timeline = self._previous_timeline() + 1
                self._mark("resume", resumed, checkpoint=f"step-{resumed:08d}")
                if self.metrics and env.is_main:
                    self.metrics.on_resume()
                _log(env, f"run {self.run_id}: resumed from checkpoint step {resumed}")
        self._persist_skiplist()
        if env.is_main:  # atomically: a kill mid-write must not leave a truncated config.yaml
            tmp = self.run_dir / ".config.yaml.tmp"
            tmp.write_text(self._config_text)
            os.replace(tmp, self.run_dir / "config.yaml")
            info = {"run": self.run_id, "world_size": env.world_size, "parallelism": self.cfg.parallelism,
                    "model": self.cfg.preset or "custom", "data_dir": str(Path(self.data_dir).resolve()),
                    "dataset_fingerprint": self.ds.fingerprint, "device": env.device.type,
                    "timeline": self.state.timeline, "started": time.time()}
            tmp = self.run_dir / ".run.json.tmp"
            tmp.write_text(json.dumps(info, indent=1))
            os.replace(tmp, self.run_dir / "run.json")
        env.barrier()
        if fresh and self.cfg.checkpoint.initial and self.cfg.checkpoint.every:
            # the initial state is a rollback target too: without it, damage before the first periodic
            # save can only be paged, and a NaN at step 30 would stop the run for a human
            self.save_checkpoint()

    def _read_skip_removals(self) -> list[tuple[int, int]]:
        """The ranges in ``skiplist.removed.json``, the same on every rank; a malformed file stops the
        start in one line before anything is loaded or logged (no ``resume`` record for a start that
        did not happen)."""
        removed, bad = None, None
        if self.env.is_main:
            removed, bad = read_skip_removals(self.run_dir)
        removed, bad = self.env.broadcast_object((removed, bad))
        if bad:
            raise TrainingError(bad)
        return [tuple(r) for r in removed or []]

    def _apply_skip_removals(self, removed, keep) -> None:
        """Ranges an operator took off the skip list (``sentinel skip-list remove``, run stopped) stay
        off: the checkpoint just restored saved them, so they are subtracted here, on every rank
        alike (but not ``keep``: a pending rollback's own ranges). The file is deleted once a
        checkpoint without them is saved (``_on_checkpoint_done``)."""
        removed = subtract_ranges(removed, keep)
        if not removed:
            return
        n = self.skip.remove(removed)
        self._removals_applied = True
        _log(self.env, f"skip list: {n} samples an operator removed ({SKIP_REMOVED}) are trained on again")

    def _checkpoints_gone(self) -> str | None:
        """A run dir whose step log reached past its first periodic checkpoint, with no checkpoint at
        all (deleted, or a mount that did not come up): a start over would append a second history
        to steps.jsonl and then save step 0, 10, ... over what comes back. Refused in one line."""
        every = self.cfg.checkpoint.every
        last = self.steplog.last_step() if self.env.is_main else -1
        last = int(self.env.broadcast_object(last))
        if not every or last < every:
            return None
        return (f"{self.run_dir}/steps.jsonl logs steps up to {last}, but {self.ckpt.root} holds no checkpoint (deleted, "
                "or a mount that did not come up?): refusing to start the run over on top of its history. Restore the "
                "checkpoints, or start a new run dir (or move steps.jsonl away to train this one from scratch)")

    def _unloadable_message(self) -> str:
        """Why a run dir whose every checkpoint failed is not started over. A fresh start would append
        a new timeline to steps.jsonl and then save step 0, 10, ... over the old step directories and
        prune the rest: the run's only copies, maybe damaged by something passing (a disk, a copy cut
        short) that a human can still repair. So nothing is touched; the operator decides."""
        n = len(self.unloadable)
        shown = "; ".join(self.unloadable[:3]) + (f"; and {n - 3} more" if n > 3 else "")
        return (f"none of the {n} checkpoint(s) in {self.ckpt.root} can be loaded ({shown}); refusing to start over "
                f"and overwrite them: repair or restore them, or move {self.ckpt.root} aside to start this run "
                "from scratch")

    def _previous_timeline(self) -> int:
        last = -1
        if self.env.is_main:
            last = self.steplog.last_timeline()
        return int(self.env.broadcast_object(last))

    # ================================================================== the step
    def _batch(self) -> tuple[list[int], int, list[torch.Tensor], list[list[int]]]:
        """The global batch for this step, and this rank's micro-batches (every rank samples identically).
        Under a shorter scheduled seq_len each id yields several sequences, so fewer ids are drawn."""
        n_ids = self.global_batch // seqlen.pieces_at(self.cfg, self.state.step)
        ids, n_skipped = self.sampler.next_ids(n_ids, self.skip)
        micro, micro_ids = self.micro_batches(ids)
        return ids, n_skipped, micro, micro_ids

    def micro_batches(self, ids: list[int]) -> tuple[list[torch.Tensor], list[list[int]]]:
        """This rank's micro-batches of a global batch: micro m of rank r holds
        ``ids[(m * world + r) * q : (m * world + r + 1) * q]``, ``q = micro_batch_size / pieces`` ids cut
        into ``micro_batch_size`` sequences at the scheduled seq_len (``trainer/seqlen.py``; ``pieces``
        is 1 without a schedule). Drills are applied to the whole windows, before the cut."""
        d, step = self.cfg.data, self.state.step
        world, rank = self.env.world_size, self.env.rank
        q = d.micro_batch_size // seqlen.pieces_at(self.cfg, step)
        micro_ids = [ids[(m * world + rank) * q:(m * world + rank + 1) * q] for m in range(d.grad_accum)]
        micro = []
        for mids in micro_ids:
            toks = self.ds.get_many(mids, self.cfg.model.seq_len)
            toks = drills.corrupt_tokens(self.cfg.faults, mids, toks, self.cfg.model.vocab_size)
            if self.cfg.source_faults:
                names = [self.ds.source_names[k] for k in self.ds.source_index(mids, self.cfg.model.seq_len)]
                toks = drills.corrupt_source_tokens(self.cfg.source_faults, step + 1, mids, names, toks,
                                                    self.cfg.model.vocab_size)
            t = torch.from_numpy(seqlen.split_windows(toks, seqlen.seq_len_at(self.cfg, step)))
            if self.env.device.type == "cuda":  # a copy from pageable memory would sync the stream
                t = t.pin_memory()
            micro.append(t.to(self.env.device, non_blocking=True))
        return micro, micro_ids

    def lr_for(self, step_index: int, ids: list[int]) -> float:
        """LR of the optimizer step with 0-based index ``step_index`` over global batch ``ids``."""
        return lr_at(step_index, self.cfg.optim, self.cfg.max_steps) * drills.lr_multiplier(self.cfg.faults, ids)

    def train_step(self, micro: list[torch.Tensor], micro_ids: list[list[int]], lr_value: float, *, apply: bool = True):
        """Forward+backward over the micro-batches, guard, and (unless ``apply`` is False) the update.

        Returns device tensors: loss (global mean), rank losses, pre-clip grad norm, factor, reason.
        Also the entry point of ``sentinel replay-batch`` (with apply=False).
        With several sources, ``self.step_source_sums`` is left holding the ``[num_sources]`` sums of
        the per-sample losses over the global batch (device tensor; it rides the loss all-gather).
        """
        accum = len(micro)
        loss_sum = torch.zeros((), device=self.env.device)
        if apply and not self.offline:  # the straggler drill: this rank's compute is slow
            drills.straggle(self.cfg.faults, self.env.rank)
        src_sum = onehots = None
        if self.per_source:
            src_sum = torch.zeros(self.n_sources, device=self.env.device)
            # one row per sequence: an id cut into k sequences gives k rows of its source
            onehots = [source_onehot(np.repeat(self.ds.source_index(mids, self.cfg.model.seq_len), len(toks) // max(1, len(mids))),
                                     self.n_sources, self.env.device) for toks, mids in zip(micro, micro_ids)]
        for i, toks in enumerate(micro):
            self.state.accum_pos = i
            x, y = toks[:, :-1], toks[:, 1:]
            last = i == accum - 1
            sync_ctx = self.model.no_sync() if (hasattr(self.model, "no_sync") and not last and self.env.distributed) else contextlib.nullcontext()
            with sync_ctx:
                with self.autocast:
                    if onehots is None:
                        _, loss = self.model(x, y)
                    else:  # per-sample losses: the mean is the same loss, the rows feed the source sums
                        _, tok_loss = self.model(x, y, reduction="none")
                        row_loss = tok_loss.mean(dim=1)
                        loss = row_loss.mean()
                if onehots is not None:
                    src_sum += onehots[i] @ row_loss.detach().float()
                if drills.poisons_loss(self.cfg.faults, micro_ids[i]):
                    loss = loss * float("nan")
                (loss / accum).backward()
            loss_sum += loss.detach()
        self.state.accum_pos = 0
        self.clock.backward_done()
        local = loss_sum / accum
        src_parts = [] if src_sum is None else [src_sum]
        if self.env.distributed:
            # the per-rank phase times and the per-source loss sums ride the loss all-gather that every
            # step already does: no new collective, and (CUDA) a non-blocking copy from pinned memory,
            # so no host sync either
            pay = torch.tensor(self.clock.payload(), dtype=torch.float32)
            if self.env.device.type == "cuda":
                pay = pay.pin_memory().to(self.env.device, non_blocking=True)
            row = torch.cat([local.reshape(1).float(), *src_parts, pay])
            width, n_src = row.numel(), (0 if src_sum is None else src_sum.numel())
            both = torch.empty(self.env.world_size * width, device=self.env.device)
            dist.all_gather_into_tensor(both, row)
            both = both.view(self.env.world_size, width)
            gathered = both[:, 0].contiguous()
            self.step_source_sums = None if src_sum is None else both[:, 1:1 + n_src].sum(dim=0)
            self._rank_phases = both[:, 1 + n_src:]
        else:
            gathered = local.reshape(1).float()
            self.step_source_sums = src_sum
            self._rank_phases = None
        loss = gathered.mean()
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        step = self.state.step
        if seqlen.changes_at(self.cfg, step) or self.mix_weights.changes_at(step):
            # a planned change of the loss level (new length or mixture) is not a spike: rebuild the
            # baseline (a pure function of the config and the step, as the sentinel's own rebaseline)
            self.guard.rebaseline()
        factor, reason = self.guard.check(loss, grad_norm)
        if apply:  # lr stays a Python float: uploading it as a tensor would be a host->device sync
            self.opt.step(lr_value, factor)
        self.opt.zero_grad(set_to_none=True)
        return loss, gathered, grad_norm, factor, reason

    def _digest(self) -> torch.Tensor | None:
        every = self.cfg.telemetry.param_digest_every
        if not every or self.state.step % every:
            return None
        if self.cfg.parallelism == "fsdp" and self.env.distributed:
            d = param_digest_tensor(self.raw_model.parameters())
            dist.all_reduce(d)
            return d
        return param_digest_tensor(self.raw_model.parameters()) if self.env.is_main else None

    def _evaluate(self) -> tuple[float, dict[str, float], dict[str, float]] | None:
        """(val loss over every slice's windows, val loss per slice, probe loss per slice)."""
        if not self.slice_eval:
            return None
        fsdp = self.cfg.parallelism == "fsdp"
        model = self.model if fsdp else self.raw_model

        def forward(toks: torch.Tensor) -> torch.Tensor:
            with self.autocast:
                return model(toks[:, :-1], toks[:, 1:], reduction="none")[1]

        self.model.eval()
        val, slices, probe = self.slice_eval.run(forward, self.env, pad_collectives=fsdp and self.env.distributed)
        self.model.train()
        if self.metrics and self.env.is_main:
            self.metrics.on_validation(val)
            self.metrics.on_slice_validation(slices, probe)
        return val, slices, probe

    # ================================================================== loop
    def _install_signals(self) -> None:
        # SIGTERM (preemption: Kubernetes, Slurm, torchrun forwarding it) and SIGINT (Ctrl-C) both mean
        # "checkpoint, then exit 0" at the next step boundary, paused or not. A repeated signal changes
        # nothing: torchrun re-sends the signal to its ranks, and that must not abort the checkpoint.
        def handler(signum, frame):
            self._stop_signal = signal.Signals(signum).name
        with contextlib.suppress(ValueError):  # not the main thread (embedded use): no signal handling
            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)
            # over RLIMIT_FSIZE a write gets EFBIG (handled like a full disk) instead of killing the process
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def _any_rank_signalled(self) -> bool:
        """True on every rank when any rank got SIGTERM/SIGINT (a host-side vote, off the hot path)."""
        return not self.env.all_ok(not self._stop_signal)

    def fit(self) -> None:
        cfg, env = self.cfg, self.env
        self.start()
        self.model.train()
        sched = f" (seq_len schedule {[list(e) for e in cfg.data.seq_len_schedule]})" if cfg.data.seq_len_schedule else ""
        _log(env, f"model: {self.n_params / 1e6:.2f}M non-embedding params; global batch {self.global_batch} x {cfg.model.seq_len} tokens{sched}; "
                  f"{env.world_size} rank(s), {cfg.parallelism if env.distributed else 'single'} on {env.device.type}")
        while self.state.step < cfg.max_steps:
            t_ctl = time.perf_counter()
            for item in self._poll_control():
                self._apply(Directive.model_validate(item))
            while self.ctl.paused and not self.ctl.stop:
                if self._any_rank_signalled():  # paused still obeys preemption: checkpoint, then exit
                    break
                if self.metrics:
                    self.metrics.heartbeat()
                time.sleep(0.2)
                for item in self._poll_control():
                    self._apply(Directive.model_validate(item))
            stop = bool(self.ctl.stop or self._stop_signal)
            if env.distributed:
                stop = not env.all_ok(not stop)
            if stop:
                why = self._stop_signal or ("stop directive" if self.ctl.stop else "a signal on another rank")
                _log(env, f"stopping at step {self.state.step} ({why}{', paused' if self.ctl.paused else ''}; checkpointing first)")
                self.save_checkpoint()
                break
            t_control = time.perf_counter() - t_ctl
            self._one_step(t_control)
            if cfg.checkpoint.every and self.state.step % cfg.checkpoint.every == 0:
                self.save_checkpoint()
                self._check_checkpoint_age()
        else:  # finished: always leave a checkpoint of the final state (every=0 means "only at the end")
            if not cfg.checkpoint.every or self.state.step % cfg.checkpoint.every:
                self.save_checkpoint()
        self._flush_readback()
        self.ckpt.wait()
        self._check_checkpoint_age(final=True)
        self._close_io()  # a collective (the lost-record count): before the barrier, so that no rank
        env.barrier()  # tears its process group down while another is still inside a collective

    def _close_io(self) -> None:
        """Flush the step log and the bus. Step records the disk never took make the exit non-zero."""
        if self.bus:
            self.bus.flush(5.0)
            self.bus.close()
            self.bus = None
        lost = self.steplog.close() if self.steplog else 0
        lost = int(self.env.broadcast_object(lost))
        if lost:
            raise TrainingError(f"{lost} step record(s) could not be written to {self.run_dir / 'steps.jsonl'} "
                                f"({self.steplog.last_error if self.steplog else 'on rank 0'}); checkpoints are unaffected")

    def _check_checkpoint_age(self, *, final: bool = False) -> None:
        """Stop the run (the same one-line error on every rank) when checkpoint saves keep failing and the
        newest valid checkpoint has fallen too far behind, or when the final save failed: never exit 0 with
        the run's recent work unprotected. A collective: called at the same point on every rank."""
        why = None
        if self.env.is_main:
            why = self._checkpoint_staleness(final)
            if why and self.cfg.checkpoint.async_save:  # an in-flight save may still land
                self.ckpt.wait()
                why = self._checkpoint_staleness(final)
        why = self.env.broadcast_object(why)
        if why:
            self.ckpt.wait()
            with contextlib.suppress(TrainingError):
                self._close_io()
            raise TrainingError(why)

    def _checkpoint_staleness(self, final: bool) -> str | None:
        if not self._ckpt_failed:
            return None
        c = self.cfg.checkpoint
        good_step, good_time = self._good_ckpt
        age_steps, age_s = self.state.step - good_step, time.time() - good_time
        bound = c.max_age_steps or c.every
        err = self.ckpt.last_error or "write failed"
        newest = f"newest valid checkpoint is step {good_step}" if good_step else "there is no valid checkpoint"
        if final and age_steps > 0:
            return (f"final checkpoint at step {self.state.step} failed ({err}); {newest}, {age_steps} steps behind: "
                    f"fix the storage and restart to resume from it")
        too_old = (bound and age_steps > bound) or (c.max_age_seconds and age_s > c.max_age_seconds)
        if not too_old:
            return None
        limit = " / ".join(x for x in (f"{bound} steps" if bound else "", f"{c.max_age_seconds:g} s" if c.max_age_seconds else "") if x)
        return (f"checkpoint saves are failing ({err}): {newest}, {age_steps} steps and {age_s:.0f} s old "
                f"(bound {limit}); stopped at step {self.state.step}: fix the storage and restart to resume")

    def _one_step(self, t_control: float) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.clock.begin()
        markers = self._step_markers()
        seq = self.seq_now
        ids, n_skipped, micro, micro_ids = self._batch()
        self.clock.data_ready()
        lr = self.lr_for(self.state.step, ids)
        loss, ranks, gnorm, factor, reason = self.train_step(micro, micro_ids, lr)
        self.state.step += 1
        tensors = {"loss": loss, "ranks": ranks, "grad_norm": gnorm, "factor": factor, "reason": reason}
        if self._rank_phases is not None:
            tensors["rank_phases"] = self._rank_phases
        source_counts = None
        if self.step_source_sums is not None:
            tensors["source_sums"] = self.step_source_sums
            pieces = cfg.model.seq_len // seq  # sequences (loss rows) per id
            source_counts = (np.bincount(self.ds.source_index(ids, cfg.model.seq_len), minlength=self.n_sources) * pieces).tolist()
        digest = self._digest()
        if digest is not None:
            tensors["digest"] = digest
        self.clock.end()
        val = None
        if cfg.eval.every and self.state.step % cfg.eval.every == 0:
            val = self._evaluate()
        meta = {
            "step": self.state.step, "lr": lr, "ids": ids, "n_skipped": n_skipped, "time": time.time(),
            "phases": {**self.clock.latest(), "control": t_control},
            "val": val[0] if val else None, "val_slices": val[1] if val else None, "probe": val[2] if val else None,
            "t_start": t0, "markers": markers, "source_counts": source_counts, "seq_len": seq,
        }
        for values, m in self.readback.submit(tensors, meta):
            self._emit(values, m)

    def _step_markers(self) -> list[tuple[str, str]]:
        """Changes of training conditions at this step boundary (emitted with the step's record, so
        steps.jsonl keeps them in order even with the one-step readback lag). Also applies the
        mixture weights in effect for the step about to run."""
        step = self.state.step
        markers = lr_phase_markers(step, self.cfg)
        seq = seqlen.seq_len_at(self.cfg, step)
        if self.seq_now is not None and seq != self.seq_now:
            markers.append(("seq_len_change", seqlen.describe_change(self.seq_now, seq, self.global_batch)))
        self.seq_now = seq
        if isinstance(self.sampler, MixtureSampler):
            normalised = self.sampler.set_weights(self.mix_weights.at(step + 1))
            weights = dict(zip(self.ds.source_names, normalised))
            if self.weights_now is not None and any(abs(weights.get(n, 0.0) - w) > 1e-12 for n, w in self.weights_now.items()):
                markers.append(("mixture_change", describe_change(self.weights_now, weights)))
            if weights != self.weights_now and self.metrics:
                self.metrics.set_mixture_weights(weights)
            self.weights_now = weights
        return markers

    def _flush_readback(self) -> None:
        for values, m in self.readback.drain():
            self._emit(values, m)

    def _emit(self, v: dict, m: dict) -> None:
        """Turn one step's host values into the step record, the Prometheus update and the bus message."""
        cfg, env = self.cfg, self.env
        t_tel = time.perf_counter()
        skipped = v["factor"] == 0.0
        # an id is one model.seq_len window whatever length it was cut into (trainer/seqlen.py), so this is
        # also micro_batch_size x grad_accum x world sequences of the seq_len in effect (m["seq_len"])
        seq = cfg.model.seq_len
        step_tokens = len(m["ids"]) * seq
        if not skipped:
            self.state.tokens += step_tokens
        ranks = v["ranks"] if isinstance(v["ranks"], list) else [v["ranks"]]
        now = time.time()
        fpt = self.flops_per_token(m["seq_len"]) if self.flops_per_token else 0.0
        self._throughput.append((now, step_tokens, step_tokens * fpt))
        tps = mfu = None
        if len(self._throughput) >= 2:
            span = self._throughput[-1][0] - self._throughput[0][0]
            recent = list(self._throughput)[1:]
            tokens = sum(t for _, t, _ in recent)
            tps = tokens / span if span > 0 else None
            if tps and self.peak and fpt:  # FLOPs per token averaged over the window (a seq_len change inside it)
                from trainer.telemetry.mfu import mfu as mfu_fn

                mfu = mfu_fn(tps, sum(f for _, _, f in recent) / tokens, self.peak, env.world_size)
        val = m["val"]
        loaded = (len(m["ids"]) + m["n_skipped"]) * seq
        useful = 0 if skipped else step_tokens
        phases = dict(m["phases"])
        if "rank_phases" in v:  # flat (world x RANK_PHASES), from the loss all-gather
            flat, k = v["rank_phases"], len(RANK_PHASES)
            rank_phases = [as_dict(flat[r * k:(r + 1) * k]) for r in range(env.world_size)]
        else:
            rank_phases = [{p: phases[p] for p in RANK_PHASES if p in phases}]
        step_seconds = time.perf_counter() - m["t_start"]
        if env.device.type == "cuda" and all(p in phases for p in RANK_PHASES):
            # The host's span runs from queueing this step to reading it back a step later: ~2 steps
            # when the device is the bottleneck (measured on an H100: 0.458 s against 0.233 s between
            # steps). The device's own span of its newest finished step (its CUDA events, begin to
            # end: the four phases) is the step's duration.
            step_seconds = sum(phases[p] for p in RANK_PHASES)
        reason = REASONS.get(int(v["reason"])) if skipped else None
        source_loss = None
        if "source_sums" in v and m["source_counts"]:
            sums = v["source_sums"] if isinstance(v["source_sums"], list) else [v["source_sums"]]
            source_loss = {n: sums[k] / c for k, (n, c) in enumerate(zip(self.ds.source_names, m["source_counts"])) if c}
        elif self.n_sources == 1:
            source_loss = {self.ds.source_names[0]: v["loss"]}
        for kind, detail in m["markers"]:
            if env.is_main:
                marker = MarkerRecord(run=self.run_id, step=m["step"] - 1, timeline=self.state.timeline, marker=kind,
                                      detail=detail, time=m["time"])
                self.steplog.write(marker)
                if self.bus:
                    self.bus.publish_step(marker)
            if self.metrics:
                self.metrics.on_timeline_event(kind)
        if env.is_main:
            rec = StepRecord(
                run=self.run_id, step=m["step"], timeline=self.state.timeline, loss=v["loss"], loss_max_rank=max(ranks),
                rank_losses=ranks, grad_norm=v["grad_norm"], lr=m["lr"], tokens=self.state.tokens, batch_tokens=step_tokens,
                batch_fingerprint=batch_fingerprint(m["ids"]), sample_ids=m["ids"], skipped=skipped, skip_reason=reason,
                time=m["time"], param_digest=digest_hex(v["digest"]) if "digest" in v else None,
                step_seconds=step_seconds, phases=phases, rank_phases=rank_phases, tokens_per_second=tps, mfu=mfu,
                val_loss=val, val_ppl=(math.exp(val) if val is not None and val < 700 else None),
                checkpoint_age_seconds=(now - self._last_ckpt_time) if self._last_ckpt_time else None,
                effective_token_ratio=useful / loaded if loaded else None, world_size=env.world_size,
                source_loss=source_loss, val_slice_loss=m["val_slices"], probe_loss=m["probe"],
            )
            self.steplog.write(rec)
            if self.bus:
                self.bus.publish_step(rec)
            if self.metrics and self.steplog.write_failures:
                self.metrics.set_step_log(write_failures=self.steplog.write_failures, lost=self.steplog.lost,
                                          buffered=self.steplog.buffered)
        phases["telemetry"] = time.perf_counter() - t_tel
        if self.metrics:
            self.metrics.on_step(
                step=m["step"], loss=v["loss"] if env.is_main else None, rank_loss=ranks[env.rank],
                grad_norm=v["grad_norm"] if env.is_main else None, lr=m["lr"] if env.is_main else None,
                tokens_total=self.state.tokens if env.is_main else None, step_seconds=step_seconds, phases=phases,
                step_tokens=step_tokens, grad_clipped=bool(cfg.optim.grad_clip and v["grad_norm"] > cfg.optim.grad_clip),
                skipped_reason=reason, skipped_samples=m["n_skipped"], loaded_tokens=loaded, useful_tokens=useful, mfu=mfu,
            )
            self.metrics.on_slice_losses(source_loss)
            self.metrics.set_sequence_length(m["seq_len"])
            if self.bus:
                self.metrics.set_telemetry_dropped(self.bus.dropped)
        if env.is_main and m["step"] % cfg.telemetry.log_every == 0:
            extra = f" val {val:.4f}" if val is not None else ""
            print(f"step {m['step']:>6} | loss {v['loss']:.4f} | gnorm {v['grad_norm']:.3f} | lr {m['lr']:.2e}"
                  f"{' | SKIPPED ' + str(reason) if skipped else ''}{extra}", flush=True)


def _cpu_copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cpu_copy(v) for v in obj]
    return obj
