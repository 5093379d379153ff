"""The gate between the bus and the policy: only authentic, well-formed, in-order records pass.

Everything on a stream is untrusted input: a local user may have written it (if they can reach
the bus), a bug may have, or a disk may have mangled the AOF. ``StepGate.check`` returns either
the record or a reject reason from ``protocol.REJECT_REASONS``, never raises, and is cheap for
the common case (one HMAC, one JSON parse, a few comparisons).

Order of checks, cheapest and most decisive first: undecodable entry, missing ``json``, MAC
(so unsigned junk is never even parsed), schema, run name, value ranges, then order on the
record's timeline (a step at or below the last one seen on the same timeline is a duplicate or
a replay; a record of an older timeline belongs to a branch a rollback abandoned).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from sentinel.bus import FIELD, Entry
from sentinel.protocol import (
    RECORD_MAC_FIELD,
    Ack,
    SchemaError,
    StepRecord,
    TimelineRecord,
    parse_step_line,
    record_mac_error,
    record_range_error,
)


class Verdict(NamedTuple):
    record: StepRecord | TimelineRecord | Ack | None
    reason: str | None = None  # a REJECT_REASONS value when record is None
    detail: str = ""


def _authentic(entry: Entry, secret: bytes) -> Verdict | str:
    """The entry's JSON text when decodable and MAC-authentic, else a rejecting ``Verdict``."""
    if entry.bad:
        return Verdict(None, entry.bad, f"entry {entry.id} is not UTF-8")
    data = entry.fields.get(FIELD)
    if data is None:
        return Verdict(None, "malformed", f"entry {entry.id} has no '{FIELD}' field")
    why = record_mac_error(secret, entry.stream, data, entry.fields.get(RECORD_MAC_FIELD))
    if why:
        return Verdict(None, why, f"entry {entry.id}: {'no MAC' if why == 'unsigned' else 'MAC does not match'}")
    return data


class StepGate:
    """Validates the step stream of one run; remembers the last step per timeline."""

    def __init__(self, run: str, secret: bytes):
        self.run, self.secret = run, secret
        self.timeline: int | None = None
        self.last_step: int | None = None

    def check(self, entry: Entry) -> Verdict:
        data = _authentic(entry, self.secret)
        if isinstance(data, Verdict):
            return data
        try:
            rec = parse_step_line(data)
        except SchemaError as e:
            return Verdict(None, e.reason, str(e))
        if rec.run != self.run:
            return Verdict(None, "wrong_run", f"entry {entry.id} names run {rec.run[:64]!r}")
        bad = record_range_error(rec)
        if bad:
            return Verdict(None, "out_of_range", f"entry {entry.id}: {bad}")
        if self.timeline is not None and rec.timeline < self.timeline:
            return Verdict(None, "out_of_order", f"entry {entry.id}: timeline {rec.timeline} < current {self.timeline}")
        if isinstance(rec, TimelineRecord):
            self.timeline, self.last_step = rec.timeline, rec.from_step
            return Verdict(rec)
        if not isinstance(rec, StepRecord):  # a marker: it names a step boundary, it is not a step
            return Verdict(rec)
        if rec.timeline == self.timeline and self.last_step is not None and rec.step <= self.last_step:
            if rec.step == self.last_step:
                return Verdict(None, "duplicate", f"entry {entry.id}: step {rec.step} seen already on timeline {rec.timeline}")
            return Verdict(None, "out_of_order", f"entry {entry.id}: step {rec.step} after step {self.last_step}")
        self.timeline, self.last_step = rec.timeline, rec.step
        return Verdict(rec)

    def state_dict(self) -> dict[str, Any]:
        return {"timeline": self.timeline, "last_step": self.last_step}

    def load_state_dict(self, d: dict[str, Any] | None) -> None:
        d = d or {}
        self.timeline, self.last_step = d.get("timeline"), d.get("last_step")


def check_ack(entry: Entry, run: str, secret: bytes) -> Verdict:
    """Validate one entry of the acks stream (MAC'd by the trainer like step records)."""
    data = _authentic(entry, secret)
    if isinstance(data, Verdict):
        return data
    try:
        ack = Ack.from_json(data)
    except SchemaError as e:
        return Verdict(None, e.reason, str(e))
    if ack.run != run:
        return Verdict(None, "wrong_run", f"ack {entry.id} names run {ack.run[:64]!r}")
    bad = record_range_error(ack)
    if bad:
        return Verdict(None, "out_of_range", f"ack {entry.id}: {bad}")
    return Verdict(ack)
