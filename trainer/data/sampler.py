"""The deterministic sample stream: which sample id comes next, on every rank, after any restart.

The stream is a fresh permutation of ``range(num_samples)`` per epoch, seeded by ``(seed, epoch)``
only, walked by a cursor ``(epoch, position)``. Its whole state is the small JSON dict from
:meth:`Sampler.state_dict`, so a checkpoint stores it and a resumed run continues the exact same
stream: identical ids in identical order, hence bitwise-identical batches. Skipped ids (the skip
list) are stepped over by the cursor, so a skip never shifts the ids that follow it.

Determinism holds for a given numpy version (``Generator`` streams may change between numpy
releases; pin numpy for the life of a run). Memory: the current epoch's permutation is cached as
int32 (int64 above 2**31 samples): 4 bytes per sample, about 400 MB at 1e8 samples per process.
Beyond a few times 1e8 samples, shard the id space or replace the permutation with an O(1)-memory
bijection.
"""

from __future__ import annotations

import numpy as np

from sentinel.client.skiplist import SkipList
from sentinel.contract.ranges import batch_fingerprint  # noqa: F401  (re-exported: trainer.data.batch_fingerprint)

from .dataset import DataError

_SCAN_CHUNK = 4096  # ids examined per vectorised skip-list lookup


def epoch_permutation(num_samples: int, seed: int, epoch: int, stream: int | None = None) -> np.ndarray:
    """The order of sample ids in one epoch; a function of its arguments only. ``stream`` tells
    apart the independent streams of a mixture's sources (None: the plain dataset's stream)."""
    dtype = np.int32 if num_samples < 2**31 else np.int64
    perm = np.arange(num_samples, dtype=dtype)
    key = [seed, epoch] if stream is None else [seed, epoch, stream]
    np.random.Generator(np.random.PCG64(key)).shuffle(perm)
    return perm


def check_state(sd: dict, keys: set[str], fingerprint: str) -> None:
    """A saved sampler state has ``keys`` and was drawn from this dataset; DataError if not."""
    missing = (keys | {"dataset_fingerprint"}) - set(sd)
    if missing:
        raise DataError(f"bad sampler state: missing {', '.join(sorted(missing))}")
    if sd["dataset_fingerprint"] != fingerprint:
        raise DataError(
            f"dataset fingerprint mismatch: checkpoint was trained on {sd['dataset_fingerprint']}, this data is {fingerprint}"
        )


class Sampler:
    def __init__(self, num_samples: int, seed: int, dataset_fingerprint: str, *, offset: int = 0,
                 stream: int | None = None) -> None:
        """``offset``/``stream``: for one source of a mixture, whose ids are ``offset + [0, num_samples)``
        and whose permutations are keyed by ``stream`` as well (``mixture.MixtureSampler``)."""
        if num_samples < 1:
            raise DataError("the dataset has no training samples (it is shorter than one sequence)")
        if seed < 0:
            raise DataError(f"seed must be >= 0 (got {seed})")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.dataset_fingerprint = dataset_fingerprint
        self.offset = int(offset)
        self.stream = stream
        self.epoch = 0
        self.position = 0  # ids of the current epoch already consumed (taken or skipped)
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        # keep at most two epochs: the current one and the next (a peek across the wrap)
        if epoch not in self._perms:
            for old in sorted(self._perms)[: max(0, len(self._perms) - 1)]:
                del self._perms[old]
            self._perms[epoch] = epoch_permutation(self.num_samples, self.seed, epoch, self.stream)
        return self._perms[epoch]

    def _walk(self, n: int, skip: SkipList | None) -> tuple[list[int], int, int, int]:
        """The next ``n`` ids from the cursor: (ids, n_skipped, epoch after, position after)."""
        if n < 0:
            raise DataError(f"cannot draw {n} samples")
        ids: list[int] = []
        skipped = 0
        dry = 0  # ids scanned since the last one taken: a full epoch of them means all are skipped
        epoch, pos = self.epoch, self.position
        while len(ids) < n:
            if pos >= self.num_samples:
                epoch, pos = epoch + 1, 0
            need = n - len(ids)
            chunk = self._perm(epoch)[pos : pos + max(need, _SCAN_CHUNK)]
            if self.offset:
                chunk = chunk.astype(np.int64) + self.offset
            mask = skip.contains_many(chunk) if skip else np.zeros(len(chunk), dtype=bool)
            taken = np.flatnonzero(~mask)[:need]
            used = int(taken[-1]) + 1 if len(taken) == need else len(chunk)
            ids.extend(chunk[taken].tolist())
            skipped += int(mask[:used].sum())
            pos += used
            dry = dry + used if len(taken) == 0 else 0
            if dry >= self.num_samples:
                raise DataError(f"every one of the {self.num_samples} sample ids is in the skip list")
        return ids, skipped, epoch, pos

    def next_ids(self, n: int, skip: SkipList | None = None) -> tuple[list[int], int]:
        """Take the next ``n`` ids not in ``skip``; returns (ids, how many skipped ids were passed)."""
        ids, skipped, self.epoch, self.position = self._walk(n, skip)
        return ids, skipped

    def peek_ids(self, n: int, skip: SkipList | None = None) -> list[int]:
        """What :meth:`next_ids` would return, without moving the cursor (replay tooling)."""
        return self._walk(n, skip)[0]

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "dataset_fingerprint": self.dataset_fingerprint,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore a cursor. The checkpoint's seed wins (it defines the stream being resumed);
        a different dataset or sample count is refused, since ids would name other tokens."""
        check_state(sd, {"epoch", "position", "seed", "num_samples"}, self.dataset_fingerprint)
        if int(sd["num_samples"]) != self.num_samples:
            raise DataError(
                f"sample count mismatch: checkpoint has {sd['num_samples']} samples, this data has "
                f"{self.num_samples} (was seq_len changed?)"
            )
        epoch, position = int(sd["epoch"]), int(sd["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise DataError(f"bad sampler state: epoch {epoch}, position {position} of {self.num_samples}")
        if int(sd["seed"]) != self.seed:
            self._perms.clear()
        self.seed, self.epoch, self.position = int(sd["seed"]), epoch, position
