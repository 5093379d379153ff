"""The trainer's checkpoint state S_t: what a checkpoint holds, saving it, loading it back, and how far the
newest valid one may fall behind before the run stops.

S_t = (params, optimizer moments + step counts, scheduler step, RNG of every rank, data cursor,
grad-accumulation position, skip list, guard statistics, tokens seen). ``trainer/checkpoint.py`` writes and
verifies the files (atomic step dirs, a manifest of sha256 written last); this module decides what goes in
them and puts it back, on every rank alike.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from sentinel.protocol import SKIP_REMOVED, CheckpointInfo
from trainer import rng
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
from trainer.errors import TrainingError


@dataclass
class TrainState:
    """The host-side counters of S_t."""

    step: int = 0  # optimizer steps completed
    tokens: int = 0  # tokens trained (global, excluding skipped steps)
    accum_pos: int = 0  # micro-batches of the current step already done (0 at every step boundary)


def _log(env, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


class TrainerCheckpoints:
    """Saves and restores a :class:`trainer.train.Trainer`'s full state (``tr``: the trainer)."""

    def __init__(self, tr) -> None:
        self.tr = tr
        env, c = tr.env, tr.cfg.checkpoint
        self.ckpt = Checkpointer(
            tr.run_dir, rank=env.rank, world_size=env.world_size, keep_last=c.keep_last, keep_every=c.keep_every,
            barrier=env.barrier, all_ok=env.all_ok, log=lambda m: print(m, flush=True),
        )
        self.last_time: float | None = None  # when the newest checkpoint of this state was saved
        # the newest valid checkpoint (step, time) and consecutive failed saves since: bounds the work a
        # failing disk can put at risk (checkpoint.max_age_steps / max_age_seconds)
        self.good = (0, time.time())
        self.failed = 0
        self._group = None  # lazily created gloo group for FSDP2 async checkpoints
        self.unloadable: list[str] = []  # why each checkpoint the last load passed over failed
        self.removals_applied = False  # skiplist.removed.json was applied: deleted at the next checkpoint

    def train_state(self) -> dict:
        tr = self.tr
        return {
            "run": tr.run_id,
            "step": tr.state.step,
            "tokens": tr.state.tokens,
            "timeline": tr.control.timeline,
            "grad_accum_pos": tr.state.accum_pos,
            "sampler": tr.sampler.state_dict(),
            "skiplist": [list(r) for r in tr.skip.ranges],
            "guard": tr.guard.state_dict(),
            "scheduler": {"kind": "warmup_cosine", "step": tr.state.step, "max_steps": tr.cfg.max_steps},
            "world_size": tr.env.world_size,
            "dataset_fingerprint": tr.ds.fingerprint,
            "faults": [f.model_dump() for f in tr.cfg.faults],
            "source_faults": [f.model_dump() for f in tr.cfg.source_faults],
            "mixture_weights": tr.weights_now,
            "seq_len": tr.cfg.model.seq_len,
            "train_seq_len": tr.seq_now,
            "last_checkpoint_time": time.time(),
        }

    def save(self) -> None:
        tr = self.tr
        cfg, env = tr.cfg, tr.env
        tr._flush_readback()
        meta = {"run": tr.run_id, "timeline": tr.control.timeline, "tokens": tr.state.tokens,
                "dataset_fingerprint": tr.ds.fingerprint}
        per_rank = {f"rng-rank{env.rank}.pt": rng.capture()}
        shared: dict = {"train_state.json": self.train_state()}
        dcp_writer = dcp_async_writer = None
        async_save = cfg.checkpoint.async_save
        if cfg.parallelism == "fsdp" and env.distributed:
            from torch.distributed.checkpoint import save as dcp_save
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(tr.model, tr.opt)
            dcp_writer = lambda d: dcp_save({"model": msd, "optim": osd}, checkpoint_id=str(d))  # noqa: E731
            if async_save:
                from torch.distributed.checkpoint import async_save as dcp_async_save

                if self._group is None:  # DCP's background collectives get their own gloo group
                    self._group = dist.new_group(backend="gloo")
                group = self._group
                dcp_async_writer = lambda d: dcp_async_save(  # noqa: E731
                    {"model": msd, "optim": osd}, checkpoint_id=str(d), process_group=group)
        else:
            # async: the live tensors; the save's thread copies them before the optimizer step may change
            # them (Trainer._one_step calls ckpt.fence() first), then writes while training goes on
            msd, osd = tr.raw_model.state_dict(), tr.opt.state_dict()
            shared["model.pt"] = msd
            shared["optim.pt"] = osd
        step = tr.state.step
        self.ckpt.save(step, shared=shared, per_rank=per_rank, meta=meta, dcp_writer=dcp_writer,
                       dcp_async_writer=dcp_async_writer, async_save=async_save, on_done=self._on_done(step))

    def _on_done(self, step: int):
        tr = self.tr

        def done(ok: bool, seconds: float, size: int, path: Path | None) -> None:
            now = time.time()
            if ok:
                self.last_time = now
                self.good, self.failed = (step, now), 0
                if self.removals_applied and tr.env.is_main:  # a checkpoint without them: they stick now
                    (tr.run_dir / SKIP_REMOVED).unlink(missing_ok=True)
                    self.removals_applied = False
            else:
                self.failed += 1
            if tr.metrics:
                tr.metrics.on_checkpoint(ok=ok, seconds=seconds, size_bytes=size, timestamp=now)
            if ok and path is not None:
                _log(tr.env, f"checkpoint step {step} saved ({size / 1e6:.1f} MB, {seconds:.2f}s)")
                if tr.bus:
                    manifest = json.loads((path / "manifest.json").read_text())
                    tr.bus.register_checkpoint(CheckpointInfo(
                        run=tr.run_id, step=step, path=str(path.resolve()), created=now, bytes=size,
                        manifest_sha256=manifest_digest(manifest), world_size=tr.env.world_size,
                        timeline=tr.control.timeline, tokens=tr.state.tokens,
                    ))
                    # retention may have deleted older checkpoints: the bus must not offer them as rollback targets
                    tr.bus.retain_checkpoints(s for s, _ in list_checkpoints(self.ckpt.root))
        return done

    def load(self, step: int | None = None, *, restore_skiplist: bool = True) -> int | None:
        """Restore S_t from the newest valid checkpoint (or exactly ``step``); return its step or None.

        Every candidate is verified and fully read and checked in memory before any state is touched;
        one that fails on any rank is reported in one line and the previous one is tried (an exact
        ``step`` fails instead). All ranks take the same decision at each candidate."""
        tr = self.tr
        env = tr.env
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
                loaded = self._read(ck_step, path)
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

    def _read(self, step: int, path: Path) -> dict:
        """Everything this rank needs from one checkpoint, verified and checked, nothing applied yet."""
        tr = self.tr
        env = tr.env
        manifest = verify(path)
        ts = read_train_state(path, step)
        if ts["dataset_fingerprint"] != tr.ds.fingerprint:
            raise TrainingError(
                f"dataset fingerprint mismatch: checkpoint {path.name} was trained on {ts['dataset_fingerprint']}, "
                f"this data is {tr.ds.fingerprint} ({tr.data_dir})"
            )
        if ts["world_size"] != env.world_size:
            raise TrainingError(
                f"checkpoint {path.name} was written by {ts['world_size']} ranks, this run has {env.world_size}; "
                "exact resume needs the same world size"
            )
        seq = tr.cfg.model.seq_len
        if ts.get("seq_len", seq) != seq or ts["sampler"]["num_samples"] != tr.sampler.num_samples:
            # not a bad checkpoint to fall back from: every checkpoint of the run would fail the same way
            was = f"seq_len {ts['seq_len']}" if "seq_len" in ts else f"{ts['sampler']['num_samples']} samples"
            raise TrainingError(f"checkpoint {path.name} was trained at {was}, this run has seq_len {seq} "
                                f"({tr.sampler.num_samples} samples): a run cannot change model.seq_len (the position "
                                "table and every sample id depend on it); train shorter sequences first with "
                                "data.seq_len_schedule, or start a new run dir")
        if ts["guard"]["window"] != tr.cfg.guard.window:
            raise TrainingError(f"checkpoint {path.name} has a guard window of {ts['guard']['window']}, "
                                f"this run {tr.cfg.guard.window}; cannot resume exactly")
        out = {"ts": ts, "path": path, "manifest": manifest}
        rng_state = load_torch(path / f"rng-rank{env.rank}.pt")
        check_rng(rng_state, f"{path.name}: rng-rank{env.rank}.pt")
        out["rng"] = rng_state
        if not (path / "dcp").is_dir():
            out["model"] = load_torch(path / "model.pt")
            check_tensors(out["model"], tr.raw_model.state_dict(), f"{path.name}: model.pt")
            out["optim"] = load_torch(path / "optim.pt")
            check_optimizer_state(out["optim"], tr.opt, f"{path.name}: optim.pt")
        return out

    def _restore(self, ck: dict, *, restore_skiplist: bool) -> None:
        tr = self.tr
        ts, path = ck["ts"], ck["path"]
        if "model" in ck:
            tr.raw_model.load_state_dict(ck["model"])
            tr.opt.load_state_dict(ck["optim"])
        else:
            from torch.distributed.checkpoint import load as dcp_load
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            msd, osd = get_state_dict(tr.model, tr.opt)
            sd = {"model": msd, "optim": osd}
            try:  # DCP validates its shards against .metadata itself; a failure is one line, not a traceback
                dcp_load(sd, checkpoint_id=str(path / "dcp"))
                set_state_dict(tr.model, tr.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise CheckpointError(f"{path.name}: sharded state (dcp/) could not be loaded: {first[:300]}") from None
        rng.restore(ck["rng"])
        tr.sampler.load_state_dict(ts["sampler"])
        # the weights the checkpointed step trained with: a different config makes a mixture_change marker
        tr.weights_now = ts.get("mixture_weights")
        # likewise the length it trained at (checkpoints from before schedules: model.seq_len); the
        # initial state (step 0) trained nothing, and must come back as a fresh start has it
        tr.seq_now = ts.get("train_seq_len") or (ts.get("seq_len") if ts["step"] else None)
        tr.guard.load_state_dict(ts["guard"])
        if restore_skiplist:
            tr.skip.add([tuple(r) for r in ts["skiplist"]])
        tr.state = TrainState(step=ts["step"], tokens=ts["tokens"], accum_pos=ts["grad_accum_pos"])
        self.last_time = ck["manifest"].get("created")
        self.good, self.failed = (tr.state.step, time.time()), 0

    def check_age(self, *, final: bool = False) -> None:
        """Stop the run (the same one-line error on every rank) when checkpoint saves keep failing and the
        newest valid checkpoint has fallen too far behind, or when the final save failed: never exit 0 with
        the run's recent work unprotected. A collective: called at the same point on every rank."""
        tr = self.tr
        why = None
        if tr.env.is_main:
            why = self._staleness(final)
            if why and tr.cfg.checkpoint.async_save:  # an in-flight save may still land
                self.ckpt.wait()
                why = self._staleness(final)
        why = tr.env.broadcast_object(why)
        if why:
            self.ckpt.wait()
            with contextlib.suppress(TrainingError):
                tr._close_io()
            raise TrainingError(why)

    def _staleness(self, final: bool) -> str | None:
        tr = self.tr
        if not self.failed:
            return None
        c = tr.cfg.checkpoint
        good_step, good_time = self.good
        age_steps, age_s = tr.state.step - good_step, time.time() - good_time
        bound = c.max_age_steps or c.every
        err = self.ckpt.last_error or "write failed"
        newest = f"newest valid checkpoint is step {good_step}" if good_step else "there is no valid checkpoint"
        if final and age_steps > 0:
            return (f"final checkpoint at step {tr.state.step} failed ({err}); {newest}, {age_steps} steps behind: "
                    f"fix the storage and restart to resume from it")
        too_old = (bound and age_steps > bound) or (c.max_age_seconds and age_s > c.max_age_seconds)
        if not too_old:
            return None
        limit = " / ".join(x for x in (f"{bound} steps" if bound else "", f"{c.max_age_seconds:g} s" if c.max_age_seconds else "") if x)
        return (f"checkpoint saves are failing ({err}): {newest}, {age_steps} steps and {age_s:.0f} s old "
                f"(bound {limit}); stopped at step {tr.state.step}: fix the storage and restart to resume")

