"""The skip list: sample-id ranges the trainer must never train on again.

The sentinel adds ranges when it blames a loss spike on data; the trainer consults the list for
every id the sampler draws. Ranges are ``[lo, hi)`` and kept merged, so lookups are a bisect and
the file stays small however many directives arrive. The list only grows while a run trains; an
operator may take ranges off a stopped run (``sentinel skip-list remove``, applied at the next
start: ``remove``).
File format (``RUN_DIR/skiplist.json``): a JSON list ``[[lo, hi], ...]``.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from sentinel.protocol import (
    MAX_SAMPLE_ID,
    MAX_STATE_BYTES,
    atomic_write_text,
    merge_ranges,
    read_regular_file,
    subtract_ranges,
)


class DataError(Exception):
    """A data-side problem a user can fix (a skip list, a sample range, a dataset); one line, saying how when it can."""


class SkipList:
    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        self._set(merge_ranges(_checked(ranges)))

    def _set(self, ranges: list[tuple[int, int]]) -> None:
        self._ranges = ranges
        self._los = [lo for lo, _ in ranges]
        self._his = [hi for _, hi in ranges]
        self._size = sum(hi - lo for lo, hi in ranges)

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return list(self._ranges)

    def __len__(self) -> int:
        """Number of sample ids covered."""
        return self._size

    def __repr__(self) -> str:
        return f"SkipList({self._ranges!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SkipList) and self._ranges == other._ranges

    def add(self, ranges: Iterable[tuple[int, int]]) -> bool:
        """Merge more ranges in; True if any new id became covered."""
        before = self._size
        self._set(merge_ranges(self._ranges + _checked(ranges)))
        return self._size > before

    def remove(self, ranges: Iterable[tuple[int, int]]) -> int:
        """Take ranges out (an operator's decision, applied at a start); returns the ids uncovered."""
        before = self._size
        self._set(subtract_ranges(self._ranges, _checked(ranges)))
        return before - self._size

    def contains(self, sample_id: int) -> bool:
        j = bisect_right(self._los, sample_id) - 1
        return j >= 0 and sample_id < self._his[j]

    def contains_many(self, ids: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`contains`: a bool mask over ``ids``."""
        ids = np.asarray(ids)
        if not self._ranges:
            return np.zeros(ids.shape, dtype=bool)
        j = np.searchsorted(np.asarray(self._los, dtype=np.int64), ids, side="right") - 1
        his = np.asarray(self._his, dtype=np.int64)
        return (j >= 0) & (ids < his[np.maximum(j, 0)])

    def save(self, path: Path | str) -> None:
        """Write atomically (tmp + fsync + rename): a crash leaves the old or the new list, never half."""
        atomic_write_text(path, json.dumps([[lo, hi] for lo, hi in self._ranges]))

    @classmethod
    def load(cls, path: Path | str) -> SkipList:
        """Read a saved list; a missing file is an empty list (nothing skipped yet).

        Anything else that is not a valid list is refused in one line (DataError), never ignored:
        dropping a skip list would silently train on the data it was written to keep out. That
        includes a reversed or empty range (``[10, 5]``): the sentinel never writes one, so it is
        a damaged file, not a range to drop. The read is bounded (``sentinel.protocol.read_regular_file``): a
        symlink to /dev/zero or a FIFO is refused instead of read forever."""
        path = Path(path)
        try:
            raw = json.loads(read_regular_file(path, MAX_STATE_BYTES).decode("utf-8"))
        except FileNotFoundError:
            return cls()
        except OSError as e:
            raise DataError(f"skip list {path} is unreadable: {e.strerror or e}") from None
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past the parser
            raise DataError(f"skip list {path} is unreadable: {str(e).splitlines()[0][:200] if str(e) else 'nested too deep'}") from None
        try:
            ranges = [(lo, hi) for lo, hi in raw]
            checked = _checked(ranges)
        except (TypeError, ValueError, DataError) as e:
            raise DataError(f"skip list {path} is malformed: expected [[lo, hi], ...] ({e})") from None
        empty = next((r for r in checked if r[1] <= r[0]), None)
        if empty is not None:
            raise DataError(f"skip list {path} is malformed: range [{empty[0]}, {empty[1]}] is empty or reversed "
                            "(need 0 <= lo < hi, hi excluded)")
        return cls(checked)


def _checked(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Integer bounds with 0 <= lo and hi <= int64 max (ids are int64 in numpy and torch: a larger
    bound would be an OverflowError at the first lookup). DataError (one line) otherwise."""
    out = []
    for r in ranges:
        try:
            lo, hi = r
            ok = int(lo) == lo and int(hi) == hi and not isinstance(lo, bool) and not isinstance(hi, bool)
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok or not 0 <= int(lo) <= MAX_SAMPLE_ID or not int(hi) <= MAX_SAMPLE_ID:
            raise DataError(f"bad skip range {list(r) if isinstance(r, (list, tuple)) else r!r}: "
                            f"bounds must be integers with 0 <= lo and hi <= {MAX_SAMPLE_ID} (int64)")
        out.append((int(lo), int(hi)))
    return out
