"""One round trip per daemon iteration for the side reads of the runs it polls.

Each ``RunWatcher.poll`` needs its run's checkpoints hash, new acks and approvals, heartbeat and
(until found) registered run dir, and about once a second ``check_overload`` its group's XINFO.
Asked one run after the other, the verdict on the last run's records waited for 5 x N round trips
(bench/daemon_scale.py: p99 1.3 s at 30 runs on a loaded 2-core machine, the daemon's CPU mostly
idle in ``recv``). Here they go in one pipeline for all the polled runs, after the iteration's
step read and before any record is judged; each watcher takes its answers from
``watcher.prefetched`` (``RunWatcher._read_trusting_type``) instead of asking Redis.

The acks and approvals of every polled run are one XREAD each (XREAD takes many streams, and
answers only for those with new entries): per run and poll, what is left is an HGETALL and a GET,
which is what a fleet of 300 runs at 10 steps/s pays for most after the rules themselves. When
one of those streams holds another Redis type, the whole XREAD fails: its runs are then read one
by one (the run with the broken key is counted, the others read as usual).
"""

from __future__ import annotations

from typing import Any

from sentinel import bus, bus_streams

RUN_DIR_LOOKUP_S = 2.0  # a run whose trainer registered no (local) run dir: looked up again this often
_STREAM_READS = (("acks", "acks_id", 1000), ("approvals", "approvals_id", 100))


def prefetch(r, watchers, now: float) -> None:
    """Read every watcher's side keys in one pipeline; store the replies (or the per-command
    error, such as WRONGTYPE) in ``watcher.prefetched`` by the name ``_read_trusting_type`` uses
    (and, for a watcher whose overload check is due at ``now``, its XINFO replies)."""
    if not watchers:
        return
    pipe = bus.raw(r).pipeline(transaction=False)
    plan: list[tuple[Any, str]] = []
    for what, pos, count in _STREAM_READS:
        pipe.xread({getattr(w.keys, what): getattr(w, pos) for w in watchers}, count=count)
        plan.append((None, what))
    for w in watchers:
        k = w.keys
        pipe.hgetall(k.checkpoints)
        pipe.get(k.heartbeat)
        plan += [(w, "checkpoints"), (w, "heartbeat")]
        if now >= w._next_overload_check or w.behind:  # RunWatcher.check_overload: about once a second
            if w._entries_read is None:  # the stream's counters matter at the first check only
                pipe.xinfo_stream(k.steps)
                plan.append((w, "xinfo_stream"))
            pipe.xinfo_groups(k.steps)
            plan.append((w, "xinfo_groups"))
        if w._run_dir is None and w.run not in w.opts.run_dirs and now >= w._next_run_dir_lookup:
            w._next_run_dir_lookup = now + RUN_DIR_LOOKUP_S
            pipe.hget(k.info, "run_dir")
            plan.append((w, "info"))
    with bus.bus_errors(r):
        replies = pipe.execute(raise_on_error=False)
    for w in watchers:
        w.prefetched = {}
    retry = []
    for (w, what), reply in zip(plan, replies):
        if w is not None:
            w.prefetched[what] = reply
        elif isinstance(reply, Exception):  # a stream of another type among them: read them one by one
            retry.append(what)
        else:
            by_stream: dict[str, list] = {}
            for e in bus_streams.entries(reply):
                by_stream.setdefault(e.stream, []).append(e)
            for x in watchers:
                x.prefetched[what] = by_stream.get(getattr(x.keys, what), [])
    if retry:
        _one_by_one(r, watchers, retry)


def _one_by_one(r, watchers, kinds: list[str]) -> None:
    pipe = bus.raw(r).pipeline(transaction=False)
    plan = []
    for what, pos, count in _STREAM_READS:
        if what in kinds:
            for w in watchers:
                pipe.xread({getattr(w.keys, what): getattr(w, pos)}, count=count)
                plan.append((w, what))
    with bus.bus_errors(r):
        replies = pipe.execute(raise_on_error=False)
    for (w, what), reply in zip(plan, replies):
        w.prefetched[what] = reply if isinstance(reply, Exception) else bus_streams.entries(reply)
