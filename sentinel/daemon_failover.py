"""A new leader acts as the first one would have.

At the start of its term it learns which events are on the bus already (a replay of the backlog
derives some again: each is published once, by its idempotency key) and sends what the previous
leader decided and saved but did not get to send. While a rollback is out, each step record is
compared with the rollback's directive entry: a step published before it was trained before the
trainer could apply the rollback (backlog, not a rollback that was never applied).
"""

from __future__ import annotations

import json
import time

from sentinel import bus
from sentinel.daemon_options import DIRECTIVE_TTL_S, EVENT_KEYS_KEPT, _stream_id_tuple
from sentinel.policy import DIRECTIVE_KINDS, Action
from sentinel.protocol import Incident


class FailoverMixin:
    def _on_leadership(self) -> None:
        """A new term: learn which events are on the bus already (a replay derives some again), and
        send what the previous leader decided and saved but did not get to send."""
        self._event_keys.clear()
        # a replay re-derives only what came after the saved state: the events since then (and a
        # minute before it, for clocks apart) are the ones it could publish twice
        since = "-" if self._saved_at is None else f"{max(0, int((self._saved_at - 60.0) * 1000))}-0"
        for _, f in reversed(bus.raw(self.r).xrevrange(self.keys.events, min=since, count=EVENT_KEYS_KEPT)):
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
