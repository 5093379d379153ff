"""A run's history as one JSON document: a list of step objects, or a table as pandas writes one.

JSON lines hold one step per line; many exports hold the whole history in one document instead:
``json.dump(rows, f)`` writes a list of objects, and pandas ``DataFrame.to_json`` writes a table in
one of its orients: ``records`` (a list of objects), ``columns`` (its default:
``{"step": {"0": 1, ...}, "loss": {"0": 10.8, ...}}``), ``index`` (``{"0": {"step": 1, ...}}``),
``split`` (``{"columns": [...], "data": [[...], ...]}``), ``table`` (``{"schema": ..., "data": [...]}``),
and a dict of lists (``{"step": [...], "loss": [...]}``) is the same table by columns. This turns
each row into the dict a trace line would hold, so it goes through the very same checks
(``backtest.record_from_obj``, after the step and loss are found under any of their names). pandas
writes a NaN as null: a null loss on a row of nothing else is read as a NaN there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from sentinel.trace_names import LOSS_NAMES, STEP_NAMES, find_name

MAX_BYTES = 256 << 20  # a history beyond 256 MiB (millions of steps) is not held in memory as one document


def json_document(data: bytes) -> Any | None:
    """The one JSON document ``data`` holds, or None: not JSON, more than one document (JSON lines),
    too large, or nested too deeply."""
    if len(data) > MAX_BYTES:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # JSON lines ("Extra data"), not JSON, or hostile nesting
        return None


def _names_a_step_and_loss(keys: Any) -> bool:
    names = [k for k in keys if isinstance(k, str)]
    return find_name(names, STEP_NAMES) is not None and find_name(names, LOSS_NAMES) is not None


def table_rows(doc: Any, path: str) -> Iterator[tuple[str, dict[str, Any] | str]] | None:
    """(where, row dict) per row of a history document, or (where, the one-line reason) for a row
    that is none; None when ``doc`` is no such table (a single step object, a trainer state)."""
    if isinstance(doc, list):  # a list of step objects (pandas orient "records")
        return _records(doc, path, lambda i: f"{path}: [{i}]")
    if not isinstance(doc, dict) or not doc:
        return None
    data = doc.get("data")
    cols = doc.get("columns")
    if isinstance(data, list) and isinstance(cols, list) and all(isinstance(c, str) for c in cols):  # orient "split"
        return ((f"{path}: data[{i}]", dict(zip(cols, row)) if isinstance(row, list) and len(row) == len(cols)
                 else f"{path}: data[{i}]: expected a list of {len(cols)} values") for i, row in enumerate(data))
    if isinstance(data, list) and isinstance(doc.get("schema"), dict):  # orient "table"
        return _records(data, path, lambda i: f"{path}: data[{i}]")
    values = list(doc.values())
    if _names_a_step_and_loss(doc) and all(isinstance(v, list) for v in values):  # a dict of lists
        n = max(len(v) for v in values)
        short = {k: len(v) for k, v in doc.items() if len(v) < n}  # a cell missing is no value, not a NaN loss
        return ((f"{path}: row {i}", {k: v[i] for k, v in doc.items()} if not any(i >= m for m in short.values())
                 else f"{path}: row {i}: column {next(k for k, m in short.items() if i >= m)!r} has only "
                      f"{min(m for m in short.values() if i >= m)} values, the longest {n}") for i in range(n))
    if _names_a_step_and_loss(doc) and all(isinstance(v, dict) for v in values):  # orient "columns"
        index: dict[str, None] = {}  # the rows in the order the first columns list them
        for v in values:
            index.update(dict.fromkeys(v))
        return ((f"{path}: row {idx[:40]!r}", {k: v.get(idx) for k, v in doc.items()}) for idx in index)
    if all(isinstance(v, dict) for v in values) and _names_a_step_and_loss(values[0]):  # orient "index"
        return ((f"{path}: {str(k)[:40]!r}", v) for k, v in doc.items())
    return None


def _records(rows: list[Any], path: str, where) -> Iterator[tuple[str, dict[str, Any] | str]]:
    for i, row in enumerate(rows):
        yield (where(i), row) if isinstance(row, dict) else (where(i), f"{where(i)}: expected a JSON object")
