"""One optimizer step's telemetry: a typed ``StepOutput`` in, the step record, the bus message and the
Prometheus update out.

The trainer reads each step's device values back one step late (``trainer/readback.py``: no host sync in
the step) and hands them here as a :class:`StepOutput`. :class:`StepEmitter` turns it into

- the ``StepRecord`` in ``steps.jsonl`` and on the bus (rank 0), preceded by any ``MarkerRecord`` of a
  change of training conditions at that step (lr phase, seq_len, mixture);
- the ``training_*`` metrics of every rank (``sentinel.client.metrics.TrainerMetrics``);
- the console line every ``telemetry.log_every`` steps.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sentinel.client.steplog import StepLog, write_and_publish
from sentinel.protocol import MarkerRecord, StepRecord
from trainer.data import batch_fingerprint
from trainer.guard import REASONS
from trainer.phases import RANK_PHASES, as_dict
from trainer.telemetry.digest import digest_hex
from trainer.telemetry.mfu import mfu as mfu_fn


def _listed(x):
    """A gathered value as a list (one rank's comes back as a scalar)."""
    return None if x is None else (x if isinstance(x, list) else [x])


@dataclass(frozen=True)
class StepOutput:
    """Host values of one finished optimizer step (``step`` is the number of steps completed)."""

    step: int
    lr: float
    ids: list[int]  # the global batch's sample ids
    n_skipped: int  # ids the sampler passed over (skip list)
    time: float  # wall clock when the step was queued
    t_start: float  # perf_counter at its start
    phases: dict[str, float]
    markers: list[tuple[str, str]]  # (kind, detail) of changes at this step boundary
    seq_len: int  # tokens per sequence in effect
    loss: float
    rank_losses: list[float]
    grad_norm: float
    factor: float  # 0.0: the guard skipped the update
    reason: int  # the guard's reason code when skipped
    val: float | None = None
    val_slices: dict[str, float] | None = None
    probe: dict[str, float] | None = None
    source_counts: list[int] | None = None  # sequences per source in the batch (mixtures)
    source_sums: list[float] | None = None  # per-source loss sums over the batch
    rank_phases: list[float] | None = None  # flat (world x RANK_PHASES), from the loss all-gather
    digest: list[int] | None = None  # param digest words

    @classmethod
    def from_readback(cls, v: dict, m: dict) -> StepOutput:
        """From ``StepReadback``'s (host values, meta) pair."""
        return cls(step=m["step"], lr=m["lr"], ids=m["ids"], n_skipped=m["n_skipped"], time=m["time"],
                   t_start=m["t_start"], phases=dict(m["phases"]), markers=m["markers"], seq_len=m["seq_len"],
                   loss=v["loss"], rank_losses=_listed(v["ranks"]), grad_norm=v["grad_norm"], factor=v["factor"],
                   reason=int(v["reason"]), val=m["val"], val_slices=m["val_slices"], probe=m["probe"],
                   source_counts=m["source_counts"], source_sums=_listed(v.get("source_sums")),
                   rank_phases=v.get("rank_phases"), digest=v.get("digest"))

    @property
    def skipped(self) -> bool:
        return self.factor == 0.0


@dataclass
class StepEmitter:
    """Emits every step's telemetry; ``bus`` may be attached after construction (rank 0 only)."""

    run_id: str
    env: Any  # trainer.dist.DistEnv
    model_seq_len: int  # an id is one window of this many tokens, whatever length it was cut into
    source_names: list[str]
    log_every: int
    grad_clip: float
    steplog: StepLog | None = None
    bus: Any = None  # sentinel.client.BusClient
    metrics: Any = None  # sentinel.client.metrics.TrainerMetrics
    flops_per_token: Callable[[int], float] | None = None
    peak: float | None = None

    def __post_init__(self) -> None:
        self._throughput: deque = deque(maxlen=20)  # (time, tokens, flops) of the last steps: tokens/s and MFU

    def emit(self, out: StepOutput, *, tokens: int, timeline: int, last_checkpoint_time: float | None) -> None:
        """``tokens``: the run's total after this step (skipped steps add none)."""
        env = self.env
        t_tel = time.perf_counter()
        step_tokens = len(out.ids) * self.model_seq_len
        tps, mfu = self._rates(step_tokens, out.seq_len)
        loaded = (len(out.ids) + out.n_skipped) * self.model_seq_len
        useful = 0 if out.skipped else step_tokens
        phases = dict(out.phases)
        step_seconds = time.perf_counter() - out.t_start
        if env.device.type == "cuda" and all(p in phases for p in RANK_PHASES):
            # The host's span runs from queueing this step to reading it back a step later: ~2 steps when
            # the device is the bottleneck (measured on an H100: 0.458 s against 0.233 s between steps).
            # The device's own span of its newest finished step (its CUDA events: the four phases) is it.
            step_seconds = sum(phases[p] for p in RANK_PHASES)
        reason = REASONS.get(out.reason) if out.skipped else None
        source_loss = self._source_loss(out)
        for kind, detail in out.markers:
            if env.is_main:
                self._write(MarkerRecord(run=self.run_id, step=out.step - 1, timeline=timeline, marker=kind,
                                         detail=detail, time=out.time))
            if self.metrics:
                self.metrics.on_timeline_event(kind)
        if env.is_main:
            self._write(self._record(out, tokens=tokens, timeline=timeline, step_tokens=step_tokens, tps=tps, mfu=mfu,
                                     step_seconds=step_seconds, phases=phases, reason=reason, source_loss=source_loss,
                                     loaded=loaded, useful=useful, last_checkpoint_time=last_checkpoint_time))
            if self.metrics and self.steplog and self.steplog.write_failures:
                self.metrics.set_step_log(write_failures=self.steplog.write_failures, lost=self.steplog.lost,
                                          buffered=self.steplog.buffered)
        phases["telemetry"] = time.perf_counter() - t_tel
        if self.metrics:
            main = env.is_main
            self.metrics.on_step(
                step=out.step, loss=out.loss if main else None, rank_loss=out.rank_losses[env.rank],
                grad_norm=out.grad_norm if main else None, lr=out.lr if main else None,
                tokens_total=tokens if main else None, step_seconds=step_seconds, phases=phases,
                step_tokens=step_tokens, grad_clipped=bool(self.grad_clip and out.grad_norm > self.grad_clip),
                skipped_reason=reason, skipped_samples=out.n_skipped, loaded_tokens=loaded, useful_tokens=useful, mfu=mfu,
            )
            self.metrics.on_slice_losses(source_loss)
            self.metrics.set_sequence_length(out.seq_len)
            if self.bus:
                self.metrics.set_telemetry_dropped(self.bus.dropped)
        if env.is_main and out.step % self.log_every == 0:
            extra = f" val {out.val:.4f}" if out.val is not None else ""
            print(f"step {out.step:>6} | loss {out.loss:.4f} | gnorm {out.grad_norm:.3f} | lr {out.lr:.2e}"
                  f"{' | SKIPPED ' + str(reason) if out.skipped else ''}{extra}", flush=True)

    def _rates(self, step_tokens: int, seq_len: int) -> tuple[float | None, float | None]:
        """(tokens/s, MFU) over the last steps; FLOPs per token averaged over the window (a seq_len change)."""
        now = time.time()
        fpt = self.flops_per_token(seq_len) if self.flops_per_token else 0.0
        self._throughput.append((now, step_tokens, step_tokens * fpt))
        if len(self._throughput) < 2:
            return None, None
        span = self._throughput[-1][0] - self._throughput[0][0]
        recent = list(self._throughput)[1:]
        tokens = sum(t for _, t, _ in recent)
        tps = tokens / span if span > 0 else None
        mfu = None
        if tps and self.peak and fpt:
            mfu = mfu_fn(tps, sum(f for _, _, f in recent) / tokens, self.peak, self.env.world_size)
        return tps, mfu

    def _source_loss(self, out: StepOutput) -> dict[str, float] | None:
        if out.source_sums is not None and out.source_counts:
            return {n: out.source_sums[k] / c
                    for k, (n, c) in enumerate(zip(self.source_names, out.source_counts)) if c}
        if len(self.source_names) == 1:
            return {self.source_names[0]: out.loss}
        return None

    def _record(self, out: StepOutput, *, tokens, timeline, step_tokens, tps, mfu, step_seconds, phases, reason,
                source_loss, loaded, useful, last_checkpoint_time) -> StepRecord:
        env = self.env
        if out.rank_phases is not None:
            flat, k = out.rank_phases, len(RANK_PHASES)
            rank_phases = [as_dict(flat[r * k:(r + 1) * k]) for r in range(env.world_size)]
        else:
            rank_phases = [{p: phases[p] for p in RANK_PHASES if p in phases}]
        now = time.time()
        return StepRecord(
            run=self.run_id, step=out.step, timeline=timeline, loss=out.loss, loss_max_rank=max(out.rank_losses),
            rank_losses=out.rank_losses, grad_norm=out.grad_norm, lr=out.lr, tokens=tokens, batch_tokens=step_tokens,
            batch_fingerprint=batch_fingerprint(out.ids), sample_ids=out.ids, skipped=out.skipped, skip_reason=reason,
            time=out.time, param_digest=digest_hex(out.digest) if out.digest is not None else None,
            step_seconds=step_seconds, phases=phases, rank_phases=rank_phases, tokens_per_second=tps, mfu=mfu,
            val_loss=out.val, val_ppl=(math.exp(out.val) if out.val is not None and out.val < 700 else None),
            checkpoint_age_seconds=(now - last_checkpoint_time) if last_checkpoint_time else None,
            effective_token_ratio=useful / loaded if loaded else None, world_size=env.world_size,
            source_loss=source_loss, val_slice_loss=out.val_slices, probe_loss=out.probe,
        )

    def _write(self, rec) -> None:
        write_and_publish(rec, self.steplog, self.bus)
