"""A run watcher's output: the policy's actions sent as signed directives and pages, its events
published once each, its incidents written to the bus hash and mirrored to the run dir.

Exactly once in effect: the decision is saved first (``_save_state``), then ``HSETNX applied
key`` gates the XADD of its directive. Exactly once in the record: every event carries an
idempotency key (``event_key``), and one already on the bus is not published again.
"""

from __future__ import annotations

import time

from sentinel import bus
from sentinel.daemon_options import (
    DIRECTIVE_TTL_S,
    EVENT_KEYS_KEPT,
    SENT_KEPT,
    event_key,
)
from sentinel.daemon_pages import OPERATIONAL_S
from sentinel.policy import DIRECTIVE_KINDS, SPIKE_PATTERNS, Action
from sentinel.protocol import Directive, Event


class ActionsMixin:
    def _execute(self, actions: list[Action], published_at: float | None) -> None:
        if actions:
            self._next_side_read = 0.0  # its acks (or an operator's answer) are read at the next poll
        for a in actions:
            now = time.time()
            if a.kind in DIRECTIVE_KINDS:
                if self.opts.dry_run:
                    self.m.actions.labels(self.run, a.kind, "dry_run").inc()
                    self.log(f"[{self.run}] DRY RUN: would send {a.kind} ({a.reason})")
                    continue
                skip_after = a.skip_steps[1] if a.kind == "rollback" and a.skip_steps else None
                d = Directive(run=self.run, kind=a.kind, ranges=a.ranges, to_step=a.to_step, reason=a.reason,
                              skip_after=skip_after, incident_id=a.incident_id, issuer=f"sentinel:{self.opts.consumer}",
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
                         + (f", skipping {sum(h - lo for lo, h in a.ranges)} samples" if a.ranges else "") + f": {a.reason}")
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

    def _page_rule(self, a: Action) -> str | None:
        """The rule behind a page: its incident's rule, else the "rule: detail" prefix of an operational page."""
        if a.incident_id:
            inc = self.policy.incident(a.incident_id)
            if inc is not None:
                return inc.rule
        head = a.reason.split(":", 1)[0]
        return head if head in dict(self.opts.rules.rules.items()) else None

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
