"""Whether the daemon is behind: the records it reads have waited longer than its quiet reads' do.

An iteration's oldest record waited the reader's clock minus its stream id's milliseconds (the
Redis server stamped them). That difference also holds any offset between the two hosts' clocks,
so it is judged against a floor that follows the smallest recent wait: the daemon is behind when
a record waited more than ``LAG_S`` beyond the floor. The floor drops at once to a smaller wait
and rises by ``RISE_S_PER_S`` a second, so a clock that steps, or a skew that grows, is followed
within seconds.

While it is behind, the daemon puts off the work that no verdict, directive or page waits for,
each by a bound:
- a run's routine state save (``RunWatcher._commit``: one due only because ``state_save_s``
  passed), by at most ``SAVE_DEFER_PERIODS`` save periods;
- a healthy run's side reads (``RunWatcher.side_reads_due``: its acks, approvals and heartbeat, and
  its clock rules), by at most ``SIDE_READ_DEFER_PERIODS`` of ``side_read_s``. A run in an incident
  reads them at every poll whatever this says.
In a minute when the machine's CPU dips, the records that queued meanwhile are then judged before
the bookkeeping, not behind it. Pure: the clock values come in as arguments.
"""

from __future__ import annotations

LAG_S = 0.020  # beyond the floor: behind (the verdict p99 target is 50 ms; a quiet read's oldest record waits ≲ 12 ms)
RISE_S_PER_S = 0.005
SAVE_DEFER_PERIODS = 2.0  # a routine save waits at most this many state-save periods past its due time
SIDE_READ_DEFER_PERIODS = 4.0  # a healthy run's side reads: at most this many side-read periods (2 s in `sentinel run`)


class Backlog:
    def __init__(self) -> None:
        self.floor: float | None = None  # seconds: the smallest recent wait (clock offset included)
        self._at = 0.0  # monotonic: when the floor was last moved
        self.behind = False

    def update(self, oldest_id_ms: int | None, now: float, mono: float) -> bool:
        """After a step read: ``oldest_id_ms`` the stream id's milliseconds of the oldest record it
        brought (None: it brought none, and nothing waits), ``now`` the wall clock, ``mono`` the
        monotonic one. Returns, and keeps in ``behind``, whether the daemon is behind."""
        if oldest_id_ms is None:
            self.behind = False
            return False
        wait = now - oldest_id_ms / 1000.0
        if self.floor is None or wait < self.floor:
            self.floor = wait
        else:
            self.floor = min(wait, self.floor + RISE_S_PER_S * max(0.0, mono - self._at))
        self._at = mono
        self.behind = wait - self.floor > LAG_S
        return self.behind
