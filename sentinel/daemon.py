"""The sentinel daemon: every step of every watched run goes through the rules; actions go out signed.

Loop body (one iteration, one round trip per phase whatever the number of runs): renew leases
(every third of the lease) → read every led run's new step records (one XREADGROUP; when the last
read found records, without blocking and with the checkpoints hashes of the runs read, in one
script) → per run: refresh checkpoints, its records (own pending entries first after a new term,
then those a dead consumer left behind via XAUTOCLAIM, then the new ones) through the gate and the
policy, its actions executed → the side reads settling needs (one pipeline: ``prefetch``) → per
run: acks and approvals, the clock tick (with ``Options.side_read_s``, a healthy run's at most that
often) → every run's state save and XACK (one pipeline; with ``Options.state_save_s``, a state
moved by step records alone is saved at most that often).

Exactly-once effects over at-least-once delivery:
- every action carries a deterministic idempotency key; ``HSETNX applied key`` gates the XADD of its
  directive, so a daemon that crashed after sending re-derives the same key and does not send twice;
- the persisted policy state records the last stream id it covers; entries re-delivered after a
  crash that the state already includes are acknowledged without being fed twice.
One daemon acts per run: a leader lease (SET NX PX, renewed by compare-and-set) picks it.

The parts: ``daemon_options`` (settings), ``daemon_lease`` (the lease, who leads), ``daemon_state``
(the saved state), ``daemon_failover`` (a new term), ``daemon_reads`` (checkpoints, acks, approvals,
heartbeat), ``daemon_actions`` (directives, pages, events, incidents), ``daemon_pages`` (Alertmanager),
``daemon_mirrors`` (the run dir), ``daemon_discovery`` (which runs to watch). ``RunWatcher`` is one run;
``Daemon`` watches many.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import redis

from sentinel import bus, rundir
from sentinel.daemon_actions import ActionsMixin
from sentinel.daemon_backlog import SAVE_DEFER_PERIODS, SIDE_READ_DEFER_PERIODS, Backlog
from sentinel.daemon_discovery import DiscoveryMixin
from sentinel.daemon_failover import FailoverMixin
from sentinel.daemon_lease import Lease, standby_probe_s
from sentinel.daemon_mirrors import MirrorsMixin
from sentinel.daemon_options import (  # noqa: F401 - the daemon's public names, and its settings
    _STREAM_ID,
    DIRECTIVE_TTL_S,
    DISCOVER_PER_PASS,
    LIVE_PROBE,
    PACE_MAX_S,
    POLL_IDLE_S,
    Options,
    _id_seconds,
    _stream_id_tuple,
)
from sentinel.daemon_pages import Pager
from sentinel.daemon_reads import ReadsMixin
from sentinel.daemon_state import StateMixin
from sentinel.ingest import StepGate, Verdict
from sentinel.metrics import SentinelMetrics
from sentinel.policy import RunPolicy
from sentinel.prefetch import prefetch, prefetch_checkpoints
from sentinel.protocol import (
    STEP_CONSUMER_GROUP,
    Keys,
    MarkerRecord,
    StepRecord,
    TimelineRecord,
)


class RunWatcher(StateMixin, FailoverMixin, ReadsMixin, ActionsMixin, MirrorsMixin):
    """Everything the daemon does for one run."""

    # bumped whenever any watcher gains or loses its lease: ``Daemon`` keeps the list of the runs it
    # leads between changes instead of filtering every watcher at every iteration
    leadership_changes = 0

    @property
    def leader(self) -> bool:
        return self._leader

    @leader.setter
    def leader(self, value: bool) -> None:
        if value != getattr(self, "_leader", None):
            RunWatcher.leadership_changes += 1
        self._leader = value

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
        self._ckpt_memo: tuple | None = None  # (the hash read, the set and policy it was taken into): _refresh_checkpoints
        self.gate = StepGate(run, opts.secret)
        # counters of rare events exported at 0 from the start: increase() then sees the first one, and
        # the dashboard shows "none" rather than "no data" (labels per stream and reason are made on use)
        for c in (metrics.trimmed, metrics.bus_restarts, metrics.steps, metrics.internal_errors):
            c.labels(run)
        self._steps_judged, self._open = metrics.steps.labels(run), metrics.incidents_open.labels(run)  # per record; at each state save
        self._recovered = False
        self.internal_errors = 0  # polls in a row that raised (``internal_error``)
        self._history_until = "0-0"  # stream head when the lease was taken: entries up to it may be history
        self._entries_read: int | None = None  # the group's entries-read at the last overload check
        self._delivered = 0  # entries delivered to us by ">" reads since then
        self._next_overload_check = 0.0
        self.prefetched: dict[str, object] = {}  # this iteration's side reads (sentinel/prefetch.py)
        self._next_run_dir_lookup = 0.0  # when prefetch next asks for the run dir the trainer registered
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
        self._saved_at: float | None = None  # when the state this term resumed from was saved
        self._event_keys: OrderedDict[str, None] = OrderedDict()  # keys of the events on the bus (exactly once)
        self.replayed_events = 0  # events a replay derived again that were on the bus already: not re-published
        self.last_read = time.time()  # when a step entry was last read (or the watcher made): Daemon._retire_idle
        self.last_poll = 0.0  # when this run was last polled (Daemon.iterate: idle runs every POLL_IDLE_S)
        self._unacked: list[str] = []  # step entries judged, waiting for the state save that covers them
        self._next_save = 0.0  # monotonic: when only step records moved the state, save no earlier (opts.state_save_s)
        self.side_read = True  # this poll reads acks and approvals and runs the clock rules (``side_reads_due``)
        self._next_side_read = 0.0  # wall clock: when a healthy run's side reads are next due (opts.side_read_s)
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
            self._unacked = []  # judged in an earlier term and not saved: they are pending, read again below
            # the runs' saves spread over the period, not all due in one iteration
            self._next_save = time.monotonic() + self.opts.state_save_s * random.random()
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
            bus.ack(self.r, self.keys.steps, STEP_CONSUMER_GROUP, *self._unacked)
            self._unacked = []
            self.lease.release()
            self.leader = False
            self.m.leader.labels(self.run).set(0)

    # ------------------------------------------------------------------ persistence

    # ------------------------------------------------------------------ one iteration
    def poll(self, entries: list[bus.Entry], pipe=None) -> int:
        """Process step entries already read for this run (plus recovery reads); returns how many.

        Phases: ``_gather`` (recovery reads, each entry once, in order) → ``_judge`` (each record
        through the gate and the policy; actions sent as they are decided) → ``_react`` (acks,
        approvals, the clock, events, pages) → ``_commit`` (save the state, XACK: queued on
        ``pipe`` when given, which the daemon sends for all its runs at once, else sent now)."""
        judged = self.judge(entries)
        return 0 if judged is None else self.settle(judged, pipe)

    def judge(self, entries: list[bus.Entry]) -> tuple | None:
        """``poll``'s first half: the records judged (their verdicts, actions sent). The daemon judges
        every run's records before it settles any run (``settle``), so no verdict waits for another
        run's acks, clock, events and state save. None when this sentinel does not lead the run."""
        if not self.leader:
            return None
        self.last_poll = time.monotonic()
        marks = (self.acks_id, self.approvals_id, len(self.checkpoints_seen))  # moved: saved at once
        self._refresh_checkpoints()  # at every poll: a checkpoint registered before a record is known when it is judged
        done = self._judge(self._gather(entries))
        if done:
            self.last_read = time.time()
        return done, marks

    def settle(self, judged: tuple, pipe=None, behind: bool = False) -> int:
        """``poll``'s second half: the run dir, acks, approvals, the clock, events and pages, then the
        state saved and the entries acknowledged (queued on ``pipe``; a routine save put off while the
        daemon is ``behind``: ``daemon_backlog``); returns how many were judged."""
        done, marks = judged
        if done and self._run_dir is None and (self.run in self.opts.run_dirs or "info" in self.prefetched):
            self._mirror_dir()  # the trainer registers its run dir with its first steps (looked up every 2 s: prefetch)
        n_events = self._react()
        self._commit(done, bool(n_events) or marks != (self.acks_id, self.approvals_id, len(self.checkpoints_seen)), pipe, behind)
        self.side_read = True  # a poll without prefetch (``poll`` alone) reads them all
        return len(done)

    def side_reads_due(self, now: float, behind: bool = False) -> bool:
        """Whether this poll reads the run's acks and approvals and runs its clock rules (with the
        heartbeat): at most every ``opts.side_read_s`` (jittered, so a fleet's fall in different
        iterations) for a healthy run, put off by up to ``SIDE_READ_DEFER_PERIODS`` of those while
        the daemon is ``behind`` (``daemon_backlog``); at every poll for a run in an incident or just
        sent an action (its acks and the operator's approval are awaited). Its checkpoints are read
        at every poll whatever this says. Set on ``side_read`` by ``prefetch``."""
        late = SIDE_READ_DEFER_PERIODS * self.opts.side_read_s if behind else 0.0
        if self.opts.side_read_s <= 0 or now >= self._next_side_read + late or self.policy.state != "healthy":
            self._next_side_read = now + self.opts.side_read_s * (0.5 + random.random())
            return True
        return False

    def _gather(self, entries: list[bus.Entry]) -> list[bus.Entry]:
        """The entries to judge: after a new term, our own pending ones and those a dead consumer
        left behind first; each once, in stream order."""
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
        if len(todo) > 1:
            todo = sorted({e.id: e for e in todo}.values(), key=lambda e: _stream_id_tuple(e.id))
        if entries and _stream_id_tuple(entries[0].id) <= _stream_id_tuple(self.last_id):
            self._check_stream_restart()
        return todo

    def _judge(self, todo: list[bus.Entry]) -> list[str]:
        """Each new entry through the gate and the policy, as one batch (one follow-up skip for the
        lot); returns the ids to acknowledge."""
        done: list[str] = []
        future = False
        self.policy.begin_batch()
        last, until = _stream_id_tuple(self.last_id), _stream_id_tuple(self._history_until)  # ids as numbers, once a poll
        ahead_ms = bus.future_after_ms()  # bus.is_future_id's bound, against the id parsed once
        for e in todo:
            done.append(e.id)
            position = _stream_id_tuple(e.id)
            if position <= last:
                continue  # already covered by the persisted state
            if position[0] > ahead_ms:
                future = True
            v = self.gate.check(e)
            if v.record is None:
                # XACKed below, never re-read; but last_id moves on accepted records only: an unsigned
                # entry with the largest possible id must not put everything after it out of reach
                self._rejected("steps", v)
                continue
            self.last_id, last = e.id, position
            rec = v.record
            history = position <= until and rec.time < time.time() - self.opts.backlog_age_s
            try:
                self._feed(rec, history, e.id)
                if not history:
                    self.m.on_verdict(e.id, time.time())
            except (bus.BusError, redis.RedisError):
                raise
            except Exception as err:  # noqa: BLE001 - a record no check foresaw must not be re-read forever
                self._rejected("steps", Verdict(None, "internal_error", f"entry {e.id}: judging it raised "
                                                f"{err.__class__.__name__}: {str(err)[:120]!r}; skipped"))
        if self._replaying:
            self._end_replay()
        self._execute(self.policy.end_batch(), None)  # the follow-up skip, once its window closed: one directive
        if future:  # the trainer could add no record after it: remove it (the trainer would too, on its next XADD)
            self._save_state()  # what is acknowledged here, a saved state covers
            bus.ack(self.r, self.keys.steps, STEP_CONSUMER_GROUP, *self._unacked, *done)
            self._unacked = []
            n = bus.repair_stream_ids(self.r, self.keys.steps)
            self.log(f"[{self.run}] the steps stream held entries stamped more than a day ahead: removed {max(n, 0)}")
            done = []
        return done

    def _react(self) -> int:
        """Acks, approvals, the clock-driven rules (when ``side_read``); then the events out, the pages kept up.
        Returns how many events were drained."""
        if self.side_read:
            self._read_acks()
            self._read_approvals()
            self._execute(self.policy.on_tick(time.time(), self._heartbeat_time()), None)
        n_events = self._flush_events()
        self.pager.tick(time.time(), self._incident_open)
        return n_events

    def _commit(self, done: list[str], changed: bool, pipe=None, behind: bool = False) -> None:
        """Save the state, then acknowledge the entries it covers (in this order, on one connection:
        no entry is acknowledged that a saved state does not cover). An idle poll (nothing read,
        nothing decided) leaves the state as it was; serialising it costs O(sample history x batch
        size): saved only when something changed, and when only step records did, at most every
        ``opts.state_save_s`` (what is judged meanwhile stays pending: a successor judges it again),
        put off by up to ``SAVE_DEFER_PERIODS`` of those while the daemon is ``behind``."""
        self._unacked += done
        now = time.monotonic()
        if changed or (self._unacked and now >= self._next_save + (SAVE_DEFER_PERIODS * self.opts.state_save_s if behind else 0.0)):
            # jittered: runs that fell due together (after a stall) drift apart again, not saving in one iteration for good
            self._next_save = now + self.opts.state_save_s * (0.75 + 0.5 * random.random())
            out = pipe if pipe is not None else bus.raw(self.r).pipeline(transaction=False)
            out.set(self.keys.policy, self._state_json())
            if self._unacked:
                out.xack(self.keys.steps, STEP_CONSUMER_GROUP, *self._unacked)
                self._unacked = []
            if pipe is None:
                with bus.bus_errors(self.r):
                    out.execute()
            # set with each save: an incident opens or closes with an event, which saves the state
            self._open.set(
                sum(1 for i in self.policy.recent_incidents() if i.state not in ("healthy", "escalated") and i.closed_at is None))


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
            self._steps_judged.inc()
            self._execute(self.policy.on_step(rec, predates_rollback=self._predates(eid)), rec.time)
        elif isinstance(rec, TimelineRecord):
            self._execute(self.policy.on_timeline(rec), rec.time)
        else:  # a marker: a planned change of the loss level restarts its baselines (RunPolicy.on_marker)
            self._execute(self.policy.on_marker(rec), rec.time)

    def _end_replay(self) -> None:
        self._replaying = False
        self.policy.end_replay("seen only in the backlog: the run had gone on before this sentinel read it; not acted on")
        self._flush_events(history=True)

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

    # ------------------------------------------------------------------ run-dir mirror

    # ------------------------------------------------------------------ actions


class Daemon(DiscoveryMixin):
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
        self.next_read_at = 0.0  # monotonic: the earliest the next step read is due (``Options.pace_per_run_s``)
        self._led: tuple | None = None  # ``_leading``'s lists, and what they were built from
        self._behind: list[RunWatcher] = []  # watchers whose last read was a full batch
        self._next_sweep = 0.0  # monotonic: when ``iterate`` next looks for idle runs due a poll
        self._busy = False  # the last step read found records: the next one does not block (``iterate``)
        self.backlog = Backlog()  # whether the records read waited long: routine saves and healthy side reads wait

    def _new_watcher(self, run: str) -> RunWatcher:  # DiscoveryMixin's
        return RunWatcher(self.r, run, self.opts, self.m, self.log)

    def iterate(self, block_ms: int = 100) -> int:
        """One pass: leases, one step read over every led run's stream (with the checkpoints hashes of
        the runs it found records of, when the last read found any: ``bus.read_group_with_hashes``),
        every run to poll (those with new entries, and the others every ``POLL_IDLE_S``) judged (the
        run with the oldest new record first), one pipeline of the side reads settling needs, every
        run settled, then one pipeline of their state saves and XACKs. No run's verdict waits for
        another run's round trips, and in a busy fleet none for its own: a round trip per phase,
        whatever the number of runs. Sets ``next_read_at``, which the caller waits for
        (``Options.pace_per_run_s``)."""
        started, now = time.monotonic(), time.time()
        if now - self._last_discovery > 2.0 or not self.watchers:
            self._discover()
            self._last_discovery = now
        if now - self._last_lease > self.opts.lease_ms / 3000.0:
            self._renew_leases(list(self.watchers.values()))
            self._last_lease = self._last_probe = now
        else:  # standbys try more often: a lapsed lease (or a dead holder's) is taken at once
            standby = self._leading()[3]
            if standby and now - self._last_probe > standby_probe_s(len(standby)):
                for w in standby:
                    w.renew_lease()
                self._last_probe = now
        led, by_stream, streams, _standby, ckpt_keys = self._leading()
        if not led:
            time.sleep(block_ms / 1000.0)
            return 0
        try:  # busy (the last read found records): without blocking, with the checkpoints of the runs read
            got = self._busy and bus.read_group_with_hashes(self.r, streams, ckpt_keys, STEP_CONSUMER_GROUP,
                                                            self.opts.consumer, count=self.opts.batch)
            entries, checkpoints = got if got and got[0] else (bus.read_group(
                self.r, streams, STEP_CONSUMER_GROUP, self.opts.consumer, count=self.opts.batch, block_ms=block_ms), {})
            self._busy = bool(entries)
        except bus.BusError as e:
            if "WRONGTYPE" not in str(e):
                raise
            for w in led:  # a steps key turned into another type under us
                w.ensure_steps()
            return 0
        grouped: dict[str, list[bus.Entry]] = {}
        for e in entries:
            got = grouped.get(e.stream)
            if got is None:
                grouped[e.stream] = got = []
            got.append(e)
        mono, now = time.monotonic(), time.time()
        for w in self._behind:
            w.behind = False
        # the oldest record first: after a stall of the machine, the backlog is judged in the order it
        # came (the runs' order would keep a late run's oldest record waiting behind newer ones)
        todo = sorted((by_stream[s] for s in grouped), key=lambda w: _stream_id_tuple(grouped[w.keys.steps][0].id))
        self._behind = []
        self.backlog.update(_stream_id_tuple(grouped[todo[0].keys.steps][0].id)[0] if todo else None, now, mono)
        for w in todo:
            w._delivered += len(grouped[w.keys.steps])
            if len(grouped[w.keys.steps]) >= self.opts.batch:  # a full batch: more is waiting
                w.behind = True
                self._behind.append(w)
        behind = bool(self._behind)
        # the runs with no new record: polled every POLL_IDLE_S (acks, approvals, the clock), and at
        # once after an empty read or a new term; looked for in a sweep of every run led, not at each
        # iteration (a loop over 300 runs was ~0.5 ms of each ~45-record iteration)
        if not entries or mono >= self._next_sweep:
            self._next_sweep = mono + POLL_IDLE_S / 4
            if entries:  # the cheap test first: in a busy fleet nearly every run was polled just now
                due = mono - POLL_IDLE_S
                todo += [w for w in led if (w.last_poll <= due or not w._recovered) and w.keys.steps not in grouped]
            else:
                todo += [w for w in led if w.keys.steps not in grouped]
        if entries and not behind:  # (a read that came back empty has waited its block_ms already)
            self.next_read_at = started + min(PACE_MAX_S, self.opts.pace_per_run_s * len(led))
        prefetch_checkpoints(self.r, todo, checkpoints)  # a busy read brought them: no round trip before the verdicts
        done = 0
        pipe = bus.raw(self.r).pipeline(transaction=False)  # every run's state save and XACK: one round trip
        judged = []  # every run's verdicts first, then each run settled (RunWatcher.judge / settle)
        for w in todo:  # one run's failure must not cost the others their batch
            try:
                j = w.judge(grouped.get(w.keys.steps, []))
                if j is not None:
                    judged.append((w, j))
            except (bus.BusError, redis.RedisError):
                raise  # the bus's own failure: the caller backs off and every watcher reads its pending entries again
            except Exception as e:  # noqa: BLE001 - a bug or a state no check foresaw, in this run only
                w.internal_error(e)
        prefetch(self.r, todo, now, self.backlog.behind)  # what only settling reads: acks, approvals, heartbeats, overload, run dirs
        for w in todo:
            w.check_overload(now)
        for w, j in judged:
            try:
                done += w.settle(j, pipe, self.backlog.behind)
                w.internal_errors = 0
            except (bus.BusError, redis.RedisError):
                raise
            except Exception as e:  # noqa: BLE001
                w.internal_error(e)
        if len(pipe):
            with bus.bus_errors(self.r):
                pipe.execute()
        return done

    def _leading(self) -> tuple[list[RunWatcher], dict[str, RunWatcher], list[str], list[RunWatcher], list[str]]:
        """(the watchers of the runs this daemon leads, them by steps stream, the streams, the
        standbys, the led runs' checkpoints keys in the streams' order): rebuilt when a lease changed
        hands or a run was added or retired, else kept."""
        key = (RunWatcher.leadership_changes, len(self.watchers), id(self.watchers))
        if self._led is None or self._led[0] != key:
            led = [w for w in self.watchers.values() if w.leader]
            by_stream = {w.keys.steps: w for w in led}
            self._led = (key, (led, by_stream, list(by_stream), [w for w in self.watchers.values() if not w.leader],
                               [w.keys.checkpoints for w in led]))
            self._next_sweep = 0.0  # a new term: its pending entries are recovered at once
        return self._led[1]

    def _renew_leases(self, watchers: list[RunWatcher]) -> None:
        """Every lease: those this daemon holds renewed in one round trip (``Lease.queue_keep``);
        one found lost, and the others' (standby), through ``RunWatcher.renew_lease``."""
        held = [w for w in watchers if w.leader]
        kept: list = []
        if held:
            pipe = bus.raw(self.r).pipeline(transaction=False)
            for w in held:
                w.lease.queue_keep(pipe)
            with bus.bus_errors(self.r):
                kept = pipe.execute(raise_on_error=False)
        for w, reply in zip(held, kept):
            if reply != 1:
                w.renew_lease()
        asked = {id(w) for w in held}
        for w in watchers:
            if not w.leader and id(w) not in asked:
                w.renew_lease()

    def run_forever(self) -> None:
        backoff = 0.5
        try:
            while not self.stop_requested:
                try:
                    wait = self.next_read_at - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    self.iterate()
                    backoff = 0.5
                except (bus.BusError, redis.RedisError) as e:
                    self.m.bus_errors.inc()
                    self.log(f"control bus error ({e.__class__.__name__}): {bus.redact_url(str(e))}; retrying in {backoff:.1f}s")
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 10.0)
                    for w in self.watchers.values():
                        w._recovered = False
                    self._next_sweep = 0.0
        finally:
            for w in self.watchers.values():
                try:
                    w.release()
                except (bus.BusError, redis.RedisError):
                    pass
