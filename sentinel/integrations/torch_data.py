"""Skip-list-aware data for any torch loop: stable sample ids, skipped ids never yielded, a position that
survives a checkpoint.

- :class:`SkipAwareDataset` wraps a map-style dataset (``__len__`` and ``__getitem__``). Sample ``i`` of the
  wrapped dataset has the global id ``i`` whatever the order, the rank or the resume. It streams the ids
  in a seeded order per epoch (``shuffle=False``: 0, 1, 2...), epoch after epoch without end, and never
  yields an id the skip list holds: the sentinel's rollbacks and ``skip-samples`` directives grow that
  list while it runs (``skip`` is the session's live ``SkipList``). Each item is the wrapped item (a
  dict) plus ``sample_id``.
- Its position is :meth:`SkipAwareDataset.state_dict` (``{"seed", "epoch", "pos"}``); a loop that
  checkpoints it resumes at the same sample. A loop that instead fast-forwards by replaying batches (the
  Hugging Face ``Trainer`` on ``resume_from_checkpoint``) lands on the same sample too: the stream is a
  function of the seed and the skip list, and a rollback only ever adds ids from after the checkpoint.
- :class:`SampleIdCollator` builds batches with any collator and carries the batch's ids along as a
  ``sample_id`` tensor; the Hugging Face callback's forward pre-hook takes them out of the model's inputs
  before its ``forward`` and records them with the step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from sentinel.client.skiplist import SkipList

SAMPLE_ID = "sample_id"


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The ids of one epoch in training order: a function of its arguments only."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)


class SkipAwareDataset(IterableDataset):
    """An endless stream of ``dataset[i] | {"sample_id": i}``, ``i`` never in ``skip`` (see the module docstring).

    With DataLoader workers, each worker takes every ``num_workers``-th id of the stream; the skip list a
    worker sees is the one of the moment its iterator was created (a new epoch or a relaunch). Without
    workers the skip list is read live: ids a directive adds are never yielded from then on."""

    def __init__(self, dataset, *, skip: SkipList | None = None, seed: int = 0, shuffle: bool = True):
        if len(dataset) <= 0:
            raise ValueError("SkipAwareDataset needs a non-empty map-style dataset")
        self.dataset = dataset
        self.skip = skip if skip is not None else SkipList()
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.epoch, self.pos = 0, 0  # the next id is epoch_order(...)[pos] of epoch `epoch`
        # (rank, world size) when each rank iterates its own copy (Lightning DDP: its callback sets it); (0, 1)
        # when a framework shards batches itself (HF's accelerate)
        self.shard = (0, 1)
        self._start = (0, 0)  # where the next __iter__ starts

    # no __len__: a sized stream would make frameworks (HF) restart it every "epoch" of len(dataset) ids

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state.get("seed", self.seed)) != self.seed:
            raise ValueError(f"data position saved with seed {state.get('seed')}, this dataset has seed {self.seed}")
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self._start = (self.epoch, self.pos)

    def set_epoch(self, epoch: int) -> None:
        """Frameworks call this per epoch; the stream is endless and keeps its own epochs: ignored."""

    def item(self, sample_id: int) -> dict[str, Any]:
        item = self.dataset[int(sample_id)]
        out = dict(item) if isinstance(item, dict) else {"input_ids": item}
        out[SAMPLE_ID] = int(sample_id)
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        k, nw = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        rank, world = self.shard  # (rank, world size): each rank takes its share of the one stream too
        k, nw = rank * nw + k, world * nw
        epoch, pos = self._start
        n, taken = len(self.dataset), 0
        while True:
            order = epoch_order(n, self.seed, epoch, self.shuffle)
            mask = self.skip.contains_many(order[pos:]) if len(self.skip) else None
            seen, base = len(self.skip), pos
            found = False
            for j in range(pos, n):
                if len(self.skip) != seen:  # the skip list grew while streaming (a directive): re-read it from here
                    seen, base, mask = len(self.skip), j, self.skip.contains_many(order[j:])
                if mask is not None and mask[j - base]:
                    continue
                found = True
                taken += 1
                if worker is None:
                    self.epoch, self.pos = epoch, j + 1
                if (taken - 1) % nw == k:
                    yield self.item(order[j])
            if not found and pos == 0:
                raise RuntimeError("every sample of the dataset is on the skip list: nothing left to train on")
            epoch, pos = epoch + 1, 0
            if worker is None:
                self.epoch, self.pos = epoch, 0


class SampleIdCollator:
    """``collate(features)``: the batch ``inner`` builds from the features without their ``sample_id``,
    plus ``batch["sample_id"]`` (an int64 tensor of the ids, in batch order)."""

    def __init__(self, inner: Callable[[list], dict] | None = None):
        if inner is None:
            from torch.utils.data import default_collate

            inner = default_collate
        self.inner = inner

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if not all(SAMPLE_ID in f for f in features):  # an eval set with no ids: the plain batch
            return self.inner(features)
        ids = [int(f[SAMPLE_ID]) for f in features]
        batch = self.inner([{k: v for k, v in f.items() if k != SAMPLE_ID} for f in features])
        batch[SAMPLE_ID] = torch.tensor(ids, dtype=torch.int64)
        return batch
