"""Data slices in the training loop: per-source weights, per-slice evaluation and timeline markers.

A slice is a source of the dataset (a plain dataset is one slice named after its source kind).
What lives here, so the loop itself only wires it in:

* :class:`MixtureWeights`: the sampling weights in effect at each step (the dataset's, or
  ``data.mixture`` from the config, times any ``reweight`` drill);
* :class:`SliceEval`: the fixed validation windows of every slice (its own held-out val split) and
  its fixed probe set, evaluated in one pass with one all-reduce and one host readback;
* :func:`source_onehot`: the ``[num_sources, B]`` matrix that turns per-sample losses into
  per-source sums on the device (a matmul: deterministic, unlike ``index_add_`` on CUDA);
* :func:`lr_phase_markers`: the LR schedule's phase changes (end of warmup, start of decay).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from trainer import faults as drills
from trainer.config import TrainConfig
from trainer.data import DataError, TokenDataset


def source_onehot(source_idx: np.ndarray, n_sources: int, device: torch.device) -> torch.Tensor:
    """``[n_sources, B]`` float32 with a 1 at (source of row b, b), on ``device`` without a sync
    (pinned, non-blocking upload on CUDA, like the token batches)."""
    m = np.zeros((n_sources, len(source_idx)), dtype=np.float32)
    m[np.asarray(source_idx, dtype=np.int64), np.arange(len(source_idx))] = 1.0
    t = torch.from_numpy(m)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def lr_phase_markers(step: int, cfg: TrainConfig) -> list[tuple[str, str]]:
    """Markers at the step boundary after ``step`` completed steps: ``warmup_end`` when warmup has
    just finished, ``decay_start`` when the first decaying step is next (``trainer.optim.lr_at``:
    linear warmup, then cosine decay to ``decay_steps``)."""
    o = cfg.optim
    decay_end = o.decay_steps or cfg.max_steps
    out = []
    if o.warmup_steps and step == o.warmup_steps:
        out.append(("warmup_end", f"lr reached {o.lr:g} after {o.warmup_steps} warmup steps"))
    if step == o.warmup_steps and step < decay_end:
        out.append(("decay_start", f"cosine decay to {o.lr * o.min_lr_ratio:g} at step {decay_end}"))
    return out


class MixtureWeights:
    """Sampling weights per source at a given step: base weights times ``reweight`` drill factors."""

    def __init__(self, ds: TokenDataset, cfg: TrainConfig) -> None:
        self.names = ds.source_names
        base = cfg.data.mixture
        if base is None:
            base = {s.name: s.weight for s in ds.sources}
        elif not ds.is_mixture and set(base) != set(self.names):
            raise DataError(f"data.mixture applies to mixture datasets; this one has the single source {self.names[0]}")
        unknown = sorted({f.source for f in cfg.source_faults} - set(self.names))
        if unknown:
            raise DataError(f"mixture drill on unknown source(s) {', '.join(unknown)} (sources: {', '.join(self.names)})")
        self.base = dict(base)
        self.faults = cfg.source_faults

    def at(self, step: int) -> dict[str, float]:
        """Unnormalised weights for the (1-based) ``step``."""
        w = dict(self.base)
        for name, factor in drills.source_weight_factors(self.faults, step).items():
            w[name] = w.get(name, 0.0) * factor
        return w

    def changes_at(self, step: int) -> bool:
        """Whether the step with 0-based index ``step`` samples with other (normalised) weights than
        the one before it: a planned change of the loss level, like a new sequence length. A pure
        function of the config and the step, so resume, replay and verify-resume agree."""
        if step <= 0:
            return False
        before, after = _normalised(self.at(step)), _normalised(self.at(step + 1))
        return any(abs(before.get(n, 0.0) - w) > 1e-12 for n, w in after.items())


def _normalised(w: dict[str, float]) -> dict[str, float]:
    total = sum(w.values())
    return {n: v / total for n, v in w.items()} if total > 0 else dict(w)


def describe_change(before: dict[str, float] | None, after: dict[str, float]) -> str:
    """``pydoc 0.300->0.600, shakespeare 0.500->0.286`` for the sources whose weight moved."""
    before = before or {}
    parts = [f"{n} {before.get(n, 0.0):.3f}->{w:.3f}" for n, w in after.items() if abs(before.get(n, 0.0) - w) > 1e-12]
    parts += [f"{n} {w:.3f}->0.000" for n, w in before.items() if n not in after]
    return ", ".join(parts) or "unchanged"


class SliceEval:
    """Fixed validation windows per slice plus a fixed probe set per slice.

    ``batches`` keeps the plain list of val batches (every slice's, in slice order) that the
    aggregate validation loss is the mean over; ``slots`` says which accumulator each batch and each
    probe adds to (val slice k: slot k, probe of slice k: slot S + k).
    """

    def __init__(self, ds: TokenDataset, seq_len: int, batch_size: int, n_batches: int, probe_samples: int,
                 log=print) -> None:
        self.names = ds.source_names
        n = len(self.names)
        self.batches: list[np.ndarray] = []
        items: list[tuple[np.ndarray, int]] = []
        if not ds.is_mixture:  # the whole val split, exactly as before mixtures existed
            self.batches = ds.val_batches(seq_len, batch_size, n_batches)
            items = [(b, 0) for b in self.batches]
            items.append((ds.probe_windows(seq_len, probe_samples, 0), n))
        else:
            for k, name in enumerate(self.names):
                try:
                    got = ds.val_batches(seq_len, batch_size, n_batches, source=k)
                except DataError as e:  # a tiny slice: train on it, but it cannot be evaluated
                    log(f"warning: slice {name} is not evaluated: {e}")
                    continue
                self.batches += got
                items += [(b, k) for b in got]
            for k in range(len(self.names)):
                try:
                    items.append((ds.probe_windows(seq_len, probe_samples, k), n + k))
                except DataError:
                    pass
        self.items = items
        self.counts = np.zeros(2 * n, dtype=np.float64)
        for b, slot in items:
            self.counts[slot] += len(b)

    def __bool__(self) -> bool:
        return bool(self.batches)

    def run(self, forward, env, pad_collectives: bool) -> tuple[float, dict[str, float], dict[str, float]]:
        """(aggregate val loss, val loss per slice, probe loss per slice). ``forward(tokens)``
        returns per-token losses ``(B, T)``. Batches are dealt round-robin over ranks; with
        ``pad_collectives`` (FSDP: every forward is a collective) each rank runs the same number of
        forwards, repeating the first batch and discarding it. One all-reduce, one readback."""
        n = len(self.names)
        acc = torch.zeros(2 * n, dtype=torch.float64, device=env.device)
        mine = list(range(env.rank, len(self.items), env.world_size))
        rounds = -(-len(self.items) // env.world_size) if pad_collectives else len(mine)
        with torch.no_grad():
            for r in range(rounds):
                i = mine[r] if r < len(mine) else None
                batch, slot = self.items[i if i is not None else 0]
                toks = torch.from_numpy(batch).to(env.device)
                per_token = forward(toks)
                if i is not None:
                    acc[slot] += per_token.double().mean(dim=1).sum()
        if env.distributed:
            dist.all_reduce(acc)
        sums = acc.tolist()  # off the hot path: once per eval interval
        val_n = self.counts[:n].sum()
        val = sum(sums[:n]) / val_n
        slices = {name: sums[k] / self.counts[k] for k, name in enumerate(self.names) if self.counts[k]}
        probe = {name: sums[n + k] / self.counts[n + k] for k, name in enumerate(self.names) if self.counts[n + k]}
        return val, slices, probe
