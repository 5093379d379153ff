"""The sample stream of a mixture dataset: which source each draw comes from, and which id.

Draw number ``slot`` (0, 1, 2, ... over the whole run, one per sample taken) picks a source with
probability proportional to the weights in effect, from a uniform number that is a pure function of
``(seed, slot)`` (splitmix64), so no random state has to be saved. The chosen source then yields
its next id from its own cursor: each source is a plain :class:`Sampler` over its own id range,
with its own epoch permutations (keyed by the source index). Hence:

* the whole state is ``slot`` plus one ``(epoch, position)`` cursor per source: the checkpoint
  stores it and a resumed run replays the same ids bitwise;
* a skipped id is stepped over inside its source's stream: skipping never shifts which source a
  later draw picks, nor the ids of other sources;
* changing the weights (config on resume, a ``reweight`` drill) changes which source later draws
  pick, never what an id names nor any cursor.

Sources shorter than one window at this ``seq_len`` have no samples and are never picked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from sentinel.client.skiplist import SkipList

from .dataset import DataError
from .sampler import Sampler, check_state

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def slot_uniforms(seed: int, first_slot: int, n: int) -> np.ndarray:
    """``n`` floats in [0, 1): splitmix64 of ``seed`` and each draw number, a pure function of both."""
    x = np.arange(first_slot, first_slot + n, dtype=np.uint64) * np.uint64(_GOLDEN)
    z = x + np.uint64((int(seed) * 0xD1B54A32D192ED03 + _GOLDEN) & _MASK)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def normalise_weights(names: Sequence[str], weights: Mapping[str, float], counts: Sequence[int]) -> list[float]:
    """Weights in source order, summing to 1; sources without samples get 0. DataError if unusable."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise DataError(f"mixture weight for unknown source(s) {', '.join(unknown)} (sources: {', '.join(names)})")
    raw = []
    for name, n in zip(names, counts):
        w = float(weights.get(name, 0.0))
        if not (math.isfinite(w) and w >= 0):
            raise DataError(f"mixture weight of {name} must be a finite number >= 0 (got {w})")
        raw.append(w if n > 0 else 0.0)
    total = sum(raw)
    if total <= 0:
        raise DataError("every source with samples has weight 0: nothing to train on")
    return [w / total for w in raw]


class MixtureSampler:
    """Same interface as :class:`Sampler` (``next_ids``, ``peek_ids``, state dicts), plus ``weights``."""

    def __init__(self, counts: Sequence[int], names: Sequence[str], seed: int, dataset_fingerprint: str,
                 weights: Mapping[str, float]) -> None:
        if sum(counts) < 1:
            raise DataError("the dataset has no training samples (every source is shorter than one sequence)")
        if seed < 0:
            raise DataError(f"seed must be >= 0 (got {seed})")
        self.names = list(names)
        self.counts = [int(n) for n in counts]
        self.num_samples = sum(self.counts)
        self.seed = int(seed)
        self.dataset_fingerprint = dataset_fingerprint
        firsts = np.cumsum([0] + self.counts).tolist()
        self.subs = [Sampler(n, seed, dataset_fingerprint, offset=firsts[k], stream=k) if n > 0 else None
                     for k, n in enumerate(self.counts)]
        self.slot = 0  # draws taken so far
        self.weights: list[float] = []
        self.set_weights(weights)

    def set_weights(self, weights: Mapping[str, float]) -> list[float]:
        """Use these (unnormalised) weights from the next draw on; returns the normalised vector."""
        self.weights = normalise_weights(self.names, weights, self.counts)
        self._cdf = np.cumsum(self.weights)
        return self.weights

    def choose(self, first_slot: int, n: int) -> np.ndarray:
        """Source index of draws ``first_slot .. first_slot + n - 1`` under the current weights."""
        u = slot_uniforms(self.seed, first_slot, n) * self._cdf[-1]
        return np.minimum(np.searchsorted(self._cdf, u, side="right"), len(self.names) - 1)

    def _walk(self, n: int, skip: SkipList | None):
        if n < 0:
            raise DataError(f"cannot draw {n} samples")
        picks = self.choose(self.slot, n)
        ids = np.empty(n, dtype=np.int64)
        skipped, cursors = 0, {}
        for k in np.unique(picks).tolist():
            rows = np.flatnonzero(picks == k)
            got, sk, epoch, pos = self.subs[k]._walk(len(rows), skip)
            ids[rows] = got
            skipped += sk
            cursors[k] = (epoch, pos)
        return ids.tolist(), skipped, cursors

    def next_ids(self, n: int, skip: SkipList | None = None) -> tuple[list[int], int]:
        """Take the next ``n`` ids not in ``skip``; returns (ids, how many skipped ids were passed)."""
        ids, skipped, cursors = self._walk(n, skip)
        for k, (epoch, pos) in cursors.items():
            self.subs[k].epoch, self.subs[k].position = epoch, pos
        self.slot += n
        return ids, skipped

    def peek_ids(self, n: int, skip: SkipList | None = None) -> list[int]:
        """What :meth:`next_ids` would return, without moving any cursor (replay tooling)."""
        return self._walk(n, skip)[0]

    def state_dict(self) -> dict:
        return {
            "kind": "mixture",
            "slot": self.slot,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "dataset_fingerprint": self.dataset_fingerprint,
            "sources": [
                {"name": name, "num_samples": n, "epoch": sub.epoch if sub else 0, "position": sub.position if sub else 0}
                for name, n, sub in zip(self.names, self.counts, self.subs)
            ],
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore the draw counter and every source's cursor; a different dataset, source layout
        or sample count (seq_len) is refused, since ids would name other tokens."""
        if sd.get("kind") != "mixture":
            raise DataError("sampler state is not a mixture's: the checkpoint was trained on a plain dataset")
        check_state(sd, {"slot", "seed", "num_samples", "sources"}, self.dataset_fingerprint)
        layout = [(s.get("name"), int(s.get("num_samples", -1))) for s in sd["sources"]]
        if layout != list(zip(self.names, self.counts)):
            raise DataError(f"sample count mismatch: checkpoint has sources {layout}, this data has "
                            f"{list(zip(self.names, self.counts))} (was seq_len changed?)")
        slot, seed = int(sd["slot"]), int(sd["seed"])
        if slot < 0 or seed < 0:
            raise DataError(f"bad sampler state: slot {slot}, seed {seed}")
        for sub, s in zip(self.subs, sd["sources"]):
            if sub is not None:
                sub.load_state_dict({"epoch": s["epoch"], "position": s["position"], "seed": seed,
                                     "num_samples": sub.num_samples, "dataset_fingerprint": self.dataset_fingerprint})
        self.slot, self.seed = slot, seed


def sampler_for(ds, seq_len: int, seed: int, weights: Mapping[str, float] | None = None):
    """The sampler the trainer uses for ``ds``: a :class:`MixtureSampler` (dataset weights unless
    ``weights``) for a mixture, else a plain :class:`Sampler`. For offline tools (drills, replay)."""
    if not ds.is_mixture:
        return Sampler(ds.num_samples(seq_len), seed, ds.fingerprint)
    w = dict(weights) if weights is not None else {s.name: s.weight for s in ds.sources}
    return MixtureSampler(ds.source_sample_counts(seq_len), ds.source_names, seed, ds.fingerprint, w)
