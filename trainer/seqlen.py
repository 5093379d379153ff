"""The sequence-length schedule (seq-len warmup / curriculum): train on shorter sequences first.

``data.seq_len_schedule: [[0, 16], [200, 32], [400, 64]]`` with ``model.seq_len: 64`` trains at 16
tokens per sequence for steps 1..200, at 32 for 201..400, then at 64. ``model.seq_len`` stays the
size of the position table and the unit of the data stream:

* a **sample id** always names one ``model.seq_len`` window (``trainer/data/dataset.py``), whatever
  length is trained; at a scheduled length ``L`` each drawn window is cut into ``k = model.seq_len / L``
  consecutive sequences of ``L + 1`` tokens (each sharing one token with the next, like consecutive
  windows do), so exactly the window's ``model.seq_len`` targets are trained, none twice, none lost;
* a step draws ``global_batch / k`` ids, so a micro-batch keeps ``data.micro_batch_size`` sequences
  (tokens per step scale with ``L``: the usual seq-len warmup);
* hence the sampler cursor, the skip list, ``replay-batch`` and the step records' ``sample_ids`` all
  keep counting ``model.seq_len`` windows: a change of length mid-run neither repeats nor skips data,
  and a resume on either side of a change is exact (the schedule is a function of the step).

The step at which a new length takes effect gets a ``seq_len_change`` marker, and the in-process
guard rebuilds its loss baseline there (:func:`changes_at`). Validation stays at ``model.seq_len``.
"""

from __future__ import annotations

import numpy as np

from trainer.config import TrainConfig


def seq_len_at(cfg: TrainConfig, step: int) -> int:
    """Tokens per sequence of the step after ``step`` completed steps (0-based step index)."""
    now = cfg.model.seq_len
    for from_step, n in cfg.data.seq_len_schedule:
        if step < from_step:
            break
        now = n
    return now


def changes_at(cfg: TrainConfig, step: int) -> bool:
    """Whether the step with 0-based index ``step`` trains at another length than the one before it
    (the in-process guard rebuilds its loss baseline there: a planned level shift is not a spike)."""
    return step > 0 and seq_len_at(cfg, step) != seq_len_at(cfg, step - 1)


def pieces_at(cfg: TrainConfig, step: int) -> int:
    """Sequences cut from each sample (``model.seq_len`` window) at that step."""
    return cfg.model.seq_len // seq_len_at(cfg, step)


def split_windows(toks: np.ndarray, seq_len: int) -> np.ndarray:
    """``(n, S + 1)`` windows -> ``(n * S / seq_len, seq_len + 1)`` sequences, each window's pieces in
    order (piece ``i`` is tokens ``[i * seq_len, (i + 1) * seq_len]`` of it)."""
    n, width = toks.shape
    k = (width - 1) // seq_len
    if k == 1:
        return toks
    return np.stack([toks[:, i * seq_len: (i + 1) * seq_len + 1] for i in range(k)], axis=1).reshape(n * k, seq_len + 1)


def describe_change(before: int, after: int, global_batch: int) -> str:
    """``seq_len 32->64 (4096->8192 tokens per step)``: the marker's detail."""
    return f"seq_len {before}->{after} ({global_batch * before}->{global_batch * after} tokens per step)"
