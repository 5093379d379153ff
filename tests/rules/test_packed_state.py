"""A detector's numeric history packs into one string and back, bit for bit; older list states
still load; a malformed packed string is a ``ValueError`` (the daemon then starts the run afresh).
"""

from __future__ import annotations

import base64
import json
import math
import struct

import pytest

from sentinel.detectors.packed import pack, unpack

NAN, INF = float("nan"), float("inf")


def _same(a, b) -> bool:
    """Equal, with NaN equal to NaN and -0.0 told from 0.0 (the bits, not the values)."""
    def key(v):
        return struct.pack("<d", v) if isinstance(v, float) else v
    return [tuple(map(key, r)) if isinstance(r, tuple) else key(r) for r in a] == \
           [tuple(map(key, r)) if isinstance(r, tuple) else key(r) for r in b]


@pytest.mark.parametrize("rows,kinds", [
    ([(1, 3.25), (2, -0.0), (3, NAN), (4, INF), (5, -INF), (6, 5e-324), (7, 1.7976931348623157e308)], "if"),
    ([(-(2**63), 0.1), (2**63 - 1, 1 / 3)], "if"),
    ([(10, 0.5, None), (12, 0.25, 1.5), (14, NAN, None)], "ifn"),
    ([(10, 0.5, 2.0), (12, NAN, -0.0), (14, INF, 5e-324)], "ifn"),  # no None: the fast path
    ([0.1, 0.2, 1e-300, NAN], "f"),
    ([], "if"),
    ([], "f"),
    ([(1, 2.0, 3.0)] * 1000, "iff"),
])
def test_packed_rows_come_back_bit_for_bit(rows, kinds):
    text = pack(rows, kinds)
    assert isinstance(text, str) and text.startswith(f"pk1:{len(rows)}:{kinds}:")
    back = unpack(json.loads(json.dumps(text)), kinds)
    assert _same(back, rows) and len(back) == len(rows)


def test_a_value_no_column_holds_leaves_json_lists_that_load_alike():
    rows = [(2**70, 1.0), (3, 2.0)]  # an int beyond int64: the save must not fail
    saved = pack(rows, "if")
    assert saved == [[2**70, 1.0], [3, 2.0]]
    assert unpack(saved, "if") == rows
    assert pack([(1, None)], "if") == [[1, None]]  # None where a float must be: left as it was


@pytest.mark.parametrize("old,kinds,want", [
    ([[1, 2.5], [2, 3]], "if", [(1, 2.5), (2, 3.0)]),
    ([[1, 2.5, None], [2, 3, 4]], "ifn", [(1, 2.5, None), (2, 3.0, 4.0)]),
    ([1, 2.5], "f", [1.0, 2.5]),
])
def test_a_state_saved_as_json_lists_still_loads(old, kinds, want):
    assert unpack(old, kinds) == want


GOOD = pack([(1, 2.0), (2, 3.0)], "if")
_B64 = GOOD.split(":", 3)[3]


@pytest.mark.parametrize("bad", [
    None, 7, {"rows": 2}, "",
    "pk1", "pk1:2:if", "pk2:2:if:" + _B64,  # not the header
    "pk1:2:fi:" + _B64,  # other kinds than the reader's
    "pk1:-2:if:" + _B64, "pk1:x:if:" + _B64, "pk1:3:if:" + _B64, "pk1:1:if:" + _B64,  # a count the bytes do not hold
    "pk1:2:if:" + _B64[:-4],  # truncated
    "pk1:2:if:" + _B64[:-2] + "!!",  # not base64
    "pk1:1:ifn:" + base64.b64encode(b"\0" * 16 + b"\x02").decode(),  # a presence byte neither 0 nor 1
    [[1]], [["x", 2.0]], [5],  # older list rows that are no rows
])
def test_malformed_packed_rows_are_a_value_error(bad):
    with pytest.raises(ValueError):
        unpack(bad, "if" if not (isinstance(bad, str) and ":ifn:" in bad) else "ifn")


def test_a_mature_runs_state_is_packed_and_restores_to_the_same_verdicts():
    """Every numeric window of a policy past its detectors' warm-up is packed (no list of numbers
    over a few dozen left in the JSON), and a restored policy judges the next steps as before."""
    from sentinel.policy import RunPolicy
    from sentinel.protocol import StepRecord
    from sentinel.rules import default_rules

    def rec(step):
        x = 3.0 + 2.0 * math.exp(-step / 300) + 0.02 * math.sin(step * 1.7)
        return StepRecord(run="r", step=step, timeline=0, loss=x, loss_max_rank=x, grad_norm=1.0 + 0.01 * (step % 7), lr=1e-3,
                          tokens=step, batch_fingerprint=f"f{step}", time=1000.0 + step, sample_ids=[step], skipped=False)

    p = RunPolicy("r", default_rules(), clock=lambda: 5000.0)
    for s in range(1, 1200):
        p.on_step(rec(s))
    st = p.state_dict()
    longest = []

    def walk(o):
        if isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, list):
            if all(isinstance(v, (int, float)) or (isinstance(v, list) and all(isinstance(u, (int, float)) for u in v)) for v in o):
                longest.append(len(o))
            for v in o:
                walk(v)
    walk(st["engine"])
    assert max(longest, default=0) <= 40, longest
    q = RunPolicy("r", default_rules(), clock=lambda: 5000.0)
    q.load_state_dict(json.loads(json.dumps(st)))
    assert q.state_dict() == st
    for s in range(1200, 1300):
        r = rec(s)
        assert [a.kind for a in p.on_step(r)] == [a.kind for a in q.on_step(r)]
        assert [(f.rule, f.detail) for f in p.last_findings] == [(f.rule, f.detail) for f in q.last_findings]
