"""An incident's way back: the rollback (or the approval it waits for), the follow-up skip of the
steps trained on the damaged branch before the trainer applied it, the verdict on the restored run,
and escalation to a human."""

from __future__ import annotations

import math

from sentinel.detectors import median_of
from sentinel.policy_types import MAX_EVIDENCE, SKIP_LATER_MAX_STEPS, Action, _evidence
from sentinel.protocol import Incident, StepRecord, ids_to_ranges, merge_ranges
from sentinel.rules import Finding


class RecoveryMixin:
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

    def _open_incident(self, inc: Incident, rule: str, why: str, step: int, out: list[Action]) -> None:
        inc.rule = rule
        self._set_state("incident", inc)
        self._event("incident", "critical", f"damage at step {step} (onset {inc.onset_step}): {why}", step=step, incident_id=inc.id)
        self.engine.clear_episode()
        target = self._pick_target(inc.onset_step)
        if target is None:
            self._escalate(f"no checkpoint at or before step {inc.onset_step - 2} (onset {inc.onset_step} - 2) to roll back to", out, step)
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
