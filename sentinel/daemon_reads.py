"""What a run watcher reads besides step records: checkpoints, acks, approvals, the heartbeat, the
group's read position; and how it reads and writes keys anyone with bus access could have broken
(another Redis type, an entry stamped a day ahead): counted and survived, never a stopped run.
"""

from __future__ import annotations

import json
import math
import random
import time

import redis

from sentinel import bus
from sentinel.ingest import Verdict, check_ack
from sentinel.protocol import (
    STEP_CONSUMER_GROUP,
    CheckpointInfo,
    Directive,
    SchemaError,
)


class ReadsMixin:
    def _read_trusting_type(self, what: str, read):
        """``read(raw client)``, or None when the key holds another Redis type (WRONGTYPE): anyone
        with bus access can write one, and retrying cannot fix it, so it must not stop the run's
        judging. Counted in sentinel_records_rejected_total{stream=what, reason="wrong_type"}."""
        try:
            if what in self.prefetched:  # read with every other run's, in one round trip (sentinel/prefetch.py)
                reply = self.prefetched.pop(what)
                if isinstance(reply, Exception):
                    raise reply
                return reply
            return read(bus.raw(self.r))
        except (redis.ResponseError, bus.BusError) as e:
            if "WRONGTYPE" not in str(e):
                raise
            self._rejected(what, Verdict(None, "wrong_type", f"the {what} key holds another Redis type; ignored"))
            return None

    def _write_own(self, what: str, key: str, write):
        """``write()`` to a key the sentinel writes (a hash, the events or directives stream); a key of another type there (WRONGTYPE) is
        replaced once, counted: otherwise every write fails and the run is never judged again. So
        is a stream that refuses every XADD because someone added an entry stamped far ahead."""
        try:
            return write()
        except (redis.ResponseError, bus.BusError) as e:
            if "WRONGTYPE" in str(e):
                self._rejected(what, Verdict(None, "wrong_type", f"the {what} key held another Redis type; replaced"))
                self.r.delete(key)
            elif bus.id_exhausted(e):
                n = bus.repair_stream_ids(self.r, key)
                self._rejected(what, Verdict(None, "future_id", f"the {what} stream refused new entries: removed {max(n, 0)} "
                                             "entries stamped more than a day ahead"))
            else:
                raise
            return write()

    def _future_entry(self, what: str, key: str, e: bus.Entry) -> bool:
        """True for an entry whose id is stamped more than a day ahead: a reader's cursor must not move
        to it, or everything written after it is skipped for good. The stream is repaired (the
        writers could add nothing after it either), counted; the read goes on at the next poll."""
        if not bus.is_future_id(e.id):
            return False
        n = bus.repair_stream_ids(self.r, key)
        self._rejected(what, Verdict(None, "future_id", f"entry {e.id[:48]}: stamped more than a day ahead; "
                                     f"removed {max(n, 0)} such entries from the stream"))
        return True

    def _refresh_checkpoints(self) -> None:
        """Mirror the bus's checkpoint hash: new or rewritten entries in, deleted ones out.

        The trainer deletes a checkpoint's entry when retention deletes the checkpoint, so a step
        that left the hash must leave the policy too (a failover must not resurrect it).
        """
        reply = self._read_trusting_type("checkpoints", lambda r: r.hgetall(self.keys.checkpoints)) or {}
        memo = self._ckpt_memo
        if memo is not None and memo[0] == reply and memo[1] is self.checkpoints_seen and memo[2] is self.policy \
                and (reply or not self.checkpoints_seen):
            return  # the hash as this policy already took it (most polls): nothing to parse or compare
        current: dict[int, bytes] = {}
        for k, raw in reply.items():
            try:
                current[int(k)] = raw
            except ValueError:
                continue
        if not current and self.checkpoints_seen:
            # the whole hash gone: retention never drops the newest checkpoint, so this is a bus that
            # lost its data (FLUSHALL, a restart without persistence). The trainer registers them again
            # at its next heartbeat; until then damage must still find its rollback target.
            self._log_limited("ckpt-gone", f"[{self.run}] the bus holds no checkpoint entry any more (lost its data?): "
                                           f"keeping the {len(self.checkpoints_seen)} known until the trainer registers them again")
            return
        for s in sorted(set(self.checkpoints_seen) - set(current)):
            self.policy.forget_checkpoint(s)
            self.checkpoints_seen.discard(s)
            self._ckpt_raw.pop(s, None)
            self.log(f"[{self.run}] checkpoint step {s} is gone from the bus (retention): no longer a rollback target")
        for s, raw in current.items():
            if self._ckpt_raw.get(s) == raw:
                continue
            self._ckpt_raw[s] = raw
            try:
                info = CheckpointInfo.from_json(raw)
                if info.run != self.run or info.step != s:
                    raise SchemaError(f"checkpoint entry {s} names run {info.run[:64]!r} step {info.step}", "wrong_run")
            except SchemaError as err:
                self._rejected("checkpoints", Verdict(None, err.reason, str(err)))
                continue
            if info.timeline < self.policy.timeline and s > (self.policy.last_step or 0):
                continue  # left over from a branch a rollback abandoned; the trainer overwrites it in time
            self.policy.on_checkpoint(info)
            self.checkpoints_seen.add(s)
        # what the next poll compares its reply with; a state loaded or started afresh (a new set or
        # policy) takes the hash again
        self._ckpt_memo = (reply, self.checkpoints_seen, self.policy)

    def check_overload(self, now: float) -> None:
        """Count step records the capped stream trimmed before we read them; say we cannot keep up.

        XINFO GROUPS ``entries-read`` is the group's logical read position: it advances by one per
        entry delivered, and *jumps over* entries trimmed before they were delivered. So between two
        checks, (advance of entries-read) - (entries delivered to us) is what the cap threw away
        unread. At the first check, ``entries-added - length - entries-read`` covers what was trimmed
        before this sentinel started.
        """
        if now < self._next_overload_check and not self.behind:
            return
        # about once a second, at a phase of its own: a fleet's checks do not all fall in one iteration
        self._next_overload_check = now + 0.5 + random.random()

        def text_keys(d: dict) -> dict:
            return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}

        try:  # raw: XINFO STREAM carries the first and last entries, which may not be UTF-8
            pre = [self.prefetched.pop(k, None) for k in ("xinfo_stream", "xinfo_groups")]  # sentinel/prefetch.py
            for reply in pre:
                if isinstance(reply, Exception):
                    raise reply
            groups = [text_keys(g) for g in (pre[1] if pre[1] is not None else bus.raw(self.r).xinfo_groups(self.keys.steps))]
            info = None
            if self._entries_read is None:  # the stream's counters are needed at the first check only
                info = text_keys(pre[0] if pre[0] is not None else bus.raw(self.r).xinfo_stream(self.keys.steps))
        except redis.ResponseError:
            return  # no stream yet, or a server without these fields
        group = next((g for g in groups if g.get("name") in (STEP_CONSUMER_GROUP, STEP_CONSUMER_GROUP.encode())), None)
        if group is not None and group.get("entries-read") is None and group.get("last-delivered-id") in ("0-0", b"0-0"):
            group["entries-read"] = 0  # a group that has read nothing yet reports no position
        if group is None or group.get("entries-read") is None or (info is not None and info.get("entries-added") is None):
            self._entries_read = None  # unknown position (an old server, or XDEL): start over
            return
        if group.get("lag") is not None:
            self.m.lag.labels(self.run).set(group["lag"])
        er = int(group["entries-read"])
        if self._entries_read is None:
            lost = int(info["entries-added"]) - int(info["length"]) - er
        else:
            lost = (er - self._entries_read) - self._delivered
        self._entries_read, self._delivered = er, 0
        if lost > 0:
            self.m.trimmed.labels(self.run).inc(lost)
            self._trimmed_unlogged += lost
            if time.monotonic() >= self._log_budget.get("trimmed", 0.0):  # at most one line every 30 s
                self._log_budget["trimmed"] = time.monotonic() + 30.0
                self.log(f"[{self.run}] SENTINEL CANNOT KEEP UP: {self._trimmed_unlogged} step records were trimmed from "
                         f"the capped stream before they were read (lag {group.get('lag')}); detection is blind for them")
                self._trimmed_unlogged = 0

    def _read_acks(self) -> None:
        for e in self._read_trusting_type("acks", lambda _: bus.read_stream(self.r, self.keys.acks, self.acks_id, count=1000)) or []:
            if self._future_entry("acks", self.keys.acks, e):
                break
            self.acks_id = e.id
            v = check_ack(e, self.run, self.opts.secret)
            if v.record is None:
                self._rejected("acks", v)
                continue
            a = v.record
            ours = self._sent.get(a.directive_id)
            if ours is None or (a.entry_id is not None and a.entry_id != ours):
                # not a verdict on an action of ours: an operator's directive (its CLI waits for the
                # ack itself), or junk the trainer refused. A refusal of another entry under our
                # directive's id is a forged copy: counted, while the original is still judged
                if ours is not None:
                    self._rejected("acks", Verdict(None, "forged_copy", f"ack {e.id}: the trainer {a.status} entry "
                                                   f"{a.entry_id}, a copy of directive {a.directive_id[:16]} (sent as {ours})"))
                else:
                    self._log_limited(f"ack:{a.status}", f"[{self.run}] ack {a.kind} {a.directive_id[:16]}: {a.status}"
                                      + (f" ({a.detail[:200]})" if a.detail else "") + ", for a directive this sentinel did not send")
                continue
            self.log(f"[{self.run}] ack {a.kind} {a.directive_id[:8]}: {a.status}" + (f" ({a.detail})" if a.detail else ""))
            if a.status in ("failed", "rejected"):  # "sent" was counted at XADD; the trainer's verdict lands here
                self.m.actions.labels(self.run, a.kind, a.status).inc()
            self._execute(self.policy.on_ack(a), None)

    def _read_approvals(self) -> None:
        for e in self._read_trusting_type("approvals", lambda _: bus.read_stream(self.r, self.keys.approvals, self.approvals_id, count=100)) or []:
            if self._future_entry("approvals", self.keys.approvals, e):
                break
            self.approvals_id = e.id
            try:
                d = bus.decode(e, Directive)
            except SchemaError as err:
                self._rejected("approvals", Verdict(None, err.reason, str(err)))
                continue
            why = d.verify(self.opts.secret)
            if why or d.kind != "resume" or not d.incident_id or d.run != self.run:
                reason = (why or "").replace(" ", "_") or ("wrong_run" if d.run != self.run else "malformed")
                self._rejected("approvals", Verdict(None, reason, f"approval {e.id}: {why or 'not a resume of an incident of this run'}"))
                continue
            self.log(f"[{self.run}] incident {d.incident_id} approved by {d.issuer}")
            self._execute(self.policy.approve(d.incident_id), None)

    def _heartbeat_time(self) -> float | None:
        raw = self._read_trusting_type("heartbeat", lambda r: r.get(self.keys.heartbeat))
        if not raw:
            return None
        try:
            hb = json.loads(raw)
            # paused on purpose: alive (the trainer's bus thread refreshes "sent"), not hung
            t = float(hb.get("sent") if hb.get("paused") is True else hb.get("time"))
        except (ValueError, TypeError, AttributeError, RecursionError):  # includes non-UTF-8
            return None
        return t if math.isfinite(t) else None
