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

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sentinel.policy_episode import EpisodeMixin
from sentinel.policy_lineage import LineageMixin
from sentinel.policy_recovery import RecoveryMixin
from sentinel.policy_state import PolicyStateMixin, pack_ids, unpack_ids
from sentinel.policy_types import (  # noqa: F401 - the policy's public names
    DIRECTIVE_KINDS,
    MAX_EVIDENCE,
    PATTERN_HISTORY,
    SKIP_LATER_MAX_STEPS,
    SPIKE_PATTERNS,
    Action,
    ActionKind,
    Episode,
)
from sentinel.protocol import (
    Ack,
    CheckpointInfo,
    Event,
    Incident,
    MarkerRecord,
    StepRecord,
    TimelineRecord,
)
from sentinel.rules import Finding, RuleEngine, RuleSet

# closed incidents a state carries and a daemon keeps publishing: the newest this many. An 18-day run
# closes thousands (a recovered spike is one); each is on the bus and in the run dir's mirror when it
# closes, and carrying them all made every state save and every incident write grow with the run
RECENT_CLOSED = 64


class RunPolicy(LineageMixin, EpisodeMixin, RecoveryMixin, PolicyStateMixin):
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
        self._ep: Episode = {}  # the open episode (policy_types.Episode)
        self._pending: dict[str, dict] = {}  # incident id -> action awaiting approval
        self._checkpoints: dict[int, CheckpointInfo] = {}
        self._samples: deque[tuple[int, bytes]] = deque(maxlen=self.cfg.sample_history_steps)  # (step, pack_ids(ids))
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
        self.ended: dict[str, Any] | None = None  # the run's run_end marker (step, time, detail) until it trains again

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

    def end_replay(self, why: str) -> None:
        """A backlog replayed as a dry run is over: an incident it held open is history, not live.
        So is one parked for an approval that nobody was asked for (every action of it a dry run)."""
        inc = self._incidents.get(self._current) if self._current else None
        if inc is None:
            return
        if self._ep.get("held") or (self._state == "awaiting_approval" and all(a.get("dry_run") for a in inc.actions)):
            self._pending.pop(inc.id, None)
            self._close("healthy", self.last_step, why)

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
        self.ended = None
        if self._hang is not None:
            self._end_hang(rec)
        later = None
        if rec.sample_ids:
            sm = self._samples
            if sm and rec.step < sm[-1][0]:
                self._samples_in_order = False  # a record out of order: scan the history whole from now on
            sm.append((rec.step, pack_ids(rec.sample_ids)))
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
        self.ended = None
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
        markers (end of warmup, start of decay) only annotate the timeline. ``run_end``: the run is
        over on purpose, so the clock rules rest until it trains again (see ``on_tick``)."""
        if rec.marker == "run_end" and rec.timeline >= self.timeline:
            self.ended = {"step": rec.step, "time": rec.time, "detail": rec.detail}
            self._event("run_ended", "info", f"the run ended at step {rec.step}" + (f" ({rec.detail})" if rec.detail else "")
                        + ": no hang or checkpoint-age alert until it trains again", step=rec.step,
                        incident_id=self._current)
            return self._emit([])
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
        """Clock-driven rules. ``heartbeat_time`` None falls back to the last record's time. A run that
        ended on purpose (a ``run_end`` marker, nothing trained since) is not hung, and its newest
        checkpoint is meant to stay the newest: no clock rule fires for it."""
        if self.ended is not None:
            self.last_findings = []
            return self._emit([])
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

    def _sample_ids_between(self, lo: int, hi: int) -> list[int]:
        """The sample ids of the remembered steps in [lo, hi], oldest first. The steps arrive in
        order (a rollback drops the later ones before the new ones come), so the walk back from the
        newest stops at the first step before ``lo``: an incident reads a few dozen steps, not the
        whole history (2048 steps x the batch; ~1 ms a read). A history that ever came out of
        order is scanned whole, as before."""
        if not self._samples_in_order:
            return [i for s, ids in self._samples if lo <= s <= hi for i in unpack_ids(ids)]
        picked = []
        for s, ids in reversed(self._samples):
            if s < lo:
                break
            if s <= hi:
                picked.append(ids)
        return [i for ids in reversed(picked) for i in unpack_ids(ids)]

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
