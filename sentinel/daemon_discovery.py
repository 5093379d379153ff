"""Which runs a daemon with no run named watches: the live ones of the bus's registry, up to
``--max-runs``; and which it stops watching (ended, or junk).

The registry is a set anyone with bus access can SADD to: a name costs a watcher (a consumer
group, a lease, metric series) only once its steps stream holds a record the trainer signed.
"""

from __future__ import annotations

import time

import redis

from sentinel import bus
from sentinel.daemon_options import DISCOVER_PER_PASS, LIVE_PROBE, _id_seconds
from sentinel.ingest import is_authentic
from sentinel.protocol import Keys
from sentinel.shards import in_shard


class DiscoveryMixin:
    def _discover(self) -> None:
        if self.fixed_runs is not None:
            for run in self.fixed_runs:
                if run not in self.watchers:
                    self.watchers[run] = self._new_watcher(run)
                    self.log(f"watching run {run}")
            return
        self._retire_idle()
        now = time.monotonic()
        new = [run for run in bus.list_runs(self.r) if run not in self.watchers and self._not_before.get(run, (0.0,))[0] <= now
               and in_shard(run, self.opts.shard)]
        unwatched = 0
        for run in self._live_runs(new[:DISCOVER_PER_PASS]):
            if len(self.watchers) >= self.opts.max_runs:
                unwatched += 1
                self._later(run)
                continue
            self.watchers[run] = self._new_watcher(run)
            self.log(f"watching run {run}")
        self.m.runs_unwatched.set(unwatched)
        if unwatched and now >= self._cap_logged:
            self._cap_logged = now + 60.0
            self.log(f"{unwatched} more live runs on the bus than --max-runs {self.opts.max_runs}: not watched "
                     "(start another sentinel, or raise --max-runs)")

    def _live_runs(self, names: list[str]) -> list[str]:
        """The registered names whose steps stream holds a record the trainer signed in the last
        ``opts.idle_s``. The registry is a set anyone with bus access can SADD to: a junk name
        must not cost a watcher, a consumer group, a lease and metric series. The rest are looked
        at again in a minute."""
        if not names:
            return []
        pipe = bus.raw(self.r).pipeline(transaction=False)
        for run in names:
            pipe.xrevrange(Keys(run).steps, count=LIVE_PROBE)
            pipe.exists(Keys(run).heartbeat)
        res = pipe.execute(raise_on_error=False)
        out, now = [], time.time()
        for run, entries, beating in zip(names, res[::2], res[1::2]):
            if isinstance(entries, redis.ResponseError) and "WRONGTYPE" in str(entries):
                entries = []
            elif isinstance(entries, Exception):
                raise entries
            signed = [bus.to_entry(Keys(run).steps, eid, f) for eid, f in entries]
            signed = [e for e in signed if is_authentic(e, self.opts.secret)]
            # a paused run publishes no step, but its heartbeat goes on
            if signed and (beating is True or beating == 1 or now - _id_seconds(signed[0].id) <= self.opts.idle_s):
                out.append(run)
            else:
                self._later(run)
        if len(self._not_before) > 100_000:  # names come and go; a flood of them must not grow this
            self._not_before.clear()
        return out

    def _later(self, run: str) -> None:
        wait = min(60.0, 2.0 * self._not_before.get(run, (0.0, 1.0))[1])
        self._not_before[run] = (time.monotonic() + wait, wait)

    def _retire_idle(self) -> None:
        """Stop watching a run with no step record for ``opts.idle_s`` and no heartbeat (it ended,
        or its name was junk): its state is saved and its lease released; a record brings it back."""
        now = time.time()
        for run, w in list(self.watchers.items()):
            if now - w.last_read <= self.opts.idle_s or w._heartbeat_time() is not None:
                continue
            w.release()
            del self.watchers[run]
            self._not_before[run] = (time.monotonic() + 60.0, 60.0)
            self.log(f"run {run}: no step record for {self.opts.idle_s / 3600:.0f} h and no heartbeat: no longer watched")

