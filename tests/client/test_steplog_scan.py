"""``sentinel.client.steplog.scan`` and ``replay.branches(keep=...)``: the offline tools read a long run's
step log in one streamed pass and hold only the steps they need. On random logs with rollbacks,
resumes and guard skips they must give exactly what reading the whole log gave, for those steps."""

from __future__ import annotations

import random

from sentinel.client.steplog import read, scan
from sentinel.offline.replay import branches
from sentinel.protocol import authoritative_steps
from tests.helpers.steplog import random_log


def cases(tmp_path, seed: int, n: int = 300):
    """(rng, log path, lo, hi): ``n`` random logs, each with a random window of steps to keep."""
    rng = random.Random(seed)
    for i in range(n):
        p = tmp_path / f"log{seed}-{i}.jsonl"
        random_log(rng, p)
        lo = rng.randint(0, 200)
        yield rng, p, lo, lo + rng.randint(0, 100)


def test_scan_gives_what_the_whole_log_gives_for_the_kept_steps(tmp_path):
    for rng, p, lo, hi in cases(tmp_path, 11):
        full = authoritative_steps(read(p))
        upto = rng.randint(0, 250)
        got = scan(p, keep=lambda s: lo <= s <= hi, applied_upto=upto)
        assert got.records == {s: r for s, r in full.items() if lo <= s <= hi}
        assert (got.first, got.last) == ((min(full), max(full)) if full else (None, None))
        want = sum(1 for s in range(1, upto + 1) if not full[s].skipped) if all(s in full for s in range(1, upto + 1)) else None
        assert got.applied() == want
        if full:
            assert got.last_record.step >= max(full)


def test_branches_keep_only_holds_fewer_records_never_other_ones(tmp_path):
    for _rng, p, lo, hi in cases(tmp_path, 12):
        whole = branches(read(p))
        part = branches(read(p), keep=lambda s: lo <= s <= hi)
        assert list(part) == list(whole)
        for t, b in whole.items():
            q = part[t]
            assert (q.kind, q.parent, q.from_step) == (b.kind, b.parent, b.from_step)
            assert q.records == {s: r for s, r in b.records.items() if lo <= s <= hi}
            assert (q.first, q.last) == ((min(b.records), max(b.records)) if b.records else (None, None)), (t, b.records.keys())
