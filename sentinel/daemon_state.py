"""A run watcher's saved state: what a successor needs to go on exactly where the leader was.

One JSON string on the bus (``Keys.policy``): the policy's state, the stream positions read, the
step gate, the directives sent (id -> stream entry: only their acks are verdicts), the rollback
entries of open incidents (``RunPolicy.on_step``'s ``predates_rollback``) and the open pages. It is
written after every poll that changed something (when only step records did, at most every
``Options.state_save_s``: the entries judged since stay pending, and a successor judges them again),
and always before a directive or page is sent (the decision first: a leader that dies after it
leaves it to its successor). Every field is checked before any is taken: a half-loaded state is
worse than none.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict

from sentinel import bus
from sentinel.daemon_options import _STREAM_ID, SENT_SAVED, _count, _finite
from sentinel.ingest import StepGate, Verdict, furthest_position
from sentinel.policy import RunPolicy
from sentinel.protocol import StepRecord, TimelineRecord


class StateMixin:
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
        saved = st.get("saved")
        self._saved_at = float(saved) if isinstance(saved, (int, float)) and math.isfinite(saved) else None
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
        self.r.set(self.keys.policy, self._state_json())

    def _state_json(self) -> str:
        st = {"policy": self.policy.state_dict(include_samples=False), "last_id": self.last_id, "acks_id": self.acks_id,
              "approvals_id": self.approvals_id, "checkpoints_seen": sorted(self.checkpoints_seen),
              "gate": self.gate.state_dict(), "sent": list(self._sent.items())[-SENT_SAVED:], "saved": time.time(),
              "decisions": dict(list(self._decisions.items())[-SENT_SAVED:]), "pages": self.pager.state_dict()}
        return json.dumps(st)

    def _fresh_policy(self) -> None:
        """Start the run's policy afresh; the checkpoints on the bus are fed to it again at the next
        poll (a fresh policy that knew none would page where a rollback was due)."""
        self.policy = RunPolicy(self.run, self.opts.rules, dry_run=self.opts.dry_run, require_approval=self.opts.require_approval)
        self.checkpoints_seen = set()
        self._ckpt_raw = {}
