"""Per-run incident state machine: what to do about what the rules found.

States (``RunPolicy.state``)::

    healthy ──spike / single NaN──> suspect ──quiet for suspect_clear_steps──> healthy (incident: recovered)
       │                               │
       └──damage: the loss stays ──────┴──> incident ──> rollback ──TimelineRecord──> verifying
          elevated (divergence), or            │  (awaiting_approval: paused)  │            │
          non-finite persists                  └─ no checkpoint / rate limit ──┴─ rejected ─┴─ loss not back
                                                                       └──> escalated (pause + page, hands off)
    verifying ──loss back within band past the bad region──> healthy
    rollback ──no restore within verify_window_steps steps (never applied, or the trainer resumed
               by itself first)──> escalated; a step of a newer timeline whose marker was lost is
               taken as the restore (from its step - 1)

Why this shape: a high loss on one batch is not damage; damage is loss that stays high on the
following, *different* batches. So a spike opens a *suspect* episode and nothing more, whether or not
the guard skipped it (a trace without guard information is judged the same way): the rules' level
detector watches the next steps, and the episode closes as *recovered* (annotated, its sample ids
kept as suspects) unless the loss stays above the run's own best level, which is the ``divergence``
finding. Damage is undone the PaLM way: restore a checkpoint from at least ``rollback_margin_steps``
before the onset and skip the samples from shortly before the onset through the end of the elevated
region: the detection, and every step the trainer still trained on the damaged branch before it
applied the rollback (``skip-samples`` directives, ``_skip_later``). The target is strictly before
the onset (a checkpoint of step N holds step N's update) and on the surviving lineage (never one of
a branch a later timeline forked away from). A recovery is not assumed: the detectors go back to the
restored step and judge the replay afresh, and the loss must come back within ``verify_window_steps``
steps past the bad region (a non-finite loss meanwhile is damage) or a human is paged, and
automation stops for the run.

Recovered spikes are not forgotten: each episode is classified (``pattern``) as one-off, periodic
(same interval, or the same batch fingerprint / sample ids as an earlier spike: a data cause) or
increasing (ever shorter intervals), per the seed's spike debug path; an increasing frequency pages a
human even though every spike recovered.

Rate limits count only rollbacks really sent, per hour and per ``rollback_window_steps`` trained
steps. A dry run decides and records but never consumes them, and one fault stays one incident: after
a would-be rollback the incident is held open (the damage was not undone, so it is still there) until
the loss is back in band. With ``require_approval`` the run is paused while it waits for a human
(and paused again if the trainer restarts meanwhile); a dry run pauses nothing and asks nobody, so
it decides as without approval.

The policy is pure: the daemon feeds it records, acks, checkpoints and clock ticks, and sends the
``Action`` objects it returns. Every decision is also an ``Event`` (``drain_events``) and lands in an
``Incident`` with its evidence. ``state_dict`` is plain JSON, so a restarted daemon resumes mid-incident
and, with the deterministic ``idempotency_key``, never performs an action twice.
"""

from __future__ import annotations

import math
import time
from bisect import bisect_right
from collections import deque
from statistics import median
from typing import Any, Callable, Literal, get_args

from pydantic import BaseModel, Field

from sentinel.detectors import median_of
from sentinel.protocol import Ack, CheckpointInfo, Event, Incident, IncidentState, MarkerRecord, StepRecord, TimelineRecord, ids_to_ranges, merge_ranges
from sentinel.rules import Finding, RuleEngine, RuleSet

ActionKind = Literal["rollback", "skip-samples", "pause", "resume", "stop", "checkpoint-now", "page"]
DIRECTIVE_KINDS = frozenset({"rollback", "skip-samples", "pause", "resume", "stop", "checkpoint-now"})
MAX_EVIDENCE = 50  # per incident: enough to see the shape, bounded so incidents stay small
SPIKE_PATTERNS = ("one-off", "periodic", "increasing")
# closed incidents a state carries and a daemon keeps publishing: the newest this many. An 18-day run
# closes thousands (a recovered spike is one); each is on the bus and in the run dir's mirror when it
# closes, and carrying them all made every state save and every incident write grow with the run
RECENT_CLOSED = 64
PATTERN_HISTORY = 32  # spike episodes remembered for the pattern (one-off / periodic / increasing)
PATTERN_RANGES = 64  # sample-id ranges kept per episode to recognise the same data coming back
_PRIORITY = {"divergence": 0, "nonfinite": 1, "loss_spike": 2}  # which anomaly names the incident
# spikes that keep coming: this many separate spikes (flagged steps apart, not one spike's steps) in
# one open episode, each within episode_gap_steps of the last, page as "increasing" although none
# was damage: spikes every 6-12 steps merge into one episode that never closes, so the pattern of
# closed episodes never sees them (a 1000-step storm of 125 spikes paged nothing)
SPIKE_STORM = 10
SKIP_LATER_MAX_STEPS = 16  # steps after a sent rollback whose samples still join its skip (a trainer acts within 1-2)


def _overlap(a: list, b: list) -> bool:
    """Do two lists of half-open [lo, hi) id ranges share an id?"""
    return any(lo < hi2 and lo2 < hi for lo, hi in a for lo2, hi2 in b)


class Action(BaseModel):
    """Something the daemon should do. Directive kinds become signed Directives; "page" notifies a human."""

    kind: ActionKind
    run: str
    incident_id: str | None
    to_step: int | None = None
    ranges: list[tuple[int, int]] = Field(default_factory=list)
    # a rollback's data window in steps, first and last: the samples of these steps are the ones in
    # ``ranges`` (empty when the records carried no sample ids, as in a loss-only trace)
    skip_steps: tuple[int, int] | None = None
    reason: str
    idempotency_key: str  # deterministic: a restarted daemon that replays the same input gets the same key


def _evidence(rec: StepRecord, f: Finding) -> dict[str, Any]:
    return {
        "step": rec.step, "timeline": rec.timeline, "loss": rec.loss, "grad_norm": rec.grad_norm, "lr": rec.lr,
        "skipped": rec.skipped, "skip_reason": rec.skip_reason, "batch_fingerprint": rec.batch_fingerprint,
        "n_samples": len(rec.sample_ids), "rule": f.rule, "detail": f.detail,
    }


class RunPolicy:
    """The incident state machine for one run. See the module docstring for the states."""

    def __init__(self, run: str, rules: RuleSet, *, dry_run: bool = False, require_approval: bool | None = None,
                 clock: Callable[[], float] = time.time):
        self.run = run
        self.rules = rules
        self.cfg = rules.policy
        self.dry_run = bool(dry_run or self.cfg.dry_run)
        self.require_approval = self.cfg.require_approval if require_approval is None else bool(require_approval)
        self.clock = clock
        self.engine = RuleEngine(rules)
        self._rule_cfg = dict(rules.rules.items())
        self.last_findings: list[Finding] = []  # of the latest on_step/on_tick, before cooldowns (backtests read it)
        self._events: list[Event] = []
        self._init_state()

    def _init_state(self) -> None:
        self._state = "healthy"
        self.timeline = 0
        self.last_step: int | None = None
        self.last_time: float | None = None
        self._incidents: dict[str, Incident] = {}
        self._current: str | None = None  # id of the open incident
        self._ep: dict[str, Any] = {}  # open episode: onset, count, last, baseline, verify_*
        self._pending: dict[str, dict] = {}  # incident id -> action awaiting approval
        self._checkpoints: dict[int, CheckpointInfo] = {}
        self._samples: deque[tuple[int, list[int]]] = deque(maxlen=self.cfg.sample_history_steps)
        self._samples_in_order = True  # their steps never decrease (see _sample_ids_between)
        self._rollback_log: list[list[float]] = []  # [time, steps trained] of each rollback really sent
        self._last_fire: dict[str, list] = {}  # rule -> [step, time]
        self.steps_seen = 0  # step records judged (a monotonic count of trained steps, across rollbacks)
        self._episodes: deque[dict[str, Any]] = deque(maxlen=PATTERN_HISTORY)  # spike episodes: step, fp, ids
        self.pattern = "none"  # one-off | periodic | increasing, over this run's spike episodes
        self._hang: str | None = None  # id of the open hang incident (beside any anomaly incident)
        self._rebaselined_at: int | None = None  # steps_seen at the last planned-level rebaseline
        # [timeline, from_step] of each rollback/resume/start marker (dominated ones pruned): a
        # checkpoint of an older timeline after such a fork point is off the surviving lineage
        self._forks: list[list[int]] = []
        self._fork_cut: tuple[list[int], list[int]] | None = None  # ``_abandoned``'s index of the forks
        self._predates = False  # the step being judged was published before the rollback was sent
        self._batching = False  # between begin_batch and end_batch: follow-up skips are merged
        self._later: dict[str, Any] | None = None  # the batch's follow-up skip: incident, [lo, hi] steps, ranges

    # ------------------------------------------------------------------ public interface

    @property
    def state(self) -> str:
        return self._state

    @property
    def incidents(self) -> list[Incident]:
        """Every incident of this policy's life (a backtest reports them all); a restored state has
        only ``recent_incidents`` of the one saved."""
        return list(self._incidents.values())

    def recent_incidents(self) -> list[Incident]:
        """The incidents that may still change: every open one, and the newest ``RECENT_CLOSED``
        closed ones (an ack or a mirror write may still be on its way for those), oldest first."""
        out: list[Incident] = []
        closed = 0
        for inc in reversed(self._incidents.values()):
            if inc.closed_at is None or closed < RECENT_CLOSED:
                out.append(inc)
                closed += inc.closed_at is not None
        out.reverse()
        return out

    def incident(self, incident_id: str) -> Incident | None:
        return self._incidents.get(incident_id)

    @property
    def current(self) -> Incident | None:
        """The open anomaly incident (suspect through escalated), if any."""
        return self._incidents.get(self._current) if self._current else None

    def drain_events(self) -> list[Event]:
        ev, self._events = self._events, []
        return ev

    def on_checkpoint(self, info: CheckpointInfo) -> None:
        """A checkpoint exists: a rollback candidate, unless its verification failed (a checkpoint
        re-registered as failed is withdrawn) or it lies on a branch a later timeline abandoned (an
        async save of the damaged branch that registers after the rollback marker)."""
        if info.verified == "failed":
            old = self._checkpoints.get(info.step)
            if old is not None and (old.timeline == info.timeline or old.path == info.path):
                del self._checkpoints[info.step]
                self._event("checkpoint_withdrawn", "warning", f"checkpoint of step {info.step} (timeline {info.timeline}) "
                            "failed verification: no longer a rollback target", step=info.step, incident_id=self._current)
            return
        if self._abandoned(info):
            self._event("checkpoint_ignored", "info", f"checkpoint of step {info.step} (timeline {info.timeline}) lies on "
                        "a branch a later timeline abandoned: never a rollback target", step=info.step, incident_id=self._current)
            return
        self._checkpoints[info.step] = info

    def _abandoned(self, info: CheckpointInfo) -> bool:
        """Is ``info`` off the surviving lineage: a later timeline forked its timeline before its step?
        (Some fork (t, s) with t > its timeline and s < its step: the smallest fork step over the
        timelines after its own, by bisection. The scan of every fork for every checkpoint took
        7 ms a rollback target after 300 rollbacks with 300 checkpoints.)"""
        if self._fork_cut is None:
            forks = sorted((t, s) for t, s in self._forks)
            mins: list[int] = []
            low = None
            for _, s in reversed(forks):  # suffix minimum of the fork steps
                low = s if low is None or s < low else low
                mins.append(low)
            mins.reverse()
            self._fork_cut = ([t for t, _ in forks], mins)
        ts, mins = self._fork_cut
        i = bisect_right(ts, info.timeline)  # the first fork of a later timeline
        return i < len(ts) and info.step > mins[i]

    def _note_fork(self, timeline: int, from_step: int) -> None:
        """Remember that ``timeline`` forked at ``from_step``. A fork (t, s) abandons the checkpoints
        of timelines < t after step s; one whose abandoned set another's contains is dropped, so the
        list stays as short as the run's genuinely different fork points."""
        if any(t >= timeline and s <= from_step for t, s in self._forks):
            return
        self._forks = [[t, s] for t, s in self._forks if not (timeline >= t and from_step <= s)] + [[timeline, from_step]]
        self._fork_cut = None

    def end_replay(self, why: str) -> None:
        """A backlog replayed as a dry run is over: an incident it held open is history, not live.
        So is one parked for an approval that nobody was asked for (every action of it a dry run)."""
        inc = self._incidents.get(self._current) if self._current else None
        if inc is None:
            return
        if self._ep.get("held") or (self._state == "awaiting_approval" and all(a.get("dry_run") for a in inc.actions)):
            self._pending.pop(inc.id, None)
            self._close("healthy", self.last_step, why)

    def forget_checkpoint(self, step: int) -> None:
        """A checkpoint is gone (retention deleted it): never roll back to it."""
        self._checkpoints.pop(step, None)

    def on_step(self, rec: StepRecord, *, predates_rollback: bool = False) -> list[Action]:
        """Judge one step record. ``predates_rollback``: the record was published before the open
        incident's rollback directive was (the daemon compares their stream ids): the trainer could
        not have applied the rollback yet, so the step is backlog, not a sign that it never will (a
        leader that takes over and replays the steps trained since the decision)."""
        if rec.timeline < self.timeline:
            return []  # a late record from a timeline a rollback abandoned
        pre: list[Action] = []
        if rec.timeline > self.timeline and self._state in ("rollback", "awaiting_approval"):
            pre = self._inferred_restore(rec)
        self._predates = predates_rollback and self._state == "rollback"
        try:
            return pre + self._on_step(rec)
        finally:
            self._predates = False

    def begin_batch(self) -> None:
        """Steps fed between ``begin_batch`` and ``end_batch`` (a daemon's read) collect the samples
        they add to a sent rollback's skip (``_skip_later``) into one follow-up window, sent as one
        ``skip-samples`` directive by the first ``end_batch`` after the window closed (the restore
        was seen, the incident escalated, or ``SKIP_LATER_MAX_STEPS`` passed): one directive per
        rollback, whether the steps came one per read or as the backlog a new leader replays. The
        window is part of the saved state, so a successor sends it when it closes."""
        self._batching = True

    def end_batch(self) -> list[Action]:
        """The batch's follow-up skip, as one action (or none)."""
        self._batching = False
        later = self._later
        if later is None or (self._state == "rollback" and self._current == later["incident"]
                             and not self._ep.get("skip_capped")):
            return []  # the trainer has not applied the rollback yet: more steps may join the skip
        self._later = None
        inc = self._incidents.get(later["incident"])
        if inc is None:
            return []
        lo, hi = later["steps"]
        what = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
        act = self._incident_action(inc, "skip-samples", f"samples of {what}, trained on the damaged branch before the "
                                    f"rollback to step {inc.rollback_to} took effect",
                                    ranges=[tuple(r) for r in later["ranges"]], skip_steps=(lo, hi))
        return self._emit([act])

    def _inferred_restore(self, rec: StepRecord) -> list[Action]:
        """A step of a newer timeline arrived while a rollback (or an approval) waits, but not the
        marker that started that timeline (the capped stream trimmed it before it was read): the
        trainer restored something. Take this first record of the new timeline as the restore,
        from its step - 1: a rollback that was sent is then verified like any other, and a
        restart while approval is pending pauses the run again."""
        kind = "rollback" if self._state == "rollback" else "resume"
        s = max(rec.step - 1, 0)
        self._event("timeline_inferred", "warning", f"step {rec.step} of timeline {rec.timeline} arrived without its "
                    f"marker (trimmed from the stream?): taken as a {kind} from step {s}", step=rec.step,
                    incident_id=self._current)
        return self.on_timeline(TimelineRecord(kind=kind, run=self.run, from_step=s, timeline=rec.timeline, time=rec.time,
                                               reason=f"inferred from step {rec.step} of timeline {rec.timeline}"))

    def _on_step(self, rec: StepRecord) -> list[Action]:
        if rec.timeline > self.timeline:
            self.timeline = rec.timeline
        self.last_step, self.last_time = rec.step, rec.time
        self.steps_seen += 1
        if self._hang is not None:
            self._end_hang(rec)
        later = None
        if rec.sample_ids:
            sm = self._samples
            if sm and rec.step < sm[-1][0]:
                self._samples_in_order = False  # a record out of order: scan the history whole from now on
            sm.append((rec.step, rec.sample_ids))
            if self._state in ("rollback", "awaiting_approval"):
                later = self._skip_later(rec)
        findings = self.engine.evaluate(rec)
        self.last_findings = findings
        st = self._state
        if self.dry_run and st in ("verifying", "escalated") and self._ep.get("held"):
            self._hold(rec, findings)
            return self._emit([])
        if st == "rollback" and self._predates:
            # published before the rollback was sent: the trainer could not have applied it yet
            self._ep["rollback_seen"] = self.steps_seen
        if st == "rollback":
            # the restore must come: a trainer that resumed by itself before applying the rollback,
            # or never applies it, trains on unjudged; after a window of steps a human takes over
            since = self.steps_seen - self._ep.setdefault("rollback_seen", self.steps_seen)
            if since >= self.cfg.verify_window_steps:
                out = [later] if later is not None else []
                inc = self._incidents[self._current]
                self._escalate(f"rollback not applied: {since} steps trained since the rollback to step "
                               f"{inc.rollback_to} was sent, and no restore of it seen", out, rec.step)
                return self._emit(out)
        if not findings:
            if st == "suspect" and rec.step - self._ep["last"] >= self.cfg.suspect_clear_steps:
                self._close("recovered", rec.step, self._recovered_why(rec))
            elif st == "verifying":
                out: list[Action] = []
                self._verify(rec, out)
                return self._emit(out)
            return self._emit([later]) if later is not None else []
        out = [later] if later is not None else []
        anomalies = []
        for f in findings:
            if not self._cooled(f, rec.step):
                continue
            self._event("rule_fired", f.severity, f.detail, step=rec.step, data=f.to_dict(), incident_id=self._current)
            if f.anomaly and f.action == "rollback":
                anomalies.append(f)
            elif f.action in ("page", "checkpoint-now", "pause"):
                self._operational(f, out)
        if st in ("healthy", "suspect"):
            if anomalies:
                self._episode(rec, anomalies, out)
            elif st == "suspect" and rec.step - self._ep["last"] >= self.cfg.suspect_clear_steps:
                self._close("recovered", rec.step, self._recovered_why(rec))
        elif st == "verifying":
            if anomalies and self._is_damage(anomalies):
                self._escalate(f"anomaly during recovery verification at step {rec.step}: {anomalies[0].detail}", out, rec.step)
            else:
                self._verify(rec, out)
        return self._emit(out)

    def on_timeline(self, rec: TimelineRecord) -> list[Action]:
        """A start/resume/rollback marker: forget what the restore made void; a requested rollback
        that has happened starts verification."""
        out: list[Action] = []
        s = rec.from_step
        if rec.timeline < self.timeline:
            # a late marker of a timeline already left behind (the daemon's gate drops these first):
            # acting on it would rewind the detectors and drop the samples of the live timeline
            self._event("stale_marker", "warning", f"ignored a {rec.kind} marker of timeline {rec.timeline} from step "
                        f"{s}: timeline {self.timeline} is current", step=s, incident_id=self._current)
            return out
        self.timeline = rec.timeline
        self._note_fork(rec.timeline, s)
        self._last_fire = {r: [None, v[1]] for r, v in self._last_fire.items()}  # step cooldowns restart
        # checkpoints of the abandoned branch are not ancestors any more; those written on this timeline
        # or a later one are (a sentinel replaying an old backlog already knows checkpoints made after it)
        for k in [k for k, c in self._checkpoints.items() if k > s and c.timeline < rec.timeline]:
            del self._checkpoints[k]
        while self._samples and self._samples[-1][0] > s:
            self._samples.pop()
        self.last_step = s
        self._event(rec.kind, "info", f"{rec.kind} from step {s} (timeline {rec.timeline})", step=s,
                    incident_id=self._current, data={"checkpoint": rec.checkpoint, "reason": rec.reason})
        inc = self._incidents.get(self._current) if self._current else None
        if rec.kind == "start" and s == 0:
            self.engine.reset()
        elif inc is not None and self._state == "rollback" and (rec.kind == "rollback" or s == inc.rollback_to):
            # our rollback happened. The detectors go back to the restored step, as the weights did:
            # the replay of the steps after it is judged against what came before them, not against
            # the later (on a falling curve: lower) level the old branch reached by the onset. The
            # pre-onset baseline of the episode is kept for the verdict.
            self.engine.rewind(s)
            self._set_state("verifying", inc)
            self._ep.update(verify_from=s, verify_recent=[])
            self._event("verifying", "info", f"restored step {s}; verifying that the loss comes back within "
                        f"{self.cfg.verify_tolerance:.0%} of {self._ep.get('baseline')} by step {self._verify_deadline(inc)} "
                        f"({self.cfg.verify_window_steps} steps past the bad region)", step=s, incident_id=inc.id)
        else:
            self.engine.rewind(s)
            if self._state == "suspect":
                self._close("recovered", s, f"superseded by {rec.kind} to step {s}")
            elif self._state == "rollback" and inc is not None:
                # not our restore (the trainer restarted by itself first): the rollback directive may still
                # be applied; if it is not within verify_window_steps steps, on_step escalates
                self._event("rollback_pending", "warning", f"{rec.kind} from step {s}, not the rollback to step "
                            f"{inc.rollback_to}: still waiting for it (at most {self.cfg.verify_window_steps} steps)",
                            step=s, incident_id=inc.id)
        if self._state == "awaiting_approval" and inc is not None:
            # the trainer restarted while it waited: the pause it was sent went with the old process, so
            # pause the new one too; the steps it trains on the new timeline before that pause takes
            # effect join the waiting rollback's skip (``_skip_later``), like those of the old one
            ep = self._ep
            ep["skip_to"] = max(s, ep.get("skip_to", s))
            ep["skip_base"] = ep["skip_to"]
            ep["skip_timeline"] = rec.timeline
            ep.pop("skip_capped", None)
            out.append(self._incident_action(inc, "pause", f"the trainer restarted ({rec.kind} from step {s}, timeline "
                                             f"{rec.timeline}) while the rollback to step {inc.rollback_to} awaits "
                                             f"approval: paused again until `sentinel approve {inc.id}`"))
        return self._emit(out)

    LEVEL_MARKERS = ("mixture_change", "seq_len_change")  # planned changes of the loss level
    REBASELINE_MIN_STEPS = 200  # at most one rebaseline per this many trained steps

    def on_marker(self, rec: MarkerRecord) -> list[Action]:
        """A change of training conditions. A new mixture or sequence length moves the loss level
        by plan: the loss baselines start again, so the new level is not taken for damage (a
        harder mixture would otherwise read as a level shift and be rolled back). The other
        markers (end of warmup, start of decay) only annotate the timeline."""
        if rec.marker not in self.LEVEL_MARKERS or rec.timeline < self.timeline:
            return self._emit([])
        what = f"{rec.marker} at step {rec.step}" + (f" ({rec.detail})" if rec.detail else "")
        last = self._rebaselined_at
        if last is not None and self.steps_seen - last < self.REBASELINE_MIN_STEPS:
            # the baselines are still re-learning; a run that changed its mixture every few steps
            # would otherwise never be judged at all
            self._event("rebaseline_skipped", "warning", f"{what}: within {self.REBASELINE_MIN_STEPS} steps of the "
                        f"last restart of the loss baselines; kept judging against the new ones", step=rec.step,
                        incident_id=self._current)
            return self._emit([])
        self._rebaselined_at = self.steps_seen
        self.engine.rebaseline()
        self._event("rebaseline", "info", f"{what}: loss baselines restart", step=rec.step, incident_id=self._current)
        return self._emit([])

    def on_ack(self, ack: Ack) -> list[Action]:
        """A trainer's answer to a directive. A rejected or failed rollback escalates."""
        out: list[Action] = []
        ok = ack.status in ("applied", "duplicate")
        self._event("ack", "info" if ok else "warning", f"{ack.kind} {ack.status} at step {ack.step}"
                    + (f": {ack.detail}" if ack.detail else ""), step=ack.step, incident_id=self._current,
                    data={"directive_id": ack.directive_id, "status": ack.status})
        if not ok and self._state == "rollback" and ack.kind in ("rollback", "unknown"):
            self._escalate(f"rollback {ack.status}: {ack.detail or 'no detail'}", out, ack.step)
        return self._emit(out)

    def on_tick(self, now: float, heartbeat_time: float | None) -> list[Action]:
        """Clock-driven rules. ``heartbeat_time`` None falls back to the last record's time."""
        hb = heartbeat_time if heartbeat_time is not None else self.last_time
        newest = max((c.created for c in self._checkpoints.values()), default=None)
        findings = self.engine.evaluate_tick(now, hb, newest, step=self.last_step)
        self.last_findings = findings
        out: list[Action] = []
        for f in findings:
            if self._cooled(f, f.step, now):
                self._event("rule_fired", f.severity, f.detail, step=f.step, data=f.to_dict(), incident_id=self._current)
                self._operational(f, out)
        return self._emit(out)

    def approve(self, incident_id: str) -> list[Action]:
        """A human approves: the pending rollback of an awaiting_approval incident is issued, or an
        escalated run is handed back to automation (with a resume)."""
        inc = self._incidents.get(incident_id)
        if inc is None:
            raise ValueError(f"unknown incident {incident_id!r}")
        out: list[Action] = []
        if inc.state == "awaiting_approval" and incident_id in self._pending:
            act = Action.model_validate(self._pending.pop(incident_id))
            self._event("approved", "info", f"rollback to step {act.to_step} approved", step=self.last_step, incident_id=inc.id)
            self._issue_rollback(inc, act, out)
            if inc.state == "rollback":  # the run was paused while it waited: the restored run goes on
                out.append(self._incident_action(inc, "resume", "approved rollback sent: resume after it"))
        elif inc.state == "escalated" and self._current == incident_id:
            self._event("approved", "info", "operator handed the run back to automation", step=self.last_step, incident_id=inc.id)
            out.append(self._incident_action(inc, "resume", "operator approved resuming after escalation"))
            self._stamp_closed(inc, self.last_step, "operator handed the run back to automation")
            self._current, self._ep, self._state = None, {}, "healthy"
        else:
            raise ValueError(f"incident {incident_id} is {inc.state}: nothing to approve")
        return self._emit(out)

    # ------------------------------------------------------------------ episodes and incidents

    def _is_damage(self, anomalies: list[Finding]) -> bool:
        """Damage is loss that stays high on the following batches (``divergence``: a level shift,
        slow decay or climb, or most recent steps anomalous) or non-finite values that persist. One
        high or NaN batch is not, whether or not the guard skipped it: the next steps tell."""
        for f in anomalies:
            if f.rule == "divergence":
                return True
            if f.rule == "nonfinite" and f.onset_step is not None and self.last_step is not None \
                    and self.last_step - f.onset_step + 1 >= self.rules.rules.nonfinite.persist_steps:
                return True
        return False

    def _episode(self, rec: StepRecord, anomalies: list[Finding], out: list[Action]) -> None:
        f = min(anomalies, key=lambda a: _PRIORITY.get(a.rule, 9))
        onset = f.onset_step if f.onset_step is not None else rec.step
        if self._state == "suspect" and rec.step - self._ep["last"] > self.cfg.episode_gap_steps:
            # an unrelated, recovered blip must not drag this episode's onset (and so the
            # rollback target and the skip window) back to itself
            self._close("recovered", self._ep["last"], f"recovered; a new episode starts at step {rec.step}")
        damage = self._is_damage(anomalies)
        if self._state == "healthy":
            iid = f"{self.run}-t{self.timeline}-s{onset}"
            n = 1
            while iid in self._incidents:  # a replay of the same step on a later timeline
                n += 1
                iid = f"{self.run}-t{self.timeline}-s{onset}-{n}"
            inc = Incident(id=iid, run=self.run, state="suspect", rule=f.rule, onset_step=onset, detect_step=rec.step,
                           opened_at=self.clock())
            self._incidents[iid] = inc
            self._current = iid
            self._state = "suspect"
            base = self.engine.loss_level()
            self._ep = {"onset": onset, "count": 0, "last": rec.step, "baseline": base}
            self._event("incident_opened", f.severity, f"{f.rule} at step {rec.step}: {f.detail}", step=rec.step, incident_id=iid)
            if not damage:
                self._classify(inc, rec, out)
        inc = self._incidents[self._current]
        ep = self._ep
        if not damage and self._state == "suspect" and any(a.rule == "loss_spike" for a in anomalies) \
                and (ep["count"] == 0 or rec.step - ep["last"] >= 2):  # a new spike, not the next step of one
            ep["spikes"] = ep.get("spikes", 0) + 1
            if ep["spikes"] == SPIKE_STORM:
                self._spike_storm(inc, rec, out)
        ep["count"] += 1
        ep["last"] = rec.step
        if onset < ep["onset"] - (self.cfg.episode_gap_steps if ep["count"] > 1 else 0):
            # a level shift that began well before the spike that opened this episode names the
            # onset; a few steps' disagreement is only the estimate's noise: the spike is exact
            ep["onset"] = inc.onset_step = onset
        inc.detect_step = rec.step
        for a in anomalies:
            if len(inc.evidence) < MAX_EVIDENCE:
                inc.evidence.append(_evidence(rec, a))
        if damage:
            self._open_incident(inc, f.rule, f.detail, rec.step, out)

    def _spike_storm(self, inc: Incident, rec: StepRecord, out: list[Action]) -> None:
        """``SPIKE_STORM`` spikes in one episode that never went quiet: the frequency went up (from
        isolated spikes to one every few steps). Pattern "increasing", and a page (once per episode)."""
        n, span = self._ep["spikes"], rec.step - self._ep["onset"] + 1
        why = f"{n} spikes in {span} steps, none {self.cfg.episode_gap_steps} steps apart (the episode never went quiet)"
        prev, self.pattern = self.pattern, "increasing"
        inc.pattern = "increasing"
        if prev != "increasing":
            self._event("spike_pattern", "warning", f"spike pattern: increasing ({why})", step=rec.step, incident_id=inc.id,
                        data={"pattern": "increasing", "spikes": n, "steps": span})
        if self.cfg.page_on_increasing_spikes:
            out.append(self._incident_action(inc, "page", f"spikes keep coming: {why}; each recovered, but recovered "
                                             "is not healthy (check lr, data order, precision)"))

    def _classify(self, inc: Incident, rec: StepRecord, out: list[Action]) -> None:
        """Name the pattern of this run's spike episodes (the seed's spike debug path): one-off,
        periodic (the same interval, or the same batch / data coming back: a data cause), or
        increasing (ever shorter intervals: something is wearing out; page even if each recovered)."""
        ranges = merge_ranges(ids_to_ranges(rec.sample_ids))[:PATTERN_RANGES]  # compact: batches are mostly contiguous
        eps = self._episodes
        same_data = any((rec.batch_fingerprint and e["fp"] == rec.batch_fingerprint) or _overlap(ranges, e["ids"])
                        for e in eps)
        eps.append({"step": rec.step, "fp": rec.batch_fingerprint, "ids": [list(r) for r in ranges]})
        steps = [e["step"] for e in eps]
        gaps = [b - a for a, b in zip(steps, steps[1:]) if b > a]
        pattern = "one-off"
        if same_data:
            pattern = "periodic"
        elif len(gaps) >= 3 and max(gaps[-3:]) - min(gaps[-3:]) <= max(2, 0.05 * max(gaps[-3:])):
            pattern = "periodic"
        if len(gaps) >= 6:
            last, earlier = gaps[-3:], gaps[:-3]
            if last[0] >= last[1] >= last[2] and max(last) < 0.5 * median(earlier):
                pattern = "increasing"
        prev, self.pattern = self.pattern, pattern
        inc.pattern = pattern
        if pattern != prev:
            why = {"one-off": "isolated spikes", "periodic": "spikes recur at a fixed interval or on the same data",
                   "increasing": f"spikes come ever more often (last intervals {gaps[-3:]} steps)"}[pattern]
            self._event("spike_pattern", "warning" if pattern == "increasing" else "info", f"spike pattern: {pattern} ({why})",
                        step=rec.step, incident_id=inc.id, data={"pattern": pattern, "intervals": gaps[-6:]})
            if pattern == "increasing" and self.cfg.page_on_increasing_spikes:
                out.append(self._incident_action(inc, "page", f"spike pattern increasing: {why}; each recovered, "
                                                 "but recovered is not healthy (check lr, data order, precision)"))

    def _open_incident(self, inc: Incident, rule: str, why: str, step: int, out: list[Action]) -> None:
        inc.rule = rule
        self._set_state("incident", inc)
        self._event("incident", "critical", f"damage at step {step} (onset {inc.onset_step}): {why}", step=step, incident_id=inc.id)
        self.engine.clear_episode()
        target = self._pick_target(inc.onset_step)
        if target is None:
            self._escalate(f"no checkpoint at or before onset step {inc.onset_step} to roll back to", out, step)
            return
        lo = inc.onset_step - self.cfg.skip_margin_steps
        ids = self._sample_ids_between(lo, step)
        inc.rollback_to = target
        inc.skip_ranges = merge_ranges(ids_to_ranges(ids))
        self._ep.update(skip_to=step, skip_timeline=self.timeline)  # the last step whose samples the skip covers (_skip_later)
        act = self._incident_action(inc, "rollback", f"{rule}: {why}", to_step=target, ranges=inc.skip_ranges,
                                    skip_steps=(max(lo, 0), step))
        if self.require_approval and not self.dry_run:
            # do not keep training on damaged weights while a human decides. (A dry run pauses nothing
            # and asks nobody: it decides as without approval, and holds the incident open below.)
            self._pending[inc.id] = act.model_dump(mode="json")
            self._set_state("awaiting_approval", inc)
            out.append(self._incident_action(inc, "pause", f"paused until a human approves rolling back to step {target}"))
            out.append(self._incident_action(inc, "page", f"approval needed: roll back to step {target} and skip "
                                             f"{len(ids)} samples ({rule}); the run is paused until "
                                             f"`sentinel approve {inc.id}`"))
            return
        self._issue_rollback(inc, act, out)

    def _skip_later(self, rec: StepRecord) -> Action | None:
        """A step trained on the damaged branch after the rollback was decided, before the trainer
        applied it (it acts at its next step boundary; with approval pending, until it pauses): its
        samples join the skip too, so data of the elevated region that came after the detection
        step does not come back after the restore (a NaN sample one step later recurred that way).
        Sent as a ``skip-samples`` directive (the rollback already left); while approval is
        pending, added to the rollback that waits. For ``SKIP_LATER_MAX_STEPS`` steps after the
        detection at most: a trainer still on that branch later does not apply directives, and
        gets one warning event instead of a directive per step."""
        inc = self._incidents.get(self._current) if self._current else None
        if inc is None or rec.step <= self._ep.get("skip_to", rec.step) or rec.timeline != self._ep.get("skip_timeline"):
            return None  # a replay, or a step of the restored branch (its marker not read yet)
        if self._predates:  # backlog trained before the rollback existed: the cap counts from after it
            self._ep["skip_base"] = rec.step
        base = self._ep.get("skip_base", inc.detect_step)  # a restart while approval is pending counts anew
        if rec.step - base > SKIP_LATER_MAX_STEPS:
            if not self._ep.get("skip_capped"):  # a trainer that does not apply directives: say so once, do not flood
                self._ep["skip_capped"] = True
                sent = "the pause" if self._state == "awaiting_approval" else f"the rollback to step {inc.rollback_to}"
                self._event("rollback_not_applied", "warning", f"the trainer is still on the damaged branch {rec.step - base} "
                            f"steps after {sent} was sent; later samples are not added to the skip",
                            step=rec.step, incident_id=inc.id)
            return None
        self._ep["skip_to"] = rec.step
        new = merge_ranges(ids_to_ranges(rec.sample_ids))
        inc.skip_ranges = merge_ranges(list(inc.skip_ranges) + new)
        if self._state == "awaiting_approval":
            pending = self._pending.get(inc.id)
            if pending is not None:
                pending["ranges"] = [list(r) for r in merge_ranges([tuple(r) for r in pending["ranges"]] + new)]
                if pending.get("skip_steps"):
                    pending["skip_steps"] = [pending["skip_steps"][0], rec.step]
            return None
        if self._batching:  # one directive for the whole read (end_batch)
            lt = self._later
            if lt is None or lt["incident"] != inc.id:
                lt = self._later = {"incident": inc.id, "steps": [rec.step, rec.step], "ranges": []}
            lt["steps"][1] = rec.step
            lt["ranges"] = [list(r) for r in merge_ranges([tuple(r) for r in lt["ranges"]] + new)]
            return None
        return self._incident_action(inc, "skip-samples", f"samples of step {rec.step}, trained on the damaged branch "
                                     f"before the rollback to step {inc.rollback_to} took effect", ranges=new,
                                     skip_steps=(rec.step, rec.step))

    def _issue_rollback(self, inc: Incident, act: Action, out: list[Action]) -> None:
        now = self.clock()
        if not self.dry_run:  # a dry run sends nothing, so it can never use up the budget
            c = self.cfg
            log = [e for e in self._rollback_log if now - e[0] < 3600.0 or self.steps_seen - e[1] < c.rollback_window_steps]
            self._rollback_log = log
            hour = sum(1 for t, _ in log if now - t < 3600.0)
            window = sum(1 for _, n in log if self.steps_seen - n < c.rollback_window_steps)
            if max(hour, window) >= c.max_rollbacks_per_hour:
                self._escalate(f"rate limit: {hour} rollbacks in the last hour, {window} in the last "
                               f"{c.rollback_window_steps} steps (max {c.max_rollbacks_per_hour})", out, inc.detect_step)
                return
            self._rollback_log.append([now, self.steps_seen])
        out.append(act)
        if self.dry_run:
            # nothing will be restored, so the damage is still there: hold this incident open (one
            # fault, one incident) until the loss is back in band, instead of re-detecting it
            ask = " (after pausing for a human's approval)" if self.require_approval else ""
            self._hold_open(inc, f"dry run: would roll back to step {act.to_step}{ask}")
        else:
            self._set_state("rollback", inc)
            self._ep["rollback_seen"] = self.steps_seen  # the restore must come within verify_window_steps steps

    def _hold_open(self, inc: Incident, why: str) -> None:
        self._set_state("verifying" if inc.state != "escalated" else "escalated", inc)
        self._ep.update(held=True, verify_recent=[])
        self._event("dry_run_hold", "info", f"{why}; watching the same damage until the loss is back in band",
                    step=self.last_step, incident_id=inc.id)

    def _hold(self, rec: StepRecord, findings: list[Finding]) -> None:
        """Dry run after a would-be rollback or escalation: add evidence, decide nothing new, close
        when the loss is back within the band of the pre-onset baseline."""
        inc = self._incidents[self._current]
        for f in findings:
            if f.anomaly and len(inc.evidence) < MAX_EVIDENCE:
                inc.evidence.append(_evidence(rec, f))
        recent = self._ep.setdefault("verify_recent", [])
        if not math.isfinite(rec.loss):
            recent.clear()  # a non-finite loss is not "back in band"; the median must never see it
            return
        recent.append(rec.loss)
        if len(recent) > self.cfg.verify_recent_steps:
            del recent[0]
        base = self._ep.get("baseline")
        if len(recent) == self.cfg.verify_recent_steps and (base is None or median_of(recent) <= base * (1 + self.cfg.verify_tolerance)):
            # forget the damaged stretch (as a restore would have): it must not be judged again
            self.engine.rewind(inc.onset_step - 1)
            self._close("healthy", rec.step, f"dry run: loss {median_of(recent):.4g} back within band of {base:.4g} (nothing was rolled back)")

    def _pick_target(self, onset: int) -> int | None:
        """The newest checkpoint at least ``rollback_margin_steps`` before the onset, else the oldest
        one before it. Strictly before: a checkpoint of step N holds the weights after step N's
        update, so one of the onset step may already carry the damage first seen there. Never one
        of a branch a later timeline abandoned."""
        steps = sorted(s for s, c in self._checkpoints.items() if s < onset and not self._abandoned(c))
        margin_ok = [s for s in steps if s <= onset - self.cfg.rollback_margin_steps]
        if margin_ok:
            return margin_ok[-1]
        return steps[0] if steps else None

    def _recovered_why(self, rec: StepRecord) -> str:
        lvl = self.engine.loss_level()
        base = self._ep.get("baseline")
        return (f"recovered: {rec.step - self._ep['last']} quiet steps, loss level {lvl:.4g} vs {base:.4g} before the onset; "
                "no rollback (the sample ids stay on record as suspects)") if lvl is not None and base is not None \
            else "recovered: no further anomalies"

    def _verify_deadline(self, inc: Incident) -> int:
        """The step by which the loss must be back: ``verify_window_steps`` past the bad region. Counted
        from the detection (or the restore, if later), not from the restore alone: a checkpoint far
        before the onset replays a long healthy stretch first, and its own (higher, on a falling
        curve) losses must not use up the window before the replay even reaches the onset."""
        return max(self._ep["verify_from"], inc.detect_step) + self.cfg.verify_window_steps

    def _verify(self, rec: StepRecord, out: list[Action]) -> None:
        ep = self._ep
        inc = self._incidents[self._current]
        if not math.isfinite(rec.loss):
            # damage, not a number to take a median of (sorted() with a NaN returns a finite middle)
            self._escalate(f"non-finite loss ({rec.loss}) at step {rec.step} during recovery verification after the "
                           f"rollback to step {inc.rollback_to}", out, rec.step)
            return
        recent = ep["verify_recent"]
        recent.append(rec.loss)
        k = self.cfg.verify_recent_steps
        if len(recent) > k:
            del recent[0]
        base = ep.get("baseline")
        deadline = self._verify_deadline(inc)
        in_band = base is None or median_of(recent) <= base * (1 + self.cfg.verify_tolerance)
        past_bad_region = rec.step > inc.detect_step or rec.step >= deadline
        base_txt = "unknown" if base is None else f"{base:.4g}"
        if in_band and past_bad_region:
            self._close("healthy", rec.step, f"recovered: loss {median_of(recent):.4g} within band of baseline {base_txt} at step {rec.step}")
        elif rec.step >= deadline:
            self._escalate(f"loss did not come back within {self.cfg.verify_window_steps} steps past the bad region "
                           f"(detection at step {inc.detect_step}, restored step {ep['verify_from']}; "
                           f"recent {median_of(recent):.4g} vs baseline {base_txt})", out, rec.step)

    def _escalate(self, why: str, out: list[Action], step: int | None) -> None:
        inc = self._incidents.get(self._current) if self._current else None
        if inc is None:  # escalation outside an incident (should not happen): open one to carry it
            iid = f"{self.run}-t{self.timeline}-s{step}-esc"
            inc = Incident(id=iid, run=self.run, state="escalated", rule="policy", onset_step=step or 0,
                           detect_step=step or 0, opened_at=self.clock())
            self._incidents[iid] = inc
            self._current = iid
        self._set_state("escalated", inc)
        self._event("escalated", "critical", f"automation stopped for run {self.run}: {why}", step=step, incident_id=inc.id)
        out.append(self._incident_action(inc, "pause", f"escalated: {why}"))
        out.append(self._incident_action(inc, "page", f"escalated: {why}"))
        if self.dry_run and not self._ep.get("held"):
            # nothing was paused: keep watching, but as this one incident until the loss is back
            self._hold_open(inc, "dry run: would pause and page")

    def _close(self, state: str, step: int | None, why: str) -> None:
        inc = self._incidents[self._current]
        self._set_state(state, inc)
        self._stamp_closed(inc, step, why)
        if state == "recovered":  # the spike's samples stay on record as suspects (not skipped)
            ids = self._sample_ids_between(self._ep.get("onset", 0), self._ep.get("last", -1))  # steps are >= 0
            inc.suspects = merge_ranges(ids_to_ranges(ids))
        self._event("incident_closed", "info", why, step=step, incident_id=inc.id)
        self._current, self._ep = None, {}
        self._state = "healthy"

    def _stamp_closed(self, inc: Incident, step: int | None, why: str) -> None:
        """Close ``inc`` now, recording at which step and why on the incident itself: the
        ``incident_closed`` event says so too, but events live only on the bus, and an outcome read
        back from the run dir's mirror must still show its evidence."""
        inc.closed_at = self.clock()
        inc.closed_step, inc.close_reason = step, why

    def _sample_ids_between(self, lo: int, hi: int) -> list[int]:
        """The sample ids of the remembered steps in [lo, hi], oldest first. The steps arrive in
        order (a rollback drops the later ones before the new ones come), so the walk back from the
        newest stops at the first step before ``lo``: an incident reads a few dozen steps, not the
        whole history (2048 steps x the batch; ~1 ms a read). A history that ever came out of
        order is scanned whole, as before."""
        if not self._samples_in_order:
            return [i for s, ids in self._samples if lo <= s <= hi for i in ids]
        picked = []
        for s, ids in reversed(self._samples):
            if s < lo:
                break
            if s <= hi:
                picked.append(ids)
        return [i for ids in reversed(picked) for i in ids]

    def _set_state(self, state: str, inc: Incident) -> None:
        inc.state = state
        self._state = state

    # ------------------------------------------------------------------ actions, events, cooldowns

    def _incident_action(self, inc: Incident, kind: str, reason: str, **kw) -> Action:
        n = sum(1 for a in inc.actions if a["kind"] == kind) + 1
        act = Action(kind=kind, run=self.run, incident_id=inc.id, reason=reason,
                     idempotency_key=f"{self.run}:{inc.id}:{kind}:{n}", **kw)
        inc.actions.append({**act.model_dump(mode="json"), "time": self.clock(), "dry_run": self.dry_run})
        return act

    def _operational(self, f: Finding, out: list[Action]) -> None:
        if self._state == "escalated" and f.action in DIRECTIVE_KINDS:
            return  # hands off: a human owns this run now
        iid = self._open_hang(f) if f.rule == "heartbeat_stale" else None
        out.append(Action(kind=f.action, run=self.run, incident_id=iid, reason=f"{f.rule}: {f.detail}",
                          idempotency_key=f"{self.run}:{f.rule}:{f.action}:t{self.timeline}:s{f.step}"))

    # a hang is an incident of its own: the run makes no progress, whatever the anomaly state machine is
    # doing; it does not touch that machine, and closes by itself when steps flow again
    def _open_hang(self, f: Finding) -> str:
        if self._hang is None:
            now = self.clock()
            iid = f"{self.run}-t{self.timeline}-s{f.step}-hang-{int(now)}"
            self._incidents[iid] = Incident(
                id=iid, run=self.run, state="incident", rule=f.rule, onset_step=f.step or 0, detect_step=f.step or 0,
                opened_at=now, evidence=[{"rule": f.rule, "detail": f.detail, "step": f.step, "stale_seconds": f.value,
                                          "last_step_time": now - (f.value or 0.0)}])
            self._hang = iid
            self._event("incident_opened", "critical", f"run not progressing: {f.detail}", step=f.step, incident_id=iid)
        return self._hang

    def _end_hang(self, rec: StepRecord) -> None:
        inc = self._incidents.get(self._hang)
        if inc is not None and rec.time <= inc.evidence[0].get("last_step_time", 0.0):
            return  # a record from before the hang (a backlog being replayed)
        self._hang = None
        if inc is not None:
            why = f"steps flow again: step {rec.step} after the hang"
            inc.state = "recovered"
            self._stamp_closed(inc, rec.step, why)
            self._event("incident_closed", "info", why, step=rec.step, incident_id=inc.id)

    def _emit(self, out: list[Action]) -> list[Action]:
        """Record every action as an event; a dry run returns none of them."""
        for a in out:
            self._event("action", "warning" if a.kind != "page" else "info", f"{a.kind}: {a.reason}",
                        step=self.last_step, incident_id=a.incident_id, data={"action": a.model_dump(mode="json"), "dry_run": self.dry_run})
        return [] if self.dry_run else out

    def _cooled(self, f: Finding, step: int | None, now: float | None = None) -> bool:
        """True when the rule may speak now; records the firing."""
        cfg = self._rule_cfg.get(f.rule)
        now = self.clock() if now is None else now
        last = self._last_fire.get(f.rule)
        if cfg is not None and last is not None:
            ls, lt = last
            if cfg.cooldown_steps and step is not None and ls is not None and step - ls < cfg.cooldown_steps:
                return False
            # a clock that stepped back (NTP) gives a negative elapsed time: not "still cooling down"
            # (that would silence a page for as long as the step), so the cooldown restarts from now
            if cfg.cooldown_seconds and lt is not None and 0 <= now - lt < cfg.cooldown_seconds:
                return False
        self._last_fire[f.rule] = [step, now]
        return True

    def _event(self, kind: str, severity: str, message: str, *, step: int | None = None, incident_id: str | None = None,
               data: dict | None = None) -> None:
        self._events.append(Event(run=self.run, kind=kind, severity=severity, step=step, message=message,
                                  incident_id=incident_id, data=data or {}, time=self.clock()))

    # ------------------------------------------------------------------ persistence

    def restore_samples(self, records) -> None:
        """Rebuild the sample-id history from step-stream records (oldest first), so ``state_dict``
        need not carry it: the daemon persists state on every poll, and the ids are already in the
        stream. Timeline markers drop the samples of the steps they abandoned."""
        self._samples.clear()
        for r in records:
            if isinstance(r, TimelineRecord):
                while self._samples and self._samples[-1][0] > r.from_step:
                    self._samples.pop()
            elif isinstance(r, StepRecord) and r.sample_ids:
                self._samples.append((r.step, r.sample_ids))
        self._samples_in_order = _in_order(self._samples)

    def state_dict(self, include_samples: bool = True) -> dict[str, Any]:
        """Everything needed to continue exactly where this policy is, as plain JSON.

        ``include_samples=False`` leaves out the sample-id history (up to ``sample_history_steps``
        steps x batch ids: the bulk of the state); restore it with ``restore_samples``."""
        return {
            "version": 1,
            "run": self.run,
            "state": self._state,
            "timeline": self.timeline,
            "last_step": self.last_step,
            "last_time": self.last_time,
            "incidents": [i.model_dump(mode="json") for i in self.recent_incidents()],
            "current": self._current,
            "episode": self._ep,
            "pending": self._pending,
            "checkpoints": [c.model_dump(mode="json") for c in self._checkpoints.values()],
            "samples": [[s, [list(r) for r in ids_to_ranges(ids)]] for s, ids in self._samples] if include_samples else None,
            "rollback_log": self._rollback_log,
            "steps_seen": self.steps_seen,
            "episodes": list(self._episodes),
            "pattern": self.pattern,
            "last_fire": self._last_fire,
            "hang": self._hang,
            "rebaselined_at": self._rebaselined_at,
            "forks": [list(f) for f in self._forks],
            "engine": self.engine.state_dict(),
            "events": [e.model_dump(mode="json") for e in self._events],
            "later": self._later,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Continue from ``state_dict``'s output. The state is input too (a bus key anyone with write
        access can set, or one a bug or another version wrote): every field is checked for its type
        and its bounds, and for agreement with the others, and a ValueError says which one failed
        (the caller then starts afresh). Before, a state name of 5 or a timeline ahead of the run
        silently ended the run's judging, and a ranges list of 10^12 ids was expanded into memory."""
        self._init_state()
        state = d["state"]
        if state not in _STATES:
            raise ValueError(f"state {str(state)[:40]!r} is not a state")
        self._state = state
        self.timeline = _bounded_int(d["timeline"], "timeline")
        last_step, last_time = d["last_step"], d["last_time"]
        self.last_step = None if last_step is None else _bounded_int(last_step, "last_step")
        if last_time is not None and not (isinstance(last_time, (int, float)) and math.isfinite(last_time)):
            raise ValueError("last_time is not a finite number")
        self.last_time = last_time
        self._incidents = {i["id"]: Incident.model_validate(i) for i in d["incidents"]}
        self._current, self._hang = d["current"], d.get("hang")
        for name, iid in (("current", self._current), ("hang", self._hang)):
            if iid is not None and (not isinstance(iid, str) or iid not in self._incidents):
                raise ValueError(f"{name} names no incident of the state")
        if (state == "healthy") != (self._current is None):
            raise ValueError(f"state {state} with current incident {self._current!r}")
        self._ep = dict(d["episode"])
        if state == "suspect" and not all(_is_int(self._ep.get(k)) for k in ("onset", "last")):
            raise ValueError("the open episode has no onset or last step")
        if any(not isinstance(k, str) or isinstance(v, dict) or (isinstance(v, list) and (
                len(v) > 1 << 16 or not all(isinstance(x, (int, float)) for x in v))) for k, v in self._ep.items()):
            raise ValueError("episode holds a value of the wrong kind")
        self._pending = dict(d["pending"])
        if any(not isinstance(k, str) or not isinstance(v, dict) for k, v in self._pending.items()):
            raise ValueError("pending is not a map of incident id to action")
        self._checkpoints = {c["step"]: CheckpointInfo.model_validate(c) for c in d["checkpoints"]}
        budget = self.cfg.sample_history_steps * MAX_SAVED_IDS_PER_STEP
        for s, ranges in d.get("samples") or []:
            n = 0
            for lo, hi in ranges:
                if not (_is_int(lo) and _is_int(hi) and 0 <= lo <= hi):
                    raise ValueError("samples hold a range that is not 0 <= lo <= hi")
                n += hi - lo
            budget -= n
            if budget < 0:  # the daemon saves none (they are read back from the stream): a hostile list
                raise ValueError(f"samples hold more than {self.cfg.sample_history_steps * MAX_SAVED_IDS_PER_STEP} ids")
            self._samples.append((_bounded_int(s, "samples step"), [i for lo, hi in ranges for i in range(lo, hi)]))
        self._samples_in_order = _in_order(self._samples)
        self._rollback_log = [[float(t), float(n)] for t, n in d.get("rollback_log", [])]
        self.steps_seen = _bounded_int(d.get("steps_seen", 0), "steps_seen")
        episodes = d.get("episodes", [])
        if not isinstance(episodes, list) or any(not isinstance(e, dict) for e in episodes):
            raise ValueError("episodes is not a list of maps")
        self._episodes.extend(episodes)
        self.pattern = d.get("pattern", "none")
        if self.pattern not in ("none", *SPIKE_PATTERNS):
            raise ValueError(f"pattern {str(self.pattern)[:40]!r} is not a spike pattern")
        self._last_fire = {k: list(v) for k, v in d["last_fire"].items()}
        if any(not isinstance(k, str) or len(v) != 2 or not all(
                x is None or (isinstance(x, (int, float)) and math.isfinite(x)) for x in v) for k, v in self._last_fire.items()):
            raise ValueError("last_fire is not a map of rule to [step, time]")
        rb = d.get("rebaselined_at")
        self._rebaselined_at = int(rb) if rb is not None else None
        self._forks = [[int(t), int(s)] for t, s in d.get("forks", [])]
        self._fork_cut = None
        self.engine.load_state_dict(d["engine"])
        self._events = [Event.model_validate(e) for e in d.get("events", [])]
        later = d.get("later")
        if later is not None:
            if not (isinstance(later, dict) and later.get("incident") in self._incidents
                    and isinstance(later.get("steps"), list) and len(later["steps"]) == 2
                    and all(_is_int(x) for x in later["steps"]) and isinstance(later.get("ranges"), list)
                    and all(isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and 0 <= r[0] <= r[1]
                            for r in later["ranges"])):
                raise ValueError("later is not a follow-up skip of an incident of the state")
            self._later = {"incident": later["incident"], "steps": list(later["steps"]), "ranges": [list(r) for r in later["ranges"]]}


_STATES = frozenset(get_args(IncidentState))
MAX_SAVED_IDS_PER_STEP = 1 << 16  # a saved state's sample history: at most this many ids per remembered step
_MAX_COUNT = 1 << 53  # a step, timeline or count from a saved state: above it, not a number this policy wrote


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bounded_int(x: Any, what: str) -> int:
    if not _is_int(x) or not 0 <= x <= _MAX_COUNT:
        raise ValueError(f"{what} is not a count")
    return x


def _in_order(samples) -> bool:
    """Do the remembered steps never decrease?"""
    prev = None
    for s, _ in samples:
        if prev is not None and s < prev:
            return False
        prev = s
    return True
