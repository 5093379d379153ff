"""Step logs exported as CSV: what W&B, TensorBoard and pandas write, read as trace lines.

``sentinel backtest`` reads JSON lines; a run's history usually leaves a dashboard as a CSV
(W&B: ``_step,train/loss,...``; TensorBoard's scalar export: ``Wall time,Step,Value``; pandas:
``step,loss,...``). This turns each row into the dict a trace line would hold, so a CSV row goes
through the very same checks as a JSON line (``backtest.record_from_obj``).

Columns are found by name (case-insensitive, first match wins, see ``STEP_NAMES`` and
``LOSS_NAMES``) or named by the caller. Cells:

- an empty cell is "not reported": a row whose loss cell is empty while another metric's is not
  (W&B writes one row per logged step of *any* metric) is skipped and counted, with its reason, as
  a line is in a JSON trace; a row with only a step (and a clock) holds a NaN loss, as pandas
  writes one (``trace_names.null_loss_is_nan``);
- ``nan`` / ``inf`` losses stay non-finite (that is what the non-finite rule is for);
- a step written as a float (``100.0``, as pandas writes an int column with gaps) is an integer.

Rows are parsed one line at a time (a quoted field spanning lines is not a metrics export), so a
broken row (a NUL byte, a huge or unterminated field, a wrong number of cells) costs that row only.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Iterator
from typing import Any

from sentinel.trace_names import GRAD_NAMES, STEP_NAMES, TIME_NAMES, find_name, null_loss_is_nan, shown_names
from sentinel.trace_names import LOSS_NAMES as _LOSS_NAMES

# recognised column names (lower case, in order of preference): shared with JSON lines (``trace_names``)
LOSS_NAMES = _LOSS_NAMES + ("value",)  # "value": TensorBoard's export of one scalar

MAX_FIELD = 1 << 16  # a cell longer than this is not a number: the row is rejected, not parsed


class CsvHeaderError(ValueError):
    """The header names no step or no loss column (one line, for the CLI)."""


def looks_like_csv(first_line: bytes) -> bool:
    """Does the first non-empty line of a file read as a CSV header rather than a JSON line?"""
    s = first_line.lstrip(b"\xef\xbb\xbf").strip()
    return bool(s) and not s.startswith((b"{", b"[")) and (b"," in s or b"\t" in s)


def _pick(header: list[str], names: Iterable[str], chosen: str | None, what: str, option: str, path: str) -> int | None:
    name = find_name(header, names, chosen)
    if name is not None:
        return header.index(name)
    if chosen is not None:
        raise CsvHeaderError(f"{path}: no column {chosen!r} (columns: {shown_names(header)})")
    if what in ("step", "loss"):
        raise CsvHeaderError(f"{path}: no {what} column among {shown_names(header)}; name it with {option}")
    return None


def _split(line: str, delim: str) -> list[str]:
    return next(csv.reader([line], delimiter=delim, strict=True))


def _number(cell: str) -> float:
    return float(cell.strip())


class _Columns:
    """Where a CSV's step, loss, grad-norm and clock columns are, from its header line."""

    def __init__(self, text: str, n: int, path: str, step_column: str | None, loss_column: str | None):
        self.delim = "\t" if text.count("\t") > text.count(",") else ","
        try:
            self.header = _split(text.rstrip("\r\n"), self.delim)
        except csv.Error as e:
            raise CsvHeaderError(f"{path}:{n}: unreadable CSV header ({e})") from None
        h = self.header
        self.step = _pick(h, STEP_NAMES, step_column, "step", "--step-column", path)
        self.loss = _pick(h, LOSS_NAMES, loss_column, "loss", "--loss-column", path)
        if self.loss == self.step:
            raise CsvHeaderError(f"{path}: the step and loss columns are the same column")
        self.grad = _pick(h, GRAD_NAMES, None, "grad norm", "", path)
        low = [c.strip().lower() for c in h]
        self.time, self.t_scale = next(((low.index(name), scale) for name, scale in TIME_NAMES if name in low), (None, 1.0))

    def row(self, text: str) -> dict[str, Any]:
        """One data line -> a trace-line dict; ``ValueError`` / ``csv.Error`` with the reason."""
        if len(text) > MAX_FIELD * 4:
            raise ValueError("line too long for a metrics row")
        cells = _split(text.rstrip("\r\n"), self.delim)
        if len(cells) != len(self.header):
            raise ValueError(f"{len(cells)} cells, the header has {len(self.header)}")
        if any(len(c) > MAX_FIELD for c in cells):
            raise ValueError("a cell too long for a number")
        loss_cell = cells[self.loss].strip()
        if not loss_cell:  # pandas writes a NaN as an empty cell; W&B leaves the rows of other metrics empty
            if not null_loss_is_nan(h for h, c in zip(self.header, cells) if c.strip()):
                raise ValueError(f"no value in column {self.header[self.loss].strip()!r}")
            loss_cell = "nan"
        step = _number(cells[self.step])
        if not math.isfinite(step) or step != int(step):
            raise ValueError(f"step {cells[self.step].strip()[:40]!r} is not a whole number")
        obj: dict[str, Any] = {"step": int(step), "loss": _number(loss_cell)}
        if self.grad is not None and cells[self.grad].strip():
            obj["grad_norm"] = _number(cells[self.grad])
        if self.time is not None and cells[self.time].strip():
            t = _number(cells[self.time]) * self.t_scale
            if math.isfinite(t):
                obj["time"] = t
        return obj


def csv_rows(lines: Iterable[bytes], path: str, *, step_column: str | None = None, loss_column: str | None = None,
             source: dict[str, Any] | None = None) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """(line number, trace-line dict) for each data row, or (line number, the one-line reason) for
    a row that cannot be one. A header without a step or loss column raises ``CsvHeaderError``.
    ``source`` (a dict) gets the names of the step and loss columns read."""
    cols: _Columns | None = None
    for n, raw in enumerate(lines, 1):
        text = raw.decode("utf-8", errors="replace")
        if cols is None:
            text = text.lstrip("\ufeff")
        if not text.strip():
            continue
        if cols is None:
            cols = _Columns(text, n, path, step_column, loss_column)
            if source is not None:
                source.update(step=cols.header[cols.step].strip()[:80], loss=cols.header[cols.loss].strip()[:80])
            continue
        try:
            yield n, cols.row(text)
        except (csv.Error, ValueError, OverflowError) as e:
            yield n, f"{path}:{n}: {str(e)[:200]}"
    if cols is None:
        raise CsvHeaderError(f"{path}: empty CSV (no header)")
