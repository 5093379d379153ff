"""Sample-id ranges: the one module for ``[lo, hi)`` arithmetic, parsing and validation.

Every skip list, skip directive, rollback plan and incident carries sample ids as half-open
``[lo, hi)`` ranges of int64 ids (``MAX_SAMPLE_ID``). The normal form is merged: sorted, disjoint,
non-adjacent, no empties (``merge_ranges``).
"""

from __future__ import annotations

import hashlib
import re
import struct
from typing import Any

from sentinel.contract.limits import MAX_SAMPLE_ID

__all__ = ["MAX_SAMPLE_ID", "count", "fmt_ranges", "id_list", "ids_to_ranges", "intersect_ranges", "merge_ranges", "parse_range",
           "skip_ranges_error", "subtract_ranges", "valid_ranges"]


def merge_ranges(ranges) -> list[tuple[int, int]]:
    """Normalise [lo, hi) ranges: drop empties, sort, merge overlapping/adjacent ones."""
    rs = sorted((int(lo), int(hi)) for lo, hi in ranges if int(hi) > int(lo))
    out: list[tuple[int, int]] = []
    for lo, hi in rs:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def subtract_ranges(ranges, remove) -> list[tuple[int, int]]:
    """``ranges`` less the ids of ``remove``, merged ([lo, hi) ranges)."""
    out: list[tuple[int, int]] = []
    rem = merge_ranges(remove)
    for lo, hi in merge_ranges(ranges):
        pieces = [(lo, hi)]
        for rlo, rhi in rem:
            nxt = []
            for a, b in pieces:
                if rhi <= a or rlo >= b:
                    nxt.append((a, b))
                    continue
                if a < rlo:
                    nxt.append((a, rlo))
                if rhi < b:
                    nxt.append((rhi, b))
            pieces = nxt
        out.extend(pieces)
    return merge_ranges(out)


def intersect_ranges(a, b) -> list[tuple[int, int]]:
    """The ids in both ``a`` and ``b``, merged."""
    out = []
    for lo, hi in merge_ranges(a):
        for blo, bhi in merge_ranges(b):
            x, y = max(lo, blo), min(hi, bhi)
            if x < y:
                out.append((x, y))
    return merge_ranges(out)


def ids_to_ranges(ids) -> list[tuple[int, int]]:
    """Compress sample ids into merged [lo, hi) ranges."""
    return merge_ranges((i, i + 1) for i in ids)


def count(ranges) -> int:
    """How many ids the (disjoint) ranges cover."""
    return sum(int(hi) - int(lo) for lo, hi in ranges)


def fmt_ranges(ranges, limit: int = 6) -> str:
    """``lo:hi, lo:hi, ... (+N)`` for a table cell or a log line; ``-`` for none."""
    rs = [f"{lo}:{hi}" for lo, hi in ranges]
    if len(rs) > limit:
        return ", ".join(rs[:limit]) + f", ... (+{len(rs) - limit})"
    return ", ".join(rs) or "-"


def parse_range(text: str) -> tuple[int, int]:
    """``LO:HI`` (half-open) or a single id ``N`` (= ``N:N+1``); ``ValueError`` (one line) otherwise."""
    t = text.strip()
    try:
        if ":" in t:
            a, b = t.split(":", 1)
            lo, hi = int(a), int(b)
        else:
            lo = int(t)
            hi = lo + 1
    except ValueError:
        dash = re.fullmatch(r"(\d+)-(\d+)", t)
        if dash:  # the inclusive form --inject-fault used to take: say what it would mean here
            a, b = int(dash.group(1)), int(dash.group(2))
            raise ValueError(f"bad sample range {text!r}: ranges are half-open LO:HI (HI excluded); "
                             f"for ids {a}..{b} inclusive write {a}:{b + 1}") from None
        raise ValueError(f"bad sample range {text!r}: expected LO:HI (sample ids, HI exclusive) or one id") from None
    if lo < 0 or hi <= lo:
        raise ValueError(f"bad sample range {text!r}: need 0 <= LO < HI")
    if hi > MAX_SAMPLE_ID:
        raise ValueError(f"bad sample range {text!r}: sample ids are int64 (HI at most {MAX_SAMPLE_ID})")
    return lo, hi


def skip_ranges_error(raw: Any) -> str | None:
    """None when ``raw`` (a parsed ranges file) is ``[[lo, hi], ...]`` with 0 <= lo < hi <= MAX_SAMPLE_ID."""
    if not isinstance(raw, list) or not all(isinstance(r, list) and len(r) == 2 for r in raw):
        return "expected [[lo, hi], ...]"
    if not all(type(x) is int for r in raw for x in r) or any(not 0 <= r[0] < r[1] <= MAX_SAMPLE_ID for r in raw):
        return f"ids must be integers with 0 <= lo < hi <= {MAX_SAMPLE_ID}"
    return None


def valid_ranges(raw: Any, limit: int = 100_000) -> list[tuple[int, int]]:
    """The well-formed ranges of a free-form value (a log line's or an action's ``ranges``): the
    ``[lo, hi]`` pairs of ints with 0 <= lo < hi <= MAX_SAMPLE_ID, in order, at most ``limit`` read;
    anything else is dropped, never raised (a view shows what it can)."""
    if not isinstance(raw, (list, tuple)):
        return []
    return [(lo, hi) for r in raw[:limit] if isinstance(r, (list, tuple)) and len(r) == 2
            for lo, hi in [r] if type(lo) is int and type(hi) is int and 0 <= lo < hi <= MAX_SAMPLE_ID]


def id_list(chunks) -> list[int]:
    """Sample ids as one list of ints, from chunks that are each a sequence of ints or anything with ``tolist()``
    (a tensor, an array): the step's ids are kept as they came and read once, when the step record is built."""
    return [int(i) for c in chunks for i in (c.tolist() if hasattr(c, "tolist") else c)]


def batch_fingerprint(ids) -> str:
    """16 hex chars of sha256 over the sample ids as little-endian int64: names a batch in step records
    (the same for our trainer and any loop through ``sentinel.client``)."""
    ids = [int(i) for i in ids]
    return hashlib.sha256(struct.pack(f"<{len(ids)}q", *ids)).hexdigest()[:16]
