"""The names other tools give a step log's step, training loss, grad norm and clock.

A W&B export writes ``_step`` and ``train/loss``, a Lightning or Hugging Face logger
``global_step`` and ``train_loss``, a nanoGPT-style script ``iter``; our own trainer writes
``step`` and ``loss``. The CSV reader (``trace_csv``) looks them up among a header's columns and the
JSON-lines reader (``backtest``) among a line's keys, with the same names in the same order of
preference, so a log reads the same whichever way it was exported. Names compare case-insensitively.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

STEP_NAMES = ("step", "_step", "global_step", "trainer/global_step", "iteration", "iter", "steps")
LOSS_NAMES = ("loss", "train/loss", "train_loss", "train/lm_loss", "lm_loss", "lm loss", "training_loss", "train/loss_step")
GRAD_NAMES = ("grad_norm", "train/grad_norm", "grad norm", "gradient_norm", "train/grad_norm_step")
# (name, factor to seconds)
TIME_NAMES = (("wall_ms", 1e-3), ("wall time", 1.0), ("wall_time", 1.0), ("_timestamp", 1.0), ("time", 1.0), ("timestamp", 1.0))


# What a line holds besides its metrics: the step, the loss and the clock under any of their names,
# the run and kind of our own lines, and the bookkeeping of the exporters (W&B ``_runtime``, HF ``epoch``).
_BOOKKEEPING = frozenset(n.lower() for n in (*STEP_NAMES, *LOSS_NAMES, *(t for t, _ in TIME_NAMES),
                                              "run", "kind", "_runtime", "epoch", "value", "index"))


def null_loss_is_nan(names_with_values: Iterable[str]) -> bool:
    """Is a step line's missing (null, empty) loss a loss that was not a number?

    ``names_with_values``: the names of the line's other fields that hold a value. Strict JSON has
    no NaN, so pandas ``to_json`` and JavaScript write a NaN loss as null, and pandas ``to_csv`` as
    an empty cell. A line with a step (and a clock) and nothing else was written for that loss: a
    run whose loss went NaN would otherwise read as a run without losses, and its divergence would
    go unjudged. A line that holds some other metric (a W&B history row of a val-loss step) only
    did not report the training loss: it is skipped, as before."""
    return all(_bookkeeping(n.strip().lower()) for n in names_with_values)


def _bookkeeping(name: str) -> bool:
    # pandas' index column: unnamed ("", or "Unnamed: 0" read back and written again) or "index"
    return name in _BOOKKEEPING or not name or name.startswith("unnamed:")


class TraceKeyError(ValueError):
    """A named key is not in a line (one line, for the CLI)."""


def find_name(available: Iterable[str], names: Iterable[str], chosen: str | None = None) -> str | None:
    """The name in ``available``, as written there, that ``chosen`` names, or else the first of
    ``names`` that is there (case and surrounding blanks ignored; the first of equal names wins).
    None when it is not there. The CSV reader finds columns with it, the JSON-lines reader keys and
    the TensorBoard reader tags."""
    low: dict[str, str] = {}
    for a in available:
        low.setdefault(a.strip().lower(), a)
    if chosen is not None:
        return low.get(chosen.strip().lower())
    return next((low[n] for n in names if n in low), None)


def shown_names(names: list[str], limit: int = 12) -> str:
    """The first ``limit`` names (columns, tags), quoted and cut to 40 characters, for a one-line error."""
    shown = [n.strip()[:40] for n in names[:limit]]
    return ", ".join(repr(n) for n in shown) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _find(obj: dict[str, Any], names: Iterable[str], chosen: str | None, what: str) -> str | None:
    """The key of ``obj`` that holds ``what``; ``TraceKeyError`` when ``chosen`` is not one."""
    key = find_name((k for k in obj if isinstance(k, str)), names, chosen)
    if key is None and chosen is not None:
        raise TraceKeyError(f"no key {chosen[:40]!r} for the {what}")
    return key


def canonical_step_keys(obj: dict[str, Any], step_key: str | None = None, loss_key: str | None = None,
                        used: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON step line with its step, loss, grad norm and clock under the names a trace line uses
    (``step``, ``loss``, ``grad_norm``, ``time``), taken from the first of the known names it has
    (or from ``step_key`` / ``loss_key`` when given). A line that already uses our names is returned
    as it is; one without a step or a loss under any name is left without it (the caller rejects it
    and says which is missing). ``TraceKeyError`` when a named key is absent. ``used`` (a dict)
    gets the names of the step and loss keys of the first line that has both."""
    if step_key is None and loss_key is None and "step" in obj and "loss" in obj:
        if used is not None and "loss" not in used:
            used.update(step="step", loss="loss")
        return obj
    if step_key is not None and loss_key is not None and step_key.strip().lower() == loss_key.strip().lower():
        raise TraceKeyError(f"the step and loss keys are the same key ({step_key[:40]!r})")
    out = dict(obj)
    found = {}
    for canon, names, chosen in (("step", STEP_NAMES, step_key), ("loss", LOSS_NAMES, loss_key)):
        key = _find(obj, names, chosen, canon)
        if key is not None:
            out[canon] = obj[key]
            found[canon] = key[:80]
    if used is not None and "loss" not in used and len(found) == 2:
        used.update(found)
    if "grad_norm" not in obj:
        key = _find(obj, GRAD_NAMES, None, "grad norm")
        if key is not None:
            out["grad_norm"] = obj[key]
    if "time" not in obj and "wall_ms" not in obj:
        for name, scale in TIME_NAMES:
            key = find_name((k for k in obj if isinstance(k, str)), (name,))
            if key is None:
                continue
            v = obj[key]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                try:
                    t = float(v) * scale
                except OverflowError:  # an integer beyond float range: no clock
                    continue
                if t - t == 0.0:  # finite
                    out["time"] = t
                    break
    return out
