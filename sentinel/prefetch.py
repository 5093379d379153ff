"""One round trip per daemon iteration for the side reads of the runs it polls.

Each ``RunWatcher.poll`` needs its run's checkpoints hash, new acks and approvals, heartbeat and
(until found) registered run dir, and about once a second ``check_overload`` its group's XINFO.
Asked one run after the other, the verdict on the last run's records waited for 5 x N round trips
(bench/daemon_scale.py: p99 1.3 s at 30 runs on a loaded 2-core machine, the daemon's CPU mostly
idle in ``recv``). Here they go in one pipeline for all the polled runs, after the iteration's
step read and before any record is judged; each watcher takes its answers from
``watcher.prefetched`` (``RunWatcher._read_trusting_type``) instead of asking Redis.

The acks and approvals of every polled run are one XREAD each (XREAD takes many streams, and
answers only for those with new entries), and every polled run's checkpoints hash and heartbeat
one script (``_SIDE_READS``: an HGETALL a run, and a GET of the heartbeat of each run whose side reads
are due, each under ``redis.pcall``, so a key of another type answers its own error and the others
their values). Asked as two commands a run,
packing and parsing them was about a tenth of the daemon's CPU at 300 runs. When one of the
streams holds another Redis type, the whole XREAD fails: its runs are then read one by one (the
run with the broken key is counted, the others read as usual); so are the hashes and heartbeats
if the script itself fails (a server that refuses EVAL).

Every polled run's checkpoints hash is read at every poll, with its step records: a checkpoint the
trainer registered before a record is known when that record is judged (a NaN at step 5 rolls back
to step 0's checkpoint). Its acks and approvals are read only where ``side_reads_due`` says so
(``Options.side_read_s``): a healthy run in a fleet is polled for each step record it sends, and
no ack or approval of it is awaited.
"""

from __future__ import annotations

from typing import Any

from sentinel import bus, bus_streams

RUN_DIR_LOOKUP_S = 2.0  # a run whose trainer registered no (local) run dir: looked up again this often
_SIDE_READS = """
local out, n = {}, tonumber(ARGV[1])
for i = 1, #KEYS do
  if i <= n then out[i] = redis.pcall('HGETALL', KEYS[i]) else out[i] = redis.pcall('GET', KEYS[i]) end
end
return out
"""  # KEYS: the N (ARGV[1]) runs' checkpoints hashes, then the heartbeats asked for; a missing one comes back as nil
_STREAM_READS = (("acks", "acks_id", 1000), ("approvals", "approvals_id", 100))


def prefetch(r, watchers, now: float) -> None:
    """Read every watcher's side keys in one pipeline; store the replies (or the per-command
    error, such as WRONGTYPE) in ``watcher.prefetched`` by the name ``_read_trusting_type`` uses
    (and, for a watcher whose overload check is due at ``now``, its XINFO replies)."""
    if not watchers:
        return
    pipe = bus.raw(r).pipeline(transaction=False)
    plan: list[tuple[Any, str]] = []
    for w in watchers:
        w.side_read = w.side_reads_due(now)
    due = [w for w in watchers if w.side_read]
    if due:
        for what, pos, count in _STREAM_READS:
            pipe.xread({getattr(w.keys, what): getattr(w, pos) for w in due}, count=count)
            plan.append((None, what))
    # the heartbeat only where the clock rules run (``_react``): a healthy run's every few polls
    side = [w.keys.checkpoints for w in watchers] + [w.keys.heartbeat for w in due]
    pipe.eval(_SIDE_READS, len(side), *side, len(watchers))
    plan.append((None, "side"))
    for w in watchers:
        k = w.keys
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
        elif what == "side":
            _take_side(r, watchers, due, reply)
        elif isinstance(reply, Exception):  # a stream of another type among them: read them one by one
            retry.append(what)
        else:
            by_stream: dict[str, list] = {}
            for e in bus_streams.entries(reply):
                by_stream.setdefault(e.stream, []).append(e)
            for x in due:
                x.prefetched[what] = by_stream.get(getattr(x.keys, what), [])
    if retry:
        _one_by_one(r, due, retry)


def _take_side(r, watchers, due, reply) -> None:
    """Each watcher's checkpoints (a dict, as HGETALL gives it), and the heartbeat of each one in
    ``due``, from the script's reply; a key of another type leaves its error in its place. A failed
    script: read one by one."""
    n = len(watchers)
    if isinstance(reply, Exception) or not isinstance(reply, list) or len(reply) != n + len(due):
        pipe = bus.raw(r).pipeline(transaction=False)
        for w in watchers:
            pipe.hgetall(w.keys.checkpoints)
        for w in due:
            pipe.get(w.keys.heartbeat)
        with bus.bus_errors(r):
            reply = pipe.execute(raise_on_error=False)
        for w, ck in zip(watchers, reply):
            w.prefetched["checkpoints"] = ck
    else:
        for w, ck in zip(watchers, reply):
            w.prefetched["checkpoints"] = dict(zip(ck[::2], ck[1::2])) if isinstance(ck, list) else ck
    for w, hb in zip(due, reply[n:]):
        w.prefetched["heartbeat"] = hb


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
