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
from typing import Any, Iterator

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


def hf_entries(history: list[Any], path: str) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(where, trace-line dict) per training entry, or (where, the one-line reason) per entry that
    is none; evaluation losses are folded into the training entry of their step."""
    train: dict[int, dict[str, Any]] = {}  # step -> the trace-line dict of its training entry
    rows: list[tuple[str, dict[str, Any] | str, Any]] = []
    for i, e in enumerate(history):
        where = f"{path}: log_history[{i}]"
        if not isinstance(e, dict):
            rows.append((where, f"{where}: expected an object", None))
            continue
        step = e.get("step")
        if "loss" in e:
            obj: dict[str, Any] = {"step": step, "loss": e["loss"]}
            for src, dst in (("grad_norm", "grad_norm"), ("learning_rate", "lr")):
                if isinstance(e.get(src), (int, float)) and not isinstance(e.get(src), bool):
                    obj[dst] = e[src]
            if isinstance(step, int) and not isinstance(step, bool):
                train.setdefault(step, obj)
            rows.append((where, obj, None))
        elif "eval_loss" in e:
            rows.append((where, f"{where}: an evaluation entry (eval_loss) at step {str(step)[:40]} with no training "
                                f"entry at that step", (step, e["eval_loss"])))
        else:
            keys = ", ".join(sorted(str(k)[:30] for k in e)[:6])
            rows.append((where, f"{where}: no training loss (keys: {keys})", None))
    merged = set()
    for k, (_, _, ev) in enumerate(rows):  # first fold every evaluation in: a row is read once it is yielded
        if ev is not None:
            step, val = ev
            target = train.get(step) if isinstance(step, int) and not isinstance(step, bool) else None
            if target is not None and isinstance(val, (int, float)) and not isinstance(val, bool):
                target["val_loss"] = val
                merged.add(k)
    for k, (where, entry, _) in enumerate(rows):
        if k not in merged:
            yield where, entry
