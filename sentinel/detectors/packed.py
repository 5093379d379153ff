"""A detector's numeric history in a saved state: rows of numbers as one string, bit-exact.

A daemon saves every run's detector state every few seconds. As JSON lists of ``[step, value]``
pairs a mature run's state is about 70 KB, and ``json.dumps`` spends ~1.7 ms on its floats (their
shortest repr, one by one): at 300 runs that was a third of a core. Packed, each column is the
raw little-endian bytes of an ``array`` (int64 or float64), base64-encoded after a header:

    "pk1:<rows>:<kinds>:<base64>"

``kinds`` has one letter a column: ``i`` an int (int64), ``f`` a float (float64, NaN and the
infinities as they are), ``n`` a float or None (float64 plus a presence byte). Restoring gives back
the same bits a JSON round trip gave, faster. ``unpack`` reads the older list form too (states saved
before), and raises ``ValueError`` on anything else: a wrong header, a count or length that does not
add up, or bytes that are not base64 (the saved state is read from the bus, a trust boundary).
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

_PREFIX = "pk1"
_CODES = {"i": "q", "f": "d", "n": "d"}
_WIDTH = {"i": 8, "f": 8, "n": 9}  # n: the float and its presence byte
_BIG = sys.byteorder == "big"


def pack(rows: Iterable[Sequence[Any]] | Iterable[Any], kinds: str) -> str | list:
    """``rows`` (tuples with one item per letter of ``kinds``; plain numbers when ``kinds`` has one
    letter) as one string. A value no column can hold (an int beyond int64) leaves the rows as JSON
    lists, which ``unpack`` reads too: a save never fails on a number."""
    rows = list(rows)
    n = len(rows)
    try:
        cols = [rows] if len(kinds) == 1 else (list(zip(*rows)) if rows else [() for _ in kinds])
        if len(cols) != len(kinds):
            raise TypeError("rows do not match kinds")
        parts = []
        for kind, col in zip(kinds, cols):
            if kind != "n":
                parts.append(_bytes(array(_CODES[kind], col)))
            elif None in col:  # (a C scan: a column with no None, the usual, skips both Python loops)
                parts.append(_bytes(array("d", [0.0 if v is None else v for v in col])))
                parts.append(bytes([v is not None for v in col]))
            else:
                parts.append(_bytes(array("d", col)))
                parts.append(b"\x01" * n)
    except (OverflowError, TypeError):
        return [list(r) for r in rows] if len(kinds) > 1 else list(rows)
    return f"{_PREFIX}:{n}:{kinds}:{binascii.b2a_base64(b''.join(parts), newline=False).decode('ascii')}"


def unpack(obj: Any, kinds: str) -> list:
    """The rows ``pack`` packed (tuples, or plain numbers when ``kinds`` has one letter); a JSON
    list (the older form) is converted item by item. Raises ``ValueError`` on anything malformed."""
    if isinstance(obj, list):
        return [_row(r, kinds) for r in obj]
    if not isinstance(obj, str):
        raise ValueError(f"packed rows: a string or a list, not {type(obj).__name__}")
    head = obj.split(":", 3)
    if len(head) != 4 or head[0] != _PREFIX or head[2] != kinds or not head[1].isdigit():
        raise ValueError(f"packed rows: not a {_PREFIX} string of kinds {kinds!r}")
    n = int(head[1])
    try:
        raw = base64.b64decode(head[3], validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"packed rows: {e}") from None
    if len(raw) != n * sum(_WIDTH[k] for k in kinds):
        raise ValueError(f"packed rows: {len(raw)} bytes for {n} rows of {kinds!r}")
    cols, at = [], 0
    for kind in kinds:
        col = array(_CODES[kind])
        col.frombytes(raw[at:at + 8 * n])
        if _BIG:
            col.byteswap()
        at += 8 * n
        if kind == "n":
            present = raw[at:at + n]
            at += n
            if present.strip(b"\x00\x01"):
                raise ValueError("packed rows: a presence byte that is neither 0 nor 1")
            cols.append([v if p else None for v, p in zip(col.tolist(), present)])
        else:
            cols.append(col.tolist())
    return cols[0] if len(kinds) == 1 else list(zip(*cols))


def _bytes(a: array) -> bytes:
    if _BIG:
        a.byteswap()
    return a.tobytes()


def _row(r: Any, kinds: str) -> Any:
    if len(kinds) == 1:
        return _one(r, kinds)
    if not isinstance(r, (list, tuple)) or len(r) < len(kinds):
        raise ValueError(f"a saved row of {kinds!r}: {str(r)[:40]}")
    return tuple(_one(v, k) for v, k in zip(r, kinds))


def _one(v: Any, kind: str) -> Any:
    if kind == "i":
        return int(v)
    if kind == "n" and v is None:
        return None
    return float(v)
