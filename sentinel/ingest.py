"""The gate between the bus and the policy: only authentic, well-formed, in-order records pass.

Everything on a stream is untrusted input: a local user may have written it (if they can reach
the bus), a bug may have, or a disk may have mangled the AOF. ``StepGate.check`` returns either
the record or a reject reason from ``protocol.REJECT_REASONS``, never raises, and is cheap for
the common case (one HMAC, one JSON parse, a few comparisons).

Order of checks, cheapest and most decisive first: undecodable entry, missing ``json``, MAC
(so unsigned junk is never even parsed), schema, run name, value ranges, then order on the
record's timeline (a step at or below the last one seen on the same timeline is a duplicate or
a replay; a record of an older timeline belongs to a branch a rollback abandoned).

The MAC binds a record to its run's stream, not to its place in it: a copy of a genuine record
verifies. So order is what refuses replays: every start, resume and rollback opens a new timeline
(the trainer numbers them previous + 1), and a copy of one that was seen already would reset the
detectors; a marker names the boundary after the last step. Plausibility bounds what one signed
record can do to the gate (a buggy writer's step 2**52 would refuse every genuine step after it):
a step may run ahead of the last by at most ``MAX_STEP_RATE`` per second between their stamps,
and no record may be stamped more than ``MAX_FUTURE_S`` ahead of the reader's clock.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from sentinel.bus import FIELD, Entry
from sentinel.protocol import (
    RECORD_MAC_FIELD,
    Ack,
    MarkerRecord,
    SchemaError,
    StepRecord,
    TimelineRecord,
    parse_step_line,
    record_mac_error,
    record_range_error,
)

MAX_STEP_RATE = 1_000_000  # steps per second of record time, and the jump allowed at no time apart
MAX_FUTURE_S = 86_400.0


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


def is_authentic(entry: Entry, secret: bytes) -> bool:
    """True when the entry carries a record its writer MAC'd with ``secret`` (nothing else is checked)."""
    return not isinstance(_authentic(entry, secret), Verdict)


def furthest_position(entries, run: str, secret: bytes) -> tuple[int, int] | None:
    """The furthest (timeline, step) any authentic, well-formed record of ``run`` among ``entries``
    stands at (a start, resume or rollback at its ``from_step``), or None when there is none. A
    gate or policy position saved beyond it was written by someone else: the trainer made no such
    record."""
    best = None
    for entry in entries:
        data = _authentic(entry, secret)
        if isinstance(data, Verdict):
            continue
        try:
            rec = parse_step_line(data)
        except SchemaError:
            continue
        if rec.run != run or record_range_error(rec):
            continue
        pos = (rec.timeline, rec.from_step if isinstance(rec, TimelineRecord) else rec.step)
        best = pos if best is None or pos > best else best
    return best


class StepGate:
    """Validates the step stream of one run; remembers the last step per timeline."""

    def __init__(self, run: str, secret: bytes):
        self.run, self.secret = run, secret
        self.timeline: int | None = None
        self.last_step: int | None = None
        self.last_time: float | None = None  # the stamp of the last accepted step or timeline record
        self._marker_at: tuple[int, int] | None = None  # the boundary (timeline, step) of the last marker
        self._markers: set[str] = set()  # ... and the kinds seen there

    def check(self, entry: Entry, now: float | None = None) -> Verdict:
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
        if rec.time > (time.time() if now is None else now) + MAX_FUTURE_S:
            return Verdict(None, "future_time", f"entry {entry.id}: stamped {rec.time:.0f}, more than a day ahead")
        if isinstance(rec, TimelineRecord):
            return self._timeline(entry, rec)
        if self.timeline is not None and rec.timeline < self.timeline:
            return Verdict(None, "out_of_order", f"entry {entry.id}: timeline {rec.timeline} < current {self.timeline}")
        if isinstance(rec, MarkerRecord):
            return self._marker(entry, rec)
        if rec.timeline == self.timeline and self.last_step is not None:
            if rec.step <= self.last_step:
                if rec.step == self.last_step:
                    return Verdict(None, "duplicate", f"entry {entry.id}: step {rec.step} seen already on timeline {rec.timeline}")
                return Verdict(None, "out_of_order", f"entry {entry.id}: step {rec.step} after step {self.last_step}")
            if self.last_time is not None and \
                    rec.step - self.last_step > MAX_STEP_RATE * (1.0 + max(0.0, rec.time - self.last_time)):
                return Verdict(None, "step_jump", f"entry {entry.id}: step {rec.step} after step {self.last_step}, "
                                                  f"{max(0.0, rec.time - self.last_time):.0f} s later")
        self._advance(rec.timeline, rec.step, rec.time)
        return Verdict(rec)

    def _timeline(self, entry: Entry, rec: TimelineRecord) -> Verdict:
        """A start, resume or rollback: a new timeline, or a replay of one seen already. The one
        exception is a run name used again from scratch: a start stamped after everything seen."""
        if self.timeline is not None and rec.timeline <= self.timeline \
                and not (rec.kind == "start" and rec.time > (self.last_time or 0.0)):
            return Verdict(None, "replayed", f"entry {entry.id}: {rec.kind} of timeline {rec.timeline}, "
                                             f"and timeline {self.timeline} was seen already")
        self._advance(rec.timeline, rec.from_step, rec.time)
        return Verdict(rec)

    def _marker(self, entry: Entry, rec: MarkerRecord) -> Verdict:
        """A marker names the boundary after the last step: one of each kind there."""
        if rec.timeline == self.timeline and self.last_step is not None and rec.step < self.last_step:
            return Verdict(None, "out_of_order", f"entry {entry.id}: {rec.marker} marker at step {rec.step} after step {self.last_step}")
        at = (rec.timeline, rec.step)
        if at != self._marker_at:
            self._marker_at, self._markers = at, set()
        elif rec.marker in self._markers:
            return Verdict(None, "duplicate", f"entry {entry.id}: {rec.marker} marker at step {rec.step} seen already")
        self._markers.add(rec.marker)
        return Verdict(rec)

    def _advance(self, timeline: int, step: int, t: float) -> None:
        self.timeline, self.last_step, self.last_time = timeline, step, t

    def state_dict(self) -> dict[str, Any]:
        return {"timeline": self.timeline, "last_step": self.last_step, "last_time": self.last_time}

    def load_state_dict(self, d: dict[str, Any] | None) -> None:
        d = d or {}
        self.timeline, self.last_step, self.last_time = d.get("timeline"), d.get("last_step"), d.get("last_time")
        self._marker_at, self._markers = None, set()


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
