"""The side reads of the runs a daemon iteration polls, in as few round trips as there can be.

Each ``RunWatcher.poll`` needs its run's checkpoints hash, new acks and approvals, heartbeat and
(until found) registered run dir, and about once a second ``check_overload`` its group's XINFO.
Asked one run after the other, the verdict on the last run's records waited for 5 x N round trips
(bench/daemon_scale.py: p99 1.3 s at 30 runs on a loaded 2-core machine, the daemon's CPU mostly
idle in ``recv``). Here they go in one pipeline for all the polled runs; each watcher takes its
answers from ``watcher.prefetched`` (``RunWatcher._read_trusting_type``) instead of asking Redis.

Two phases, around the judging of the iteration's records:
- ``prefetch_checkpoints``, before: every polled run's checkpoints hash. A checkpoint the trainer
  registered before a record is known when that record is judged (a NaN at step 5 rolls back to
  step 0's checkpoint). A busy daemon has them already: its step read brought the hashes of the
  runs with new records (``bus.read_group_with_hashes``), so no round trip is left between a
  record read and its verdict; the others (a run polled while idle, a read that blocked) are one
  script (``_SIDE_READS``).
- ``prefetch``, after: the acks and approvals of every run whose side reads are due (one XREAD
  each: XREAD takes many streams, and answers only for those with new entries), their heartbeats,
  the run-dir lookups and the XINFO of the overload checks. Only ``settle`` reads these. A
  healthy run's acks and approvals are read only where ``side_reads_due`` says so
  (``Options.side_read_s``): a healthy run in a fleet is polled for each step record it sends, and
  no ack or approval of it is awaited.

The hashes and heartbeats go in one script (``_SIDE_READS``: HGETALL or GET per key, each under
``redis.pcall``, so a key of another type answers its own error and the others their values); asked
as commands of their own, packing and parsing them was about a tenth of the daemon's CPU at 300
runs. When one of the acks or approvals streams holds another Redis type, the whole XREAD fails:
its runs are then read one by one (the run with the broken key is counted, the others read as
usual); so are the hashes and heartbeats if the script itself fails (a server that refuses EVAL).
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
"""  # KEYS: N (ARGV[1]) checkpoints hashes, then heartbeats; a missing key comes back as nil (an empty hash as [])
_STREAM_READS = (("acks", "acks_id", 1000), ("approvals", "approvals_id", 100))


_MISSING = object()


def prefetch_checkpoints(r, watchers, known: dict) -> None:
    """Before the records are judged: each watcher's checkpoints hash in ``watcher.prefetched``,
    taken from ``known`` (steps stream -> the hash, as ``bus.read_group_with_hashes`` gave it) or
    read in one script for the watchers it lacks (none: no round trip)."""
    rest = []
    for w in watchers:
        got = known.get(w.keys.steps, _MISSING)
        if got is _MISSING:
            w.prefetched = {}
            rest.append(w)
        else:
            w.prefetched = {"checkpoints": got}
    if rest:
        keys = [w.keys.checkpoints for w in rest]
        pipe = bus.raw(r).pipeline(transaction=False)
        pipe.eval(_SIDE_READS, len(keys), *keys, len(keys))
        with bus.bus_errors(r):
            reply = pipe.execute(raise_on_error=False)[0]
        _take_side(r, rest, [], reply)


def prefetch(r, watchers, now: float, behind: bool = False) -> None:
    """After the records are judged, before the runs are settled: read every watcher's other side
    keys in one pipeline (none due: no round trip); store the replies (or the per-command error,
    such as WRONGTYPE) in ``watcher.prefetched`` by the name ``_read_trusting_type`` uses (and, for
    a watcher whose overload check is due at ``now``, its XINFO replies). ``behind``: the daemon is
    (``daemon_backlog``), and a healthy run's side reads wait a little longer (``side_reads_due``)."""
    if not watchers:
        return
    pipe = bus.raw(r).pipeline(transaction=False)
    plan: list[tuple[Any, str]] = []
    for w in watchers:
        w.side_read = w.side_reads_due(now, behind)
    due = [w for w in watchers if w.side_read]
    if due:
        for what, pos, count in _STREAM_READS:
            pipe.xread({getattr(w.keys, what): getattr(w, pos) for w in due}, count=count)
            plan.append((None, what))
        # the heartbeat only where the clock rules run (``_react``): a healthy run's every few polls
        side = [w.keys.heartbeat for w in due]
        pipe.eval(_SIDE_READS, len(side), *side, 0)
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
    for w in watchers:
        w.prefetched = {}
    if not plan:
        return
    with bus.bus_errors(r):
        replies = pipe.execute(raise_on_error=False)
    retry = []
    for (w, what), reply in zip(plan, replies):
        if w is not None:
            w.prefetched[what] = reply
        elif what == "side":
            _take_side(r, [], due, reply)
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
    """The checkpoints (a dict, as HGETALL gives it) of each of ``watchers``, and the heartbeat of
    each one in ``due``, from the script's reply; a key of another type leaves its error in its
    place. A failed script: read one by one."""
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
