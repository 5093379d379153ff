"""The training loop: one optimizer step at a time, with everything needed to stop and resume exactly.

Single process:      python -m trainer --preset tiny --run-dir runs/a --max-steps 100
Distributed (CPU):   torchrun --nproc-per-node 2 -m trainer --preset tiny --run-dir runs/a
FSDP2:               torchrun --nproc-per-node 2 -m trainer --preset tiny --run-dir runs/b --fsdp

State at a step boundary, S_t = (params, optimizer moments + step counts, scheduler step, RNG of
every rank, data cursor, grad-accumulation position, skip list, guard statistics, tokens seen), is
exactly what a checkpoint holds: the named pieces of ``trainer/state.py`` (``TrainState``: the counters).

Reading order: ``Trainer.__init__`` (build), ``fit`` (the loop), ``_one_step``, ``train_step``. What is
not training lives beside it: ``resume.py`` (how a run starts), ``checkpointing.py`` (S_t in and out),
``build.py`` (model, optimizer, telemetry edges), ``telemetry/emit.py`` (a typed ``StepOutput`` to the
step log, the bus and Prometheus) and ``sentinel.client.ControlLoop`` (the sentinel's directives).
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from sentinel.client.control import ControlLoop, RestoreFailed
from sentinel.client.steplog import StepLog, clean_text
from sentinel.contract.rundir import STEPS
from trainer import build, resume, rundir_lock, seqlen
from trainer import faults as drills
from trainer.checkpoint import CheckpointError
from trainer.checkpointing import TrainerCheckpoints
from trainer.config import TrainConfig, dump
from trainer.data import DataError, MixtureSampler, SkipList, TokenDataset, ensure_prepared, sampler_for
from trainer.dist import DistEnv
from trainer.errors import TrainingError
from trainer.guard import StepGuard
from trainer.optim import lr_at
from trainer.phases import PhaseClock
from trainer.readback import StepReadback
from trainer.slices import MixtureWeights, SliceEval, describe_change, lr_phase_markers, source_onehot
from trainer.state import TrainState
from trainer.telemetry.digest import param_digest_tensor
from trainer.telemetry.emit import StepEmitter, StepOutput


def _log(env: DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


# torch 2.13 renamed it (``all_gather_into_tensor`` now warns at every call); torch >= 2.6 is supported
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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

        # the dataset first: a bad --data (or one too small for a batch) is refused before anything is
        # created in the run dir; the run dir's own state (the skip list) is read once its lock is held
        self._setup_data()
        self._setup_run_dir()
        self._load_skiplist()
        self.clock = PhaseClock(env.device)  # before the model: DDP's comm hook stamps gradient readiness
        build.setup_model(self)
        self.guard = StepGuard(cfg.guard, env.device)
        self.readback = StepReadback(env.device)
        self.checkpoints = TrainerCheckpoints(self)
        self.ckpt = self.checkpoints.ckpt  # the files: trainer/checkpoint.py
        self.steplog = StepLog(self.run_dir / STEPS, log=lambda m: print(m, flush=True)) if env.is_main and not offline else None
        self.metrics = self.bus = self.secret = self.flops_per_token = self.peak = None
        if not offline:
            build.setup_telemetry(self)
        self.telemetry = StepEmitter(self.run_id, env, cfg.model.seq_len, self.ds.source_names, cfg.telemetry.log_every,
                                     cfg.optim.grad_clip, steplog=self.steplog, bus=self.bus, metrics=self.metrics,
                                     flops_per_token=self.flops_per_token, peak=self.peak)
        # the directive state machine (sentinel.client: the same one every integration uses); this Trainer is its host
        self.control = ControlLoop(self.run_dir, self.run_id, host=self, bus=self.bus, steplog=self.steplog,
                                   is_main=env.is_main, broadcast=env.broadcast_object if env.distributed else None,
                                   metrics=self.metrics, log=lambda m: _log(env, m), skip=self.skip)

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
            raise TrainingError(f"dataset {data_dir} has {n} samples of length {cfg.model.seq_len}, "
                                f"fewer than one global batch ({self.global_batch})")
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

    # ================================================================== checkpoints (trainer/checkpointing.py)
    def save_checkpoint(self) -> None:
        self.checkpoints.save()

    def load_checkpoint(self, step: int | None = None, *, restore_skiplist: bool = True) -> int | None:
        return self.checkpoints.load(step, restore_skiplist=restore_skiplist)

    # ================================================================== control (the ControlHost side)
    def restore_checkpoint(self, step: int) -> None:
        """A rollback directive: reload the full state of checkpoint ``step`` in-process (the skip list is
        kept: it only grows). ``sentinel.client.ControlLoop`` does the rest (marker, ack, timeline)."""
        self._flush_readback()
        try:
            loaded = self.load_checkpoint(step, restore_skiplist=False)
        except (CheckpointError, TrainingError) as e:
            raise RestoreFailed(str(e)) from None
        assert loaded == step

    # ================================================================== start / resume (trainer/resume.py)
    def start(self) -> None:
        resume.start(self)

    # ================================================================== the step
    def next_batch(self) -> tuple[list[int], int, list[torch.Tensor], list[list[int]]]:
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
            _all_gather_flat(both, row)
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
            self.ckpt.fence()  # an async save's thread must have copied the weights and moments first
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
                  f"{env.world_size} rank(s), {cfg.parallelism if env.distributed else 'single'} on {env.device.type}"
                  f"{', compiled (the first steps compile)' if cfg.compile else ''}")
        while self.state.step < cfg.max_steps:
            t_ctl = time.perf_counter()
            self.control.poll(self.state.step)
            # paused still obeys preemption: a signal on any rank ends the hold (checkpoint, then exit)
            self.control.hold_while_paused(self.state.step, give_up=self._any_rank_signalled)
            stop = bool(self.control.stop_requested or self._stop_signal)
            if env.distributed:
                stop = not env.all_ok(not stop)
            if stop:
                why = self._stop_signal or ("stop directive" if self.control.stop_requested else "a signal on another rank")
                _log(env, f"stopping at step {self.state.step} ({why}{', paused' if self.control.paused else ''}; checkpointing first)")
                self.save_checkpoint()
                break
            t_control = time.perf_counter() - t_ctl
            self._one_step(t_control)
            if cfg.checkpoint.every and self.state.step % cfg.checkpoint.every == 0:
                self.save_checkpoint()
                self.checkpoints.check_age()
        else:  # finished: always leave a checkpoint of the final state (every=0 means "only at the end")
            if not cfg.checkpoint.every or self.state.step % cfg.checkpoint.every:
                self.save_checkpoint()
        self._flush_readback()
        self.ckpt.wait()
        self.checkpoints.check_age(final=True)
        self.control.end(self.state.step, "completed" if self.state.step >= cfg.max_steps else f"stopped: {why}")  # no "hung" page
        self._close_io()  # a collective (the lost-record count): before the barrier, so that no rank
        env.barrier()  # tears its process group down while another is still inside a collective

    def _close_io(self) -> None:
        """Flush the step log and the bus. Step records the disk never took make the exit non-zero."""
        if self.bus:
            self.bus.flush(5.0)
            self.bus.close()
            self.bus = self.telemetry.bus = self.control.bus = None
        lost = self.steplog.close() if self.steplog else 0
        lost = int(self.env.broadcast_object(lost))
        if lost:
            raise TrainingError(f"{lost} step record(s) could not be written to {self.run_dir / 'steps.jsonl'} "
                                f"({self.steplog.last_error if self.steplog else 'on rank 0'}); checkpoints are unaffected")

    def _one_step(self, t_control: float) -> None:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.clock.begin()
        markers = self._step_markers()
        seq = self.seq_now
        ids, n_skipped, micro, micro_ids = self.next_batch()
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
        out = StepOutput.from_readback(v, m)
        if not out.skipped:
            self.state.tokens += len(out.ids) * self.cfg.model.seq_len
        self.telemetry.emit(out, tokens=self.state.tokens, timeline=self.control.timeline,
                            last_checkpoint_time=self.checkpoints.last_time)
