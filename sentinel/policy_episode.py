"""Episodes: a spike opens one (suspect), damage turns it into an incident; recovered spikes are
classified (one-off, periodic, increasing)."""

from __future__ import annotations

from statistics import median

from sentinel.policy_types import (
    _PRIORITY,
    MAX_EVIDENCE,
    PATTERN_RANGES,
    SPIKE_STORM,
    Action,
    _evidence,
    _overlap,
)
from sentinel.protocol import Incident, StepRecord, ids_to_ranges, merge_ranges
from sentinel.rules import Finding


class EpisodeMixin:
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
        if same_data or (len(gaps) >= 3 and max(gaps[-3:]) - min(gaps[-3:]) <= max(2, 0.05 * max(gaps[-3:]))):
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

    def _recovered_why(self, rec: StepRecord) -> str:
        lvl = self.engine.loss_level()
        base = self._ep.get("baseline")
        return (f"recovered: {rec.step - self._ep['last']} quiet steps, loss level {lvl:.4g} vs {base:.4g} before the onset; "
                "no rollback (the sample ids stay on record as suspects)") if lvl is not None and base is not None \
            else "recovered: no further anomalies"
