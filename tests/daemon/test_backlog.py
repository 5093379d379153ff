"""While the records it reads have waited long, the daemon puts off its routine state saves and a
healthy run's side reads (each by a bounded time), never a verdict, a directive or a save a
decision needs.

``Backlog`` is pure (a table of reads: the oldest record's stream-id milliseconds, the wall clock,
the monotonic one); the daemon's use of it runs against the real Redis servers.
"""

from __future__ import annotations

import json
import time

import pytest

from sentinel import bus
from sentinel.daemon_backlog import LAG_S, RISE_S_PER_S, SAVE_DEFER_PERIODS, SIDE_READ_DEFER_PERIODS, Backlog
from sentinel.protocol import STEP_CONSUMER_GROUP, Ack, Keys
from tests.helpers.daemon import SECRET, leading, publish_steps, pump, sample

pytestmark = pytest.mark.timeout(60)

T0 = 1_800_000_000.0  # wall clock (s)


@pytest.mark.parametrize("case,reads,want", [
    # (the oldest record's wait in ms as the reader's clock sees it, the monotonic clock in s), ...
    ("quiet reads are never behind", [(2, 0.0), (11, 0.1), (6, 0.2), (14, 0.3)], [False] * 4),
    ("a read whose records waited 20 ms more than the floor is behind",
     [(2, 0.0), (5, 0.1), (30, 0.2), (60, 0.3), (8, 0.4)], [False, False, True, True, False]),
    ("a reader whose clock runs 3 s ahead of the server's is not behind for it",
     [(3002, 0.0), (3010, 0.1), (3004, 0.2)], [False, False, False]),
    ("a reader 3 s behind the server (negative waits) is judged the same",
     [(-2998, 0.0), (-2990, 0.1), (-2960, 0.2)], [False, False, True]),
    ("a read that brought nothing: nothing waits", [(2, 0.0), (None, 0.1), (40, 0.2)], [False, False, True]),
    # the clock stepped 200 ms: behind at first, then the floor follows at RISE_S_PER_S
    ("a clock that steps is followed within seconds",
     [(2, 0.0), (202, 1.0), (202, 20.0), (202, 41.0), (205, 41.1)], [False, True, True, False, False]),
])
def test_the_daemon_is_behind_when_a_read_waited_beyond_its_floor(case, reads, want):
    b, got = Backlog(), []
    for wait_ms, mono in reads:
        now = T0 + mono
        got.append(b.update(None if wait_ms is None else round((now - wait_ms / 1000.0) * 1000), now, mono))
        assert b.behind == got[-1]
    assert got == want, case
    assert 0 < LAG_S < 0.05 and RISE_S_PER_S > 0  # below the 50 ms p99 target; a floor that can rise


def test_routine_saves_and_side_reads_wait_while_the_daemon_is_behind_and_no_longer_than_their_bounds(redis_url, unique_run):
    """Records that waited 300 ms in the stream: the save that was due is put off (their entries stay
    pending, which a successor judges again), for at most ``SAVE_DEFER_PERIODS`` save periods past
    its due time; so are a healthy run's side reads (an operator's ack is read later), for at most
    ``SIDE_READ_DEFER_PERIODS``; the verdicts are not."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d, w = leading(r, run, state_save_s=1.0, side_read_s=1.0)
    publish_steps(r, run, range(1, 6))
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 5)  # read at once: the floor is low
    w._next_save = 0.0  # every save since is due
    pump(d, until=lambda: r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0)
    assert not d.backlog.behind
    acks_before = w.acks_id
    bus.publish(r, k.acks, Ack(run=run, directive_id="op-1", kind="pause", status="applied", step=5, timeline=0), secret=SECRET)

    def read_late(steps, overdue: float) -> None:
        publish_steps(r, run, steps)
        w._next_save = time.monotonic() - overdue
        w._next_side_read = time.time() - overdue
        time.sleep(0.3)
        d.iterate(block_ms=20)
        assert d.backlog.behind and sample(d, "sentinel_steps_processed_total", run=run) == steps[-1]  # judged all the same

    read_late(range(6, 11), overdue=0.01)  # both due just now: put off
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 5  # not covered by a save yet
    assert json.loads(r.get(k.policy))["policy"]["last_step"] == 5
    assert w.acks_id == acks_before
    read_late(range(11, 13), overdue=max(SAVE_DEFER_PERIODS, SIDE_READ_DEFER_PERIODS) * 1.0 + 0.01)  # past both bounds
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0
    assert json.loads(r.get(k.policy))["policy"]["last_step"] == 12
    assert w.acks_id != acks_before
