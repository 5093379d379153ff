"""The sentinel daemon: every step of every watched run goes through the rules; actions go out signed.

Loop body (one iteration): renew leases → refresh checkpoints → read step records (own pending
entries first, then entries a dead consumer left behind via XAUTOCLAIM, then new ones) → feed the
policy → execute its actions → read acks and approvals → clock tick → persist policy state → XACK.

Exactly-once effects over at-least-once delivery:
- every action carries a deterministic idempotency key; ``HSETNX applied key`` gates the XADD of its
  directive, so a daemon that crashed after sending re-derives the same key and does not send twice;
- the persisted policy state records the last stream id it covers; entries re-delivered after a
  crash that the state already includes are acknowledged without being fed twice.
One daemon acts per run: a leader lease (SET NX PX, renewed by compare-and-set) picks it.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import redis

from sentinel import bus, rundir
from sentinel.daemon_lease import STANDBY_PROBE_S, Lease
from sentinel.daemon_pages import OPERATIONAL_S, Pager
from sentinel.ingest import StepGate, Verdict, check_ack, furthest_position, is_authentic
from sentinel.metrics import SentinelMetrics
from sentinel.policy import DIRECTIVE_KINDS, SPIKE_PATTERNS, Action, RunPolicy
from sentinel.protocol import (
    STEP_CONSUMER_GROUP,
    CheckpointInfo,
    Directive,
    Event,
    Incident,
    Keys,
    MarkerRecord,
    SchemaError,
    StepRecord,
    TimelineRecord,
)
from sentinel.rules import RuleSet, rules_yaml

DIRECTIVE_TTL_S = 600.0  # a directive nobody applied within 10 minutes is stale: the trainer rejects it
DISCOVER_PER_PASS = 2000  # registered names looked at per discovery pass (every 2 s)
LIVE_PROBE = 16  # newest steps entries looked at for one the trainer signed
SENT_KEPT = 1024  # directives this sentinel sent, remembered (id -> stream entry) to tell their acks apart
EVENT_KEYS_KEPT = 4096  # keys of the newest events on the bus, remembered to publish each event once
SENT_SAVED = 256  # ... and how many of them the persisted state carries to a successor


def _is_file(p: Path) -> bool:
    try:  # a bus-given path may be too long for the OS (ENAMETOOLONG is not swallowed by is_file)
        return p.is_file()
    except (OSError, ValueError):
        return False


_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")  # a Redis stream entry id, as the state saves them


def _count(v: object, none: bool = False) -> int | None:
    """A non-negative int from a saved state (a bool, float or text there is corruption)."""
    if v is None and none:
        return None
    if type(v) is not int or v < 0:
        raise ValueError("not a count")
    return v


def _finite(v: object) -> float | None:
    """A finite time from a saved state, or None (absent: a state saved before it was kept)."""
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ValueError("not a time")
    return float(v)


def event_key(ev: Event) -> str:
    """An event's idempotency key: what it says, about what (a replay of the same records derives the
    same key; the time it was derived at is left out)."""
    import hashlib

    data = {k: v for k, v in ev.data.items() if k not in ("key", "history")}
    what = json.dumps([ev.kind, ev.incident_id, ev.step, ev.message, data], default=str, sort_keys=True)
    return f"{ev.kind}:{ev.step}:{hashlib.sha256(what.encode()).hexdigest()[:16]}"


def _id_seconds(eid: str) -> float:
    """The Unix time a stream entry id is stamped with."""
    return int(eid.partition("-")[0]) / 1000.0


def _stream_id_tuple(eid: str) -> tuple[int, int]:
    a, _, b = eid.partition("-")
    return int(a), int(b or 0)


@dataclass
class Options:
    rules: RuleSet
    secret: bytes
    consumer: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    dry_run: bool = False
    require_approval: bool | None = None
    lease_ms: int = 10_000
    batch: int = 500
    alertmanager_url: str | None = None
    # records older than this, already on the stream when the lease was taken, are history: they
    # rebuild the detectors' state, but the sentinel does not act on incidents that are long over
    backlog_age_s: float = 120.0
    # with no run named: how many registered runs to watch at most, and after how long without a
    # step record (and no heartbeat) a run counts as over
    max_runs: int = 1024
    idle_s: float = 86_400.0
    # run id -> its run directory, where incidents and pages are mirrored (else the dir the trainer
    # registered on the bus, when it exists on this machine)
    run_dirs: dict[str, Path] = field(default_factory=dict)


class RunWatcher:
    """Everything the daemon does for one run."""

    def __init__(self, r: redis.Redis, run: str, opts: Options, metrics: SentinelMetrics, log: Callable[[str], None]):
        self.r, self.run, self.opts, self.m, self.log = r, run, opts, metrics, log
        self.keys = Keys(run)
        self.policy = RunPolicy(run, opts.rules, dry_run=opts.dry_run, require_approval=opts.require_approval)
        self.leader = False
        self.pager = Pager(run, opts.alertmanager_url, log)
        self.lease = Lease(r, self.keys.leader, opts.consumer, opts.lease_ms, lambda m: self.log(f"[{run}] {m}"))
        self.last_id = "0-0"  # newest step-stream id the policy state covers
        self.acks_id = "0-0"
        self.approvals_id = "0-0"
        self.checkpoints_seen: set[int] = set()
        self._ckpt_raw: dict[int, bytes] = {}  # the hash value last fed per step (a rollback rewrites it)
        self.gate = StepGate(run, opts.secret)
        # counters of rare events exported at 0 from the start: increase() then sees the first one, and
        # the dashboard shows "none" rather than "no data" (labels per stream and reason are made on use)
        for c in (metrics.trimmed, metrics.bus_restarts, metrics.steps, metrics.internal_errors):
            c.labels(run)
        self._recovered = False
        self.internal_errors = 0  # polls in a row that raised (``internal_error``)
        self._history_until = "0-0"  # stream head when the lease was taken: entries up to it may be history
        self._entries_read: int | None = None  # the group's entries-read at the last overload check
        self._delivered = 0  # entries delivered to us by ">" reads since then
        self._next_overload_check = 0.0
        self._trimmed_unlogged = 0
        self._replaying = False
        self.behind = False
        self._log_budget: dict[str, float] = {}
        self._run_dir: Path | None = None
        self._incidents_mirror: rundir.JsonlMirror | None = None
        self._pages_mirror: rundir.JsonlMirror | None = None
        self._mirrored: dict[str, str] = {}  # incident id -> the JSON last appended to incidents.jsonl
        self._written: dict[str, str] = {}  # incident id -> the JSON last written to the bus hash
        # directive id -> its directives-stream entry, for the directives this sentinel sent: only
        # their acks are verdicts on its actions (anyone can make the trainer refuse a junk entry)
        self._sent: OrderedDict[str, str] = OrderedDict()
        # incident id -> the directives-stream entry of its rollback: a step published before it was
        # trained before the trainer could apply the rollback (RunPolicy.on_step's predates_rollback)
        self._decisions: dict[str, str] = {}
        self._event_keys: OrderedDict[str, None] = OrderedDict()  # keys of the events on the bus (exactly once)
        self.replayed_events = 0  # events a replay derived again that were on the bus already: not re-published
        self.last_read = time.time()  # when a step entry was last read (or the watcher made): Daemon._retire_idle
        self.ensure_steps()

    def ensure_steps(self) -> None:
        """The steps stream and its consumer group. A key of another type there would stop every run
        this daemon watches (one XREADGROUP reads them all) and refuse every record the trainer
        sends, for good: it holds no step, so it is replaced, counted."""
        t = self.r.type(self.keys.steps)
        if (t.decode() if isinstance(t, bytes) else t) not in ("stream", "none"):
            self._rejected("steps", Verdict(None, "wrong_type", "the steps key held another Redis type; replaced"))
            self.r.delete(self.keys.steps)
        bus.ensure_group(self.r, self.keys.steps, STEP_CONSUMER_GROUP)

    # ------------------------------------------------------------------ leadership
    def renew_lease(self) -> bool:
        me = self.opts.consumer
        got = self.lease.acquire_or_renew(lambda: self._rejected(
            "leader", Verdict(None, "no_lease", "the leader key held no lease (no TTL, or not a string); taken over")))
        if got and not self.leader:
            self.log(f"[{self.run}] leader lease acquired by {me} (lease {self.opts.lease_ms / 1000:g} s)")
            self._load_state()
            head = bus.raw(self.r).xrevrange(self.keys.steps, count=1)
            self._history_until = head[0][0].decode() if head else "0-0"
            self._recovered = False  # a new term: recover pending entries again (ours and a dead leader's)
            self._on_leadership()
        elif not got and self.leader:
            self.log(f"[{self.run}] leader lease lost")
        if not got:
            self.lease.report_standby(self.run)
        self.leader = got
        self.m.leader.labels(self.run).set(1 if got else 0)
        return got

    def release(self) -> None:
        if self.leader:
            self._save_state()
            self.lease.release()
            self.leader = False
            self.m.leader.labels(self.run).set(0)

    # ------------------------------------------------------------------ persistence
    def _load_state(self) -> None:
        raw = bus.raw(self.r).get(self.keys.policy)
        if not raw:
            return
        try:  # every field checked before any is taken: a half-loaded state is worse than none
            st = json.loads(raw)
            ids = (st["last_id"], st.get("acks_id", "0-0"), st.get("approvals_id", "0-0"))
            if not all(isinstance(i, str) and _STREAM_ID.fullmatch(i) for i in ids):
                raise ValueError("stream ids")
            seen = {_count(s) for s in st.get("checkpoints_seen", [])}
            gate = st.get("gate") or {}
            gate = {"timeline": _count(gate.get("timeline"), none=True), "last_step": _count(gate.get("last_step"), none=True),
                    "last_time": _finite(gate.get("last_time"))}
            sent = [(str(d), str(i)) for d, i in st.get("sent", [])[-SENT_SAVED:]
                    if isinstance(d, str) and isinstance(i, str) and _STREAM_ID.fullmatch(i)]
            decisions = {str(k): str(v) for k, v in (st.get("decisions") or {}).items()
                         if isinstance(v, str) and _STREAM_ID.fullmatch(v)}
            self.policy.load_state_dict(st["policy"])
            self._check_position(gate, ids[0])
            self.pager.load_state_dict(st.get("pages"))
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError, MemoryError) as e:
            # corrupt or hostile: start afresh, loudly (and counted: the daemon wrote none of these)
            why = f"{e.__class__.__name__}: {str(e)[:120]}" if isinstance(e, ValueError) else e.__class__.__name__
            self._rejected("policy", Verdict(None, "malformed", f"saved policy state: {why}"))
            self.log(f"[{self.run}] persisted policy state is unreadable ({why}); starting from a fresh state")
            self._fresh_policy()
            return
        self.last_id, self.acks_id, self.approvals_id = ids
        self.checkpoints_seen = seen
        self.gate.load_state_dict(gate)
        self._sent = OrderedDict(sent)
        self._decisions = decisions
        if st["policy"].get("samples") is None:
            self._restore_samples()
        self.log(f"[{self.run}] resumed policy state at stream id {self.last_id} (state {self.policy.state})")

    def _check_position(self, gate: dict, last_id: str) -> None:
        """A saved position ahead of every record the trainer wrote would refuse each of its records
        to come as old (``out_of_order``), for good: the gate's and the policy's (timeline, step)
        must not pass the furthest authentic record on the stream (its newest entries, and those up
        to the saved ``last_id``). ValueError when they do."""
        pos = gate["timeline"], gate["last_step"]
        if pos[0] is None and self.policy.timeline == 0 and self.policy.last_step is None:
            return
        raw = bus.raw(self.r)
        rows = raw.xrevrange(self.keys.steps, max=last_id, count=256) + raw.xrevrange(self.keys.steps, count=256)
        furthest = furthest_position((bus.to_entry(self.keys.steps, eid, f) for eid, f in rows), self.run, self.opts.secret)
        if furthest is None:
            raise ValueError("a saved position, and no authentic record on the steps stream")
        for what, at in (("gate", pos), ("policy", (self.policy.timeline, self.policy.last_step))):
            if at[0] is not None and (at[0], at[1] or 0) > furthest:
                raise ValueError(f"the {what} stands at timeline {at[0]} step {at[1]}, beyond every record on the "
                                 f"stream (timeline {furthest[0]} step {furthest[1]})")

    def _restore_samples(self) -> None:
        """Refill the policy's sample-id history from the stream itself (newest entries up to last_id)."""
        n = 2 * self.opts.rules.policy.sample_history_steps
        recent = []
        for eid, fields in reversed(bus.raw(self.r).xrevrange(self.keys.steps, max=self.last_id, count=n)):
            v = StepGate(self.run, self.opts.secret).check(bus.to_entry(self.keys.steps, eid, fields))
            if isinstance(v.record, (StepRecord, TimelineRecord)):  # the markers drop what a rollback abandoned
                recent.append(v.record)
        self.policy.restore_samples(recent)

    def _save_state(self) -> None:
        st = {"policy": self.policy.state_dict(include_samples=False), "last_id": self.last_id, "acks_id": self.acks_id,
              "approvals_id": self.approvals_id, "checkpoints_seen": sorted(self.checkpoints_seen),
              "gate": self.gate.state_dict(), "sent": list(self._sent.items())[-SENT_SAVED:], "saved": time.time(),
              "decisions": dict(list(self._decisions.items())[-SENT_SAVED:]), "pages": self.pager.state_dict()}
        self.r.set(self.keys.policy, json.dumps(st))

    # ------------------------------------------------------------------ one iteration
    def poll(self, entries: list[bus.Entry]) -> int:
        """Process step entries already read for this run (plus recovery reads); returns how many."""
        if not self.leader:
            return 0
        marks = (self.last_id, self.acks_id, self.approvals_id, len(self.checkpoints_seen))
        self._refresh_checkpoints()
        todo = list(entries)
        if not self._recovered:  # own pending (crash mid-batch) and entries a dead consumer left behind
            todo = bus.read_group(self.r, self.keys.steps, STEP_CONSUMER_GROUP, self.opts.consumer, count=10_000, pending=True) + todo
            # we hold the lease, so whoever left entries pending is no longer acting on them: claim them
            # however briefly they have been idle (a dead leader's batch can be younger than any idle bound
            # when a short lease expires, and recovery runs only once per lease acquisition)
            _, claimed = bus.autoclaim(self.r, self.keys.steps, STEP_CONSUMER_GROUP, self.opts.consumer,
                                       min_idle_ms=0, count=10_000)
            todo = claimed + todo
            self._recovered = True
        # the recovery reads return what the ">" read just delivered too: each entry once
        todo = sorted({e.id: e for e in todo}.values(), key=lambda e: _stream_id_tuple(e.id))
        if entries and _stream_id_tuple(entries[0].id) <= _stream_id_tuple(self.last_id):
            self._check_stream_restart()
        done: list[str] = []
        future = False
        self.policy.begin_batch()
        for e in todo:
            done.append(e.id)
            if _stream_id_tuple(e.id) <= _stream_id_tuple(self.last_id):
                continue  # already covered by the persisted state
            if bus.is_future_id(e.id):
                future = True
            v = self.gate.check(e)
            if v.record is None:
                # XACKed below, never re-read; but last_id moves on accepted records only: an unsigned
                # entry with the largest possible id must not put everything after it out of reach
                self._rejected("steps", v)
                continue
            self.last_id = e.id
            rec = v.record
            history = (_stream_id_tuple(e.id) <= _stream_id_tuple(self._history_until)
                       and rec.time < time.time() - self.opts.backlog_age_s)
            try:
                self._feed(rec, history, e.id)
            except (bus.BusError, redis.RedisError):
                raise
            except Exception as err:  # noqa: BLE001 - a record no check foresaw must not be re-read forever
                self._rejected("steps", Verdict(None, "internal_error", f"entry {e.id}: judging it raised "
                                                f"{err.__class__.__name__}: {str(err)[:120]!r}; skipped"))
        if self._replaying:
            self._end_replay()
        self._execute(self.policy.end_batch(), None)  # the follow-up skip of the steps read: one directive
        if future:  # the trainer could add no record after it: remove it (the trainer would too, on its next XADD)
            bus.ack(self.r, self.keys.steps, STEP_CONSUMER_GROUP, *done)
            n = bus.repair_stream_ids(self.r, self.keys.steps)
            self.log(f"[{self.run}] the steps stream held entries stamped more than a day ahead: removed {max(n, 0)}")
            done = []
        if done:
            self.last_read = time.time()
        if done and self._run_dir is None:  # the trainer registers its run dir with its first steps
            self._mirror_dir()
        self._read_acks()
        self._read_approvals()
        hb = self._heartbeat_time()
        self._execute(self.policy.on_tick(time.time(), hb), None)
        n_events = self._flush_events()
        self.pager.tick(time.time(), self._incident_open)
        # an idle poll (nothing read, nothing decided) leaves the state as it was; serialising it costs
        # O(sample history x batch size), and idle polls come every 100 ms: save only what changed
        if done or n_events or marks != (self.last_id, self.acks_id, self.approvals_id, len(self.checkpoints_seen)):
            self._save_state()
        if done:
            bus.ack(self.r, self.keys.steps, STEP_CONSUMER_GROUP, *done)
        self.m.incidents_open.labels(self.run).set(
            sum(1 for i in self.policy.recent_incidents() if i.state not in ("healthy", "escalated") and i.closed_at is None))
        return len(done)

    # ------------------------------------------------------------------ failover: act as the first leader would have
    def _on_leadership(self) -> None:
        """A new term: learn which events are on the bus already (a replay derives some again), and
        send what the previous leader decided and saved but did not get to send."""
        self._event_keys.clear()
        for _, f in bus.raw(self.r).xrevrange(self.keys.events, count=EVENT_KEYS_KEPT):
            try:
                key = json.loads(f.get(b"json", b"{}")).get("data", {}).get("key")
            except (ValueError, AttributeError, RecursionError):
                continue
            if isinstance(key, str):
                self._event_keys[key] = None
        self._send_undelivered()

    def _send_undelivered(self) -> None:
        """The actions of open incidents that the saved state holds as decided, and the applied hash
        does not know: the previous leader saved them and died before sending (``_execute`` saves
        first). Sent now, once (the same idempotency keys)."""
        now = time.time()
        todo = []
        for inc in self.policy.recent_incidents():
            if inc.closed_at is not None:
                continue
            for act in inc.actions:
                if act.get("dry_run") or act.get("kind") not in (*DIRECTIVE_KINDS, "page"):
                    continue
                if now - float(act.get("time") or 0) > DIRECTIVE_TTL_S:
                    continue  # stale: the trainer would refuse it
                if self.r.hexists(self.keys.applied, act.get("idempotency_key", "")):
                    continue
                todo.append(Action.model_validate(act))
        for a in todo:
            self.log(f"[{self.run}] sending {a.kind} of incident {a.incident_id}: decided by the previous leader, not sent")
        self._execute(todo, None)

    def _predates(self, eid: str) -> bool:
        """Was step entry ``eid`` published before the open incident's rollback directive was? Then
        the trainer trained it before it could apply the rollback."""
        inc = self.policy.current
        if inc is None or inc.state != "rollback":
            return False
        sent = self._decisions.get(inc.id)
        if sent is None:
            sent = self._decisions[inc.id] = self._find_rollback_entry(inc)
        return _stream_id_tuple(eid) <= _stream_id_tuple(sent)

    def _find_rollback_entry(self, inc: Incident) -> str:
        """The directives-stream entry of ``inc``'s rollback, sent by an earlier leader (its
        directive id from the applied hash); "0-0" when it is not to be found."""
        keys = [a.get("idempotency_key") for a in inc.actions if a.get("kind") == "rollback" and not a.get("dry_run")]
        did = self.r.hget(self.keys.applied, keys[-1]) if keys else None
        if did:
            did = did.decode() if isinstance(did, bytes) else did
            for eid, f in bus.raw(self.r).xrevrange(self.keys.directives, count=1000):
                if did.encode() in f.get(b"json", b""):
                    return eid.decode()
        return "0-0"

    def _incident_open(self, key: str) -> bool:
        inc = self.policy.incident(key)
        return inc is not None and inc.closed_at is None

    def _check_stream_restart(self) -> None:
        """New entries at or below the position the state covers: either old ones delivered again
        (the consumer group was recreated), or a stream that started over below it (Redis lost its
        data, or its ids were repaired): then the position is reset, or every record is skipped."""
        try:
            info = bus.raw(self.r).xinfo_stream(self.keys.steps)
        except redis.ResponseError:
            return
        last = info.get(b"last-generated-id", info.get("last-generated-id"))
        last = last.decode() if isinstance(last, bytes) else last
        if isinstance(last, str) and _STREAM_ID.fullmatch(last) and _stream_id_tuple(last) < _stream_id_tuple(self.last_id):
            self.log(f"[{self.run}] the steps stream started over below the position read ({last} < {self.last_id}); "
                     "reading it from its start")
            self.last_id = "0-0"

    def _feed(self, rec: StepRecord | TimelineRecord | MarkerRecord, history: bool, eid: str = "0-0") -> None:
        """Give one accepted record to the policy. History (an old backlog) informs, never acts."""
        if history and not self.policy.dry_run:
            # replay it as a dry run: detectors and checkpoints learn, pages and rollbacks are not sent
            # (a dry run never uses up the rollback rate limit either)
            self.policy.dry_run = True
            self._replaying = True
            try:
                self._feed(rec, history=False, eid=eid)
                self._flush_events(history=True)
            finally:
                self.policy.dry_run = False
            return
        if self._replaying and not history:
            self._end_replay()
        if isinstance(rec, StepRecord):
            self.m.steps.labels(self.run).inc()
            self._execute(self.policy.on_step(rec, predates_rollback=self._predates(eid)), rec.time)
        elif isinstance(rec, TimelineRecord):
            self._execute(self.policy.on_timeline(rec), rec.time)
        else:  # a marker: a planned change of the loss level restarts its baselines (RunPolicy.on_marker)
            self._execute(self.policy.on_marker(rec), rec.time)

    def _end_replay(self) -> None:
        self._replaying = False
        self.policy.end_replay("seen only in the backlog: the run had gone on before this sentinel read it; not acted on")
        self._flush_events(history=True)

    def _fresh_policy(self) -> None:
        """Start the run's policy afresh; the checkpoints on the bus are fed to it again at the next
        poll (a fresh policy that knew none would page where a rollback was due)."""
        self.policy = RunPolicy(self.run, self.opts.rules, dry_run=self.opts.dry_run, require_approval=self.opts.require_approval)
        self.checkpoints_seen = set()
        self._ckpt_raw = {}

    INTERNAL_ERRORS_RESET = 3  # polls in a row that raised before the run's policy state starts afresh

    def internal_error(self, e: BaseException) -> None:
        """A poll of this run raised something unforeseen. Its entries were not acknowledged, so they
        are read again (the recovery read) at the next poll; after ``INTERNAL_ERRORS_RESET`` failures
        in a row the policy state, the likely carrier of a persistent fault, starts afresh. Counted in
        ``sentinel_internal_errors_total``; logged at most once a minute."""
        self.internal_errors += 1
        self.m.internal_errors.labels(self.run).inc()
        self._recovered = False
        what = f"{e.__class__.__name__}: {str(e)[:200]!r}"
        if self.internal_errors >= self.INTERNAL_ERRORS_RESET:
            self.internal_errors = 0
            self.log(f"[{self.run}] internal error ({what}), {self.INTERNAL_ERRORS_RESET} polls in a row: "
                     "starting this run's policy state afresh; its pending entries are read again")
            self._fresh_policy()
            return
        self._log_limited("internal", f"[{self.run}] internal error ({what}); its entries stay pending and are read "
                                      "again (counted in sentinel_internal_errors_total, logged once a minute)")

    def _rejected(self, stream: str, v: Verdict) -> None:
        """Count a refused entry; log it, but at most once a minute per (stream, reason)."""
        self.m.rejected.labels(self.run, stream, v.reason).inc()
        self._log_limited(f"{stream}:{v.reason}", f"[{self.run}] rejected {stream} entry ({v.reason}): {v.detail[:200]}"
                          + " (further ones counted in sentinel_records_rejected_total, logged once a minute)")

    def _log_limited(self, key: str, line: str) -> None:
        """Log ``line``, but at most once a minute per ``key``: bus content must not flood the log."""
        now = time.monotonic()
        if now >= self._log_budget.get(key, 0.0):
            self._log_budget[key] = now + 60.0
            self.log(line)

    def _read_trusting_type(self, what: str, read):
        """``read(raw client)``, or None when the key holds another Redis type (WRONGTYPE): anyone
        with bus access can write one, and retrying cannot fix it, so it must not stop the run's
        judging. Counted in sentinel_records_rejected_total{stream=what, reason="wrong_type"}."""
        try:
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
        current: dict[int, bytes] = {}
        for k, raw in (self._read_trusting_type("checkpoints", lambda r: r.hgetall(self.keys.checkpoints)) or {}).items():
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
        self._next_overload_check = now + 1.0

        def text_keys(d: dict) -> dict:
            return {(k.decode() if isinstance(k, bytes) else k): v for k, v in d.items()}

        try:  # raw: XINFO STREAM carries the first and last entries, which may not be UTF-8
            info = text_keys(bus.raw(self.r).xinfo_stream(self.keys.steps))
            groups = [text_keys(g) for g in bus.raw(self.r).xinfo_groups(self.keys.steps)]
        except redis.ResponseError:
            return  # no stream yet, or a server without these fields
        group = next((g for g in groups if g.get("name") in (STEP_CONSUMER_GROUP, STEP_CONSUMER_GROUP.encode())), None)
        if group is not None and group.get("entries-read") is None and group.get("last-delivered-id") in ("0-0", b"0-0"):
            group["entries-read"] = 0  # a group that has read nothing yet reports no position
        if group is None or group.get("entries-read") is None or info.get("entries-added") is None:
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

    def _flush_events(self, history: bool = False) -> int:
        events = self.policy.drain_events()
        for ev in events:
            if history:
                ev.data["history"] = True
            key = ev.data.setdefault("key", event_key(ev))
            if key in self._event_keys:  # a replay derived it again: it is on the bus already
                self.replayed_events += 1
                continue
            self._event_keys[key] = None
            while len(self._event_keys) > EVENT_KEYS_KEPT:
                self._event_keys.popitem(last=False)
            if ev.kind == "rule_fired" and ev.data.get("rule"):
                self.m.fired.labels(self.run, str(ev.data["rule"])).inc()
            elif ev.kind == "spike_pattern" and ev.data.get("pattern") in SPIKE_PATTERNS:
                for pat in SPIKE_PATTERNS:
                    self.m.spike_pattern.labels(self.run, pat).set(1.0 if pat == ev.data["pattern"] else 0.0)
            elif ev.kind == "incident":  # an episode judged to be damage
                self.m.episodes.labels(self.run, "damage").inc()
            elif ev.kind == "incident_closed" and ev.message.startswith("recovered"):
                self.m.episodes.labels(self.run, "recovered").inc()
            elif ev.kind == "action" and ev.data.get("dry_run") and isinstance(ev.data.get("action"), dict):
                # a dry-run policy returns no actions to _execute: count and log them from their events
                act = ev.data["action"]
                outcome = "history" if history else "dry_run"
                self.m.actions.labels(self.run, str(act.get("kind")), outcome).inc()
                self.log(f"[{self.run}] " + (f"BACKLOG (step {ev.step}, older than {self.opts.backlog_age_s:.0f}s): "
                                             f"not acting on history, would have sent" if history else "DRY RUN: would send")
                         + f" {act.get('kind')} ({act.get('reason')})")
            self._write_own("events", self.keys.events, lambda: bus.publish(self.r, self.keys.events, ev))
        if events:
            self._publish_incidents(events)
        return len(events)

    def _publish_incidents(self, events: list[Event]) -> None:
        """Write the incidents that changed since they were last written to the bus hash and the run
        dir's mirror. One that changed has an event in ``events`` or is among the policy's recent
        ones (every open one and the newest closed ones); the older closed ones were written when
        they closed, and an 18-day run has thousands."""
        recent = {i.id: i for i in self.policy.recent_incidents()}
        for e in events:  # opened and closed since the last write, in a batch that closed more than the recent few
            if e.incident_id and e.incident_id not in recent:
                inc = self.policy.incident(e.incident_id)
                if inc is not None:
                    recent[inc.id] = inc
        js = {iid: inc.to_json() for iid, inc in recent.items()}
        changed = {iid: j for iid, j in js.items() if self._written.get(iid) != j}
        if changed:
            self._write_own("incidents", self.keys.incidents, lambda: self.r.hset(self.keys.incidents, mapping=changed))
        self._written = js  # what left the recent set is forgotten: it cannot change any more
        self._mirror_incidents(recent, js)

    # ------------------------------------------------------------------ run-dir mirror
    def _mirror_dir(self) -> Path | None:
        """The run dir to mirror into: given on the command line, else the one the trainer registered
        (when it is on this machine). Resolved once found; None means no mirror (a remote run)."""
        if self._run_dir is None:
            d = self.opts.run_dirs.get(self.run)
            if d is None:
                raw = self._read_trusting_type("info", lambda r: r.hget(self.keys.info, "run_dir"))  # trainer-written: may be anything
                d = Path(raw.decode("utf-8", "replace")) if raw else None
                if d is not None and not _is_file(d / rundir.CONFIG):
                    d = None  # only ever write into a real run directory
            if d is not None and Path(d).is_dir():
                self._run_dir = Path(d)
                log = lambda m: self.log(f"[{self.run}] {m}")  # noqa: E731
                self._incidents_mirror = rundir.JsonlMirror(self._run_dir / rundir.INCIDENTS_LOG, log)
                self._pages_mirror = rundir.JsonlMirror(self._run_dir / rundir.PAGES_LOG, log)
                why = rundir.write_applied_rules(self._run_dir, rules_yaml(self.opts.rules))
                if why:
                    log(f"cannot write {rundir.APPLIED_RULES}: {why} (backtest of this run will use other rules)")
        return self._run_dir

    def _mirror_incidents(self, recent: dict[str, Incident], js: dict[str, str]) -> None:
        """Append every incident whose state changed since it was last mirrored (readers keep the last
        line per id), so incident history survives the bus."""
        if self._mirror_dir() is None:
            return
        for iid, j in js.items():
            if self._mirrored.get(iid) == j:
                continue
            if self._incidents_mirror.append(recent[iid].model_dump(mode="json")):
                self._mirrored[iid] = j
            else:
                self.m.mirror_failures.labels(self.run, rundir.INCIDENTS_LOG).inc()
        if len(self._mirrored) > 2 * len(js):  # forget what left the recent set
            self._mirrored = {iid: j for iid, j in self._mirrored.items() if iid in js}

    def _mirror_page(self, page: dict) -> None:
        if self._mirror_dir() is None:
            return
        if not self._pages_mirror.append(page):
            self.m.mirror_failures.labels(self.run, rundir.PAGES_LOG).inc()

    def _page_rule(self, a: Action) -> str | None:
        """The rule behind a page: its incident's rule, else the "rule: detail" prefix of an operational page."""
        if a.incident_id:
            inc = self.policy.incident(a.incident_id)
            if inc is not None:
                return inc.rule
        head = a.reason.split(":", 1)[0]
        return head if head in dict(self.opts.rules.rules.items()) else None

    # ------------------------------------------------------------------ actions
    def _execute(self, actions: list[Action], published_at: float | None) -> None:
        for a in actions:
            now = time.time()
            if a.kind in DIRECTIVE_KINDS:
                if self.opts.dry_run:
                    self.m.actions.labels(self.run, a.kind, "dry_run").inc()
                    self.log(f"[{self.run}] DRY RUN: would send {a.kind} ({a.reason})")
                    continue
                d = Directive(run=self.run, kind=a.kind, ranges=a.ranges, to_step=a.to_step, reason=a.reason,
                              incident_id=a.incident_id, issuer=f"sentinel:{self.opts.consumer}",
                              expires_at=now + DIRECTIVE_TTL_S).signed(self.opts.secret)
                # the decision is saved before it is sent: a leader that dies now leaves it to its
                # successor, which sends what it finds decided and not applied (_send_undelivered)
                self._save_state()
                if not self._write_own("applied", self.keys.applied, lambda: self.r.hsetnx(self.keys.applied, a.idempotency_key, d.id)):
                    self.m.actions.labels(self.run, a.kind, "duplicate").inc()
                    continue
                eid = self._write_own("directives", self.keys.directives, lambda: bus.publish(self.r, self.keys.directives, d))
                self._sent[d.id] = eid.decode() if isinstance(eid, bytes) else str(eid)
                if a.kind == "rollback" and a.incident_id:
                    self._decisions[a.incident_id] = self._sent[d.id]
                while len(self._sent) > SENT_KEPT:
                    self._sent.popitem(last=False)
                if published_at is not None:
                    self.m.latency.labels(self.run).observe(max(0.0, time.time() - published_at))
                self.m.actions.labels(self.run, a.kind, "sent").inc()
                self.m.last_action.labels(self.run, a.kind).set(now)
                self.log(f"[{self.run}] sent {a.kind}" + (f" to step {a.to_step}" if a.to_step is not None else "")
                         + (f", skipping {sum(h - l for l, h in a.ranges)} samples" if a.ranges else "") + f": {a.reason}")
            elif a.kind == "page":
                self._save_state()
                if not self._write_own("applied", self.keys.applied, lambda: self.r.hsetnx(self.keys.applied, a.idempotency_key, "page")):
                    self.m.actions.labels(self.run, "page", "duplicate").inc()
                    continue
                rule = self._page_rule(a)
                rule_cfg = dict(self.opts.rules.rules.items()).get(rule) if rule else None
                severity = rule_cfg.severity if rule_cfg is not None else "critical"
                self.log(f"[{self.run}] PAGE: {a.reason}")
                delivered = ["log", "bus"]
                key = a.incident_id or f"op:{rule or a.reason[:60]}"
                alert = self.pager.alert(key, severity=severity, summary=a.reason, incident_id=a.incident_id, rule=rule, now=now)
                if a.incident_id is None:
                    alert["until"] = now + OPERATIONAL_S
                if self.pager.fire(alert, now):
                    delivered.append("alertmanager")
                if self._mirror_dir() is not None:
                    delivered.append("run_dir")
                page = {"time": now, "run": self.run, "severity": severity, "summary": a.reason,
                        "incident_id": a.incident_id, "rule": rule, "delivered_to": delivered}
                ev = Event(run=self.run, kind="page", severity=severity, message=a.reason, incident_id=a.incident_id, time=now,
                           data={"rule": rule, "delivered_to": delivered})
                self._write_own("events", self.keys.events, lambda: bus.publish(self.r, self.keys.events, ev))
                self._mirror_page(page)
                self.m.actions.labels(self.run, "page", "sent").inc()
                self.m.last_action.labels(self.run, "page").set(now)


class Daemon:
    """Watches the given runs (or every registered run) until asked to stop."""

    def __init__(self, r: redis.Redis, opts: Options, *, runs: list[str] | None = None,
                 metrics: SentinelMetrics | None = None, log: Callable[[str], None] = print):
        self.r, self.opts, self.fixed_runs = r, opts, runs
        self.m = metrics or SentinelMetrics()
        self.log = log
        self.watchers: dict[str, RunWatcher] = {}
        # registered names found not live: (when to look again, the wait after that): 2 s, doubling to
        # a minute. A trainer registers a few seconds before its first record; junk stays registered
        self._not_before: dict[str, tuple[float, float]] = {}
        self._cap_logged = 0.0
        self.stop_requested = False
        self._last_discovery = 0.0
        self._last_lease = 0.0
        self._last_probe = 0.0

    def _discover(self) -> None:
        if self.fixed_runs is not None:
            for run in self.fixed_runs:
                if run not in self.watchers:
                    self.watchers[run] = RunWatcher(self.r, run, self.opts, self.m, self.log)
                    self.log(f"watching run {run}")
            return
        self._retire_idle()
        now = time.monotonic()
        new = [run for run in bus.list_runs(self.r) if run not in self.watchers and self._not_before.get(run, (0.0,))[0] <= now]
        unwatched = 0
        for run in self._live_runs(new[:DISCOVER_PER_PASS]):
            if len(self.watchers) >= self.opts.max_runs:
                unwatched += 1
                self._later(run)
                continue
            self.watchers[run] = RunWatcher(self.r, run, self.opts, self.m, self.log)
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

    def iterate(self, block_ms: int = 100) -> int:
        now = time.time()
        if now - self._last_discovery > 2.0 or not self.watchers:
            self._discover()
            self._last_discovery = now
        if now - self._last_lease > self.opts.lease_ms / 3000.0:
            for w in self.watchers.values():
                w.renew_lease()
            self._last_lease = self._last_probe = now
        elif now - self._last_probe > STANDBY_PROBE_S:  # standbys try more often: a lapsed lease is taken at once
            for w in self.watchers.values():
                if not w.leader:
                    w.renew_lease()
            self._last_probe = now
        led = [w for w in self.watchers.values() if w.leader]
        if not led:
            time.sleep(block_ms / 1000.0)
            return 0
        by_stream = {w.keys.steps: w for w in led}
        for w in led:
            w.check_overload(now)
        try:
            entries = bus.read_group(self.r, list(by_stream), STEP_CONSUMER_GROUP, self.opts.consumer,
                                     count=self.opts.batch, block_ms=block_ms)
        except bus.BusError as e:
            if "WRONGTYPE" not in str(e):
                raise
            for w in led:  # a steps key turned into another type under us
                w.ensure_steps()
            return 0
        grouped: dict[str, list[bus.Entry]] = {s: [] for s in by_stream}
        for e in entries:
            grouped[e.stream].append(e)
        for s, w in by_stream.items():
            w.behind = len(grouped[s]) >= self.opts.batch  # a full batch: more is waiting
            w._delivered += len(grouped[s])
        done = 0
        for s, w in by_stream.items():  # one run's failure must not cost the others their batch
            try:
                done += w.poll(grouped[s])
                w.internal_errors = 0
            except (bus.BusError, redis.RedisError):
                raise  # the bus's own failure: the caller backs off and every watcher reads its pending entries again
            except Exception as e:  # noqa: BLE001 - a bug or a state no check foresaw, in this run only
                w.internal_error(e)
        return done

    def run_forever(self) -> None:
        backoff = 0.5
        try:
            while not self.stop_requested:
                try:
                    self.iterate()
                    backoff = 0.5
                except (bus.BusError, redis.RedisError) as e:
                    self.m.bus_errors.inc()
                    self.log(f"control bus error ({e.__class__.__name__}): {bus.redact_url(str(e))}; retrying in {backoff:.1f}s")
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
                    for w in self.watchers.values():
                        w._recovered = False
        finally:
            for w in self.watchers.values():
                try:
                    w.release()
                except (bus.BusError, redis.RedisError):
                    pass
