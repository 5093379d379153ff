"""Range checks of records read from untrusted transport: numbers no trainer of ours can produce.

A record that parses can still be absurd (a step of 10**60, a -inf loss, a negative token count):
``record_range_error`` says what, and the reader rejects it with the ``out_of_range`` reason.
"""

from __future__ import annotations

import math
from operator import attrgetter

from sentinel.contract.limits import MAX_COUNT, MAX_MAGNITUDE, MAX_STEP, MAX_TIMELINE
from sentinel.contract.records import Ack, Event, Incident, MarkerRecord, StepRecord, TimelineRecord

_NONFINITE_OK = ("loss", "loss_max_rank", "grad_norm", "val_loss", "val_ppl")  # NaN/+inf are real signals here


def _bad_float(name: str, x: float, *, nonfinite_ok: bool) -> str | None:
    if math.isnan(x) or x == math.inf:
        return None if nonfinite_ok else f"{name} is not finite"
    if not (0.0 <= x <= MAX_MAGNITUDE):
        return f"{name}={x!r} is out of range"
    return None


def _bad_int(name: str, x: int, lo: int, hi: int) -> str | None:
    if lo <= x <= hi:
        return None
    shown = str(x) if -10**30 < x < 10**30 else f"<a {x.bit_length()}-bit {'negative ' if x < 0 else ''}number>"  # one short line
    return f"{name}={shown} is out of range [{lo}, {hi}]"


_STEP_INTS = (("step", 0, MAX_STEP), ("timeline", 0, MAX_TIMELINE), ("tokens", 0, MAX_COUNT),
              ("batch_tokens", 0, MAX_COUNT), ("world_size", 1, 1 << 24))
_STEP_FLOATS = ("loss", "loss_max_rank", "grad_norm", "lr", "time", "step_seconds", "tokens_per_second", "mfu",
                "val_loss", "val_ppl", "checkpoint_age_seconds", "effective_token_ratio")


_STEP_INTS_OF = attrgetter(*(name for name, _, _ in _STEP_INTS))  # one C call for the lot
_STEP_BOUNDS = tuple((lo, hi) for _, lo, hi in _STEP_INTS)
_STEP_FLOATS_OF = attrgetter(*_STEP_FLOATS)


def _step_in_range(rec: StepRecord) -> bool:
    """True when every number of a step record passes the plain comparison (a NaN fails it): the
    daemon reads thousands a second, and all but a forger's pass. False decides nothing:
    ``_step_range_error`` then looks again, and says what, or that a NaN or +inf is allowed there."""
    for x, (lo, hi) in zip(_STEP_INTS_OF(rec), _STEP_BOUNDS):
        if not lo <= x <= hi:
            return False
    ids = rec.sample_ids
    if ids and (min(ids) < 0 or max(ids) > MAX_COUNT):  # min/max in C: a step carries the batch's ids
        return False
    for x in _STEP_FLOATS_OF(rec):
        if x is not None and not 0.0 <= x <= MAX_MAGNITUDE:
            return False
    if rec.rank_losses or rec.rank_step_seconds or rec.phases or rec.rank_phases:  # most loops log none
        for xs in (rec.rank_losses, rec.rank_step_seconds, (rec.phases or {}).values(),
                   [x for ph in rec.rank_phases or () for x in ph.values()]):
            for x in xs or ():
                if not 0.0 <= x <= MAX_MAGNITUDE:
                    return False
    return True


def _step_range_error(rec: StepRecord) -> str | None:
    """The first number of a step record out of range, in field order; None at once where
    ``_step_in_range`` says every number is (a message is built only for a value refused)."""
    if _step_in_range(rec):
        return None
    for name, lo, hi in _STEP_INTS:
        x = getattr(rec, name)
        if not lo <= x <= hi:
            return _bad_int(name, x, lo, hi)
    ids = rec.sample_ids
    if ids and (min(ids) < 0 or max(ids) > MAX_COUNT):
        return next(_bad_int("sample_ids", i, 0, MAX_COUNT) for i in ids if not 0 <= i <= MAX_COUNT)
    for name in _STEP_FLOATS:
        x = getattr(rec, name)
        if x is not None and not 0.0 <= x <= MAX_MAGNITUDE:  # NaN fails it too: _bad_float says whether that is allowed
            bad = _bad_float(name, x, nonfinite_ok=name in _NONFINITE_OK)
            if bad:
                return bad
    for name, xs in (("rank_losses", rec.rank_losses), ("rank_step_seconds", rec.rank_step_seconds),
                     ("phases", (rec.phases or {}).values()),
                     ("rank_phases", [x for ph in rec.rank_phases or () for x in ph.values()])):
        for x in xs or ():
            bad = _bad_float(name, x, nonfinite_ok=name == "rank_losses")
            if bad:
                return bad
    return None


def record_range_error(rec: object) -> str | None:
    """None when every number in a step/timeline/ack/event/incident record is plausible, else what is not.

    A NaN or +inf loss or grad norm is legitimate (that is what the NaN rule watches for); a
    negative one, -inf, a finite value beyond float32, a negative step or count, or a non-finite
    time or learning rate can only come from a bug or a forger.
    """
    if isinstance(rec, StepRecord):
        return _step_range_error(rec)
    checks: list[str | None] = []
    if isinstance(rec, TimelineRecord):
        checks += [_bad_int("from_step", rec.from_step, 0, MAX_STEP), _bad_int("timeline", rec.timeline, 0, MAX_TIMELINE),
                   _bad_float("time", rec.time, nonfinite_ok=False)]
        checks += [f"skip range {lo}:{hi} is out of range" for lo, hi in rec.skip_ranges if not 0 <= lo < hi <= MAX_COUNT][:1]
    elif isinstance(rec, MarkerRecord):
        checks += [_bad_int("step", rec.step, 0, MAX_STEP), _bad_int("timeline", rec.timeline, 0, MAX_TIMELINE),
                   _bad_float("time", rec.time, nonfinite_ok=False)]
    elif isinstance(rec, Incident):  # the daemon's own record, but read back from a file or a shared bus
        checks += [_bad_int(name, x, 0, MAX_STEP) for name, x in (("onset_step", rec.onset_step),
                   ("detect_step", rec.detect_step), ("rollback_to", rec.rollback_to), ("closed_step", rec.closed_step))
                   if x is not None]
        checks += [_bad_float(name, x, nonfinite_ok=False) for name, x in (("opened_at", rec.opened_at),
                   ("closed_at", rec.closed_at)) if x is not None]
        checks += [f"skip range {lo}:{hi} is out of range" for lo, hi in rec.skip_ranges + rec.suspects
                   if not 0 <= lo < hi <= MAX_COUNT][:1]
    elif isinstance(rec, (Ack, Event)):
        if rec.step is not None:
            checks.append(_bad_int("step", rec.step, 0, MAX_STEP))
        checks.append(_bad_float("time", rec.time, nonfinite_ok=False))
    return next((c for c in checks if c), None)
