"""One round trip per daemon iteration for the side reads every watched run needs.

Each ``RunWatcher.poll`` reads its run's checkpoints hash, acks and approvals streams, heartbeat
and (until found) registered run dir, and once a second ``check_overload`` its stream's XINFO
STREAM and GROUPS: five to seven sequential round trips per run per iteration. With N
runs the verdict on the last run's records waited for 5 x N round trips (bench/daemon_scale.py:
p99 1.3 s at 30 runs on a loaded 2-core machine, the daemon CPU mostly idle in ``recv``). Here
they go in one pipeline for all the led runs, before the step entries are judged; each watcher
takes its answers from ``watcher.prefetched`` (``RunWatcher._read_trusting_type``) instead of
asking Redis. The answers are a snapshot from the start of the iteration, as the sequential reads
were a snapshot from a few milliseconds later: whatever arrives after it is read next iteration.
"""

from __future__ import annotations

from typing import Any

from sentinel import bus, bus_streams


def prefetch(r, watchers, now: float) -> None:
    """Read every watcher's side keys in one pipeline; store the replies (or the per-command
    error, such as WRONGTYPE) in ``watcher.prefetched`` by the name ``_read_trusting_type`` uses
    (and, for a watcher whose overload check is due at ``now``, its two XINFO replies)."""
    if not watchers:
        return
    pipe = bus.raw(r).pipeline(transaction=False)
    plan: list[tuple[Any, str]] = []
    for w in watchers:
        k = w.keys
        pipe.hgetall(k.checkpoints)
        pipe.xread({k.acks: w.acks_id}, count=1000)
        pipe.xread({k.approvals: w.approvals_id}, count=100)
        pipe.get(k.heartbeat)
        plan += [(w, "checkpoints"), (w, "acks"), (w, "approvals"), (w, "heartbeat")]
        if now >= w._next_overload_check or w.behind:  # RunWatcher.check_overload: once a second
            pipe.xinfo_stream(k.steps)
            pipe.xinfo_groups(k.steps)
            plan += [(w, "xinfo_stream"), (w, "xinfo_groups")]
        if w._run_dir is None and w.run not in w.opts.run_dirs:
            pipe.hget(k.info, "run_dir")
            plan.append((w, "info"))
    with bus.bus_errors(r):
        replies = pipe.execute(raise_on_error=False)
    for w in watchers:
        w.prefetched = {}
    for (w, what), reply in zip(plan, replies):
        if what in ("acks", "approvals") and not isinstance(reply, Exception):
            reply = bus_streams.entries(reply)
        w.prefetched[what] = reply
