"""Hugging Face Trainer's ``trainer_state.json``: its ``log_history`` read as trace lines.

Every ``transformers.Trainer`` checkpoint folder holds a ``trainer_state.json`` whose
``log_history`` lists what the run logged, one entry per ``logging_steps``:
``{"loss": 2.31, "grad_norm": 1.7, "learning_rate": 5e-05, "epoch": 0.1, "step": 10}``, and one per
evaluation: ``{"eval_loss": 2.4, ..., "step": 500}``. This turns them into the dicts a trace line
would hold, so they pass the same checks as a JSON line (``backtest.record_from_obj``):

- ``loss`` → loss, ``grad_norm`` → grad norm, ``learning_rate`` → lr;
- an evaluation entry at the step of a training entry gives that step its ``val_loss``; one that
  matches no training entry, the run's closing summary (``train_loss``, ``train_runtime``) and any
  other entry without a training loss are skipped and counted, with their reason;
- the history has no clock: the step number stands in for time (cooldowns in seconds then read
  as steps).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

MAX_BYTES = 1 << 30  # a trainer state beyond 1 GiB is not one: read as JSON lines instead


def trainer_state_history(data: bytes) -> list[Any] | None:
    """The ``log_history`` list of a trainer-state document, or None when ``data`` is not one
    (not one JSON object, or one without a ``log_history`` list)."""
    head = data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
    if head != b"{" or len(data) > MAX_BYTES:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):  # JSON lines, or not JSON at all
        return None
    history = doc.get("log_history") if isinstance(doc, dict) else None
    return history if isinstance(history, list) else None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def hf_entries(history: list[Any], path: str) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(where, trace-line dict) per training entry, or (where, the one-line reason) per entry that
    is none; evaluation losses are folded into the training entry of their step."""
    train: dict[int, dict[str, Any]] = {}  # step -> the trace-line dict of its (first) training entry
    rows: list[tuple[str, dict[str, Any] | str]] = []
    evals: dict[int, tuple[Any, Any]] = {}  # row index -> (step, eval_loss) of an evaluation entry
    for i, e in enumerate(history):
        where = f"{path}: log_history[{i}]"
        if not isinstance(e, dict):
            rows.append((where, f"{where}: expected an object"))
            continue
        step = e.get("step")
        if "loss" in e:
            obj: dict[str, Any] = {"step": step, "loss": e["loss"]}
            for src, dst in (("grad_norm", "grad_norm"), ("learning_rate", "lr")):
                if _is_number(e.get(src)):
                    obj[dst] = e[src]
            if _is_int(step):
                train.setdefault(step, obj)
            rows.append((where, obj))
        elif "eval_loss" in e:
            evals[len(rows)] = (step, e["eval_loss"])
            rows.append((where, f"{where}: an evaluation entry (eval_loss) at step {str(step)[:40]} with no training "
                                f"entry at that step"))
        else:
            keys = ", ".join(sorted(str(k)[:30] for k in e)[:6])
            rows.append((where, f"{where}: no training loss (keys: {keys})"))
    folded = set()  # every evaluation goes in before any row is yielded: a yielded row is read at once
    for k, (step, val) in evals.items():
        if _is_int(step) and step in train and _is_number(val):
            train[step]["val_loss"] = val
            folded.add(k)
    for k, row in enumerate(rows):
        if k not in folded:
            yield row
