"""Parsing untrusted JSON: the bounded ``loads``, the one error type and its reject reasons.

``SchemaError.reason`` is one of ``REJECT_REASONS``, a small fixed vocabulary used as a metric label
on both sides of the bus.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic_core import from_json

from sentinel.contract.limits import MAX_JSON_DEPTH, MAX_RECORD_BYTES

# Why each record was refused: a small fixed vocabulary, used as a metric label on both sides.
REJECT_REASONS = (
    "unsigned",  # no MAC / signature
    "bad_signature",  # MAC or signature does not match: forged or altered
    "expired",  # a directive past its expires_at
    "not_utf8",  # a field name or value that is not UTF-8
    "too_large",  # over MAX_RECORD_BYTES
    "too_deep",  # JSON nested deeper than MAX_JSON_DEPTH
    "malformed",  # not JSON, not an object, missing field, wrong type
    "newer_schema",  # written by a newer protocol version
    "out_of_range",  # non-finite where a finite value is required, negative counts, absurd magnitudes
    "wrong_run",  # names another run
    "out_of_order",  # a step older than one already seen on its timeline, or an abandoned timeline
    "duplicate",  # the same step twice on one timeline (a re-delivery, or a replay)
    "replayed",  # a resume/rollback/start record of a timeline already seen: every one opens a new timeline
    "step_jump",  # a step further ahead of the last than any run advances in the time between them
    "future_time",  # a record stamped more than a day ahead of the reader's clock
    "forged_copy",  # a directive's id on another entry: the trainer refused the copy, not the original
    "wrong_type",  # a bus key that holds another Redis type than this protocol's (set by someone else)
    "no_lease",  # a leader key with no TTL or of another type: it would hold the run's lease forever
    "internal_error",  # a record whose judging raised something unforeseen: skipped, so it cannot stop the run's judging
)


class SchemaError(ValueError):
    """A record could not be parsed against this version of the protocol.

    ``reason`` is one of ``REJECT_REASONS`` (for metrics); the message says what exactly.
    """

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


def _depth_exceeds(obj: Any, limit: int) -> bool:
    """True when ``obj`` nests containers deeper than ``limit`` (iterative: no recursion to exhaust)."""
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if d > limit:
            return True
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values() if isinstance(v, (dict, list)))
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o if isinstance(v, (dict, list)))
    return False


def loads_bounded(data: str | bytes, what: str = "record") -> Any:
    """``json.loads`` for untrusted input: UTF-8 only, at most MAX_RECORD_BYTES and MAX_JSON_DEPTH.

    Every failure is a ``SchemaError`` with a reason; nothing else escapes (a 100,000-deep
    document raises RecursionError inside ``json``, a 5,000-digit number ValueError).
    """
    if isinstance(data, (bytes, bytearray)):
        if len(data) > MAX_RECORD_BYTES:
            raise SchemaError(f"{what}: {len(data)} bytes, over the {MAX_RECORD_BYTES} limit", "too_large")
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise SchemaError(f"{what}: not UTF-8", "not_utf8") from None
    elif not isinstance(data, str):
        raise SchemaError(f"{what}: expected JSON text, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise SchemaError(f"{what}: {len(data)} characters, over the {MAX_RECORD_BYTES} limit", "too_large")
    # pydantic-core's parser first: where it succeeds it gives what json.loads gives (the same floats
    # bit for bit, big ints, the infinities, the last of a repeated key), in a third of the time (a
    # step record: 4.1 against 10.4 us). Where it fails (malformed text, a lone surrogate escape it
    # refuses, nesting past 200) json.loads decides, and says why. A text with a NaN goes to json.loads
    # too: its NaN is one object, so two states that hold it compare equal (``nan == nan`` is False)
    if "NaN" in data:
        obj = _loads_or_why(data, what)
    else:
        try:
            obj = from_json(data)
        except ValueError:
            obj = _loads_or_why(data, what)
    # a document with no more opening brackets than the limit cannot nest deeper (a step record has
    # about five): the walk, a tenth of a record's judging, is left for the rest
    if data.count("[") + data.count("{") > MAX_JSON_DEPTH and _depth_exceeds(obj, MAX_JSON_DEPTH):
        raise SchemaError(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH}", "too_deep")
    return obj


def _loads_or_why(data: str, what: str) -> Any:
    """``json.loads``, its failures as a ``SchemaError`` with a reason."""
    try:
        return json.loads(data)
    except RecursionError:
        raise SchemaError(f"{what}: JSON nested too deep", "too_deep") from None
    except ValueError as e:  # JSONDecodeError, and int strings over the digit limit
        raise SchemaError(f"{what}: not valid JSON ({getattr(e, 'msg', None) or str(e)[:80]})") from None


_PLAIN = {  # pydantic's error types, in the words of a config or a log line's reader
    "extra_forbidden": "unknown key",
    "model_type": "expected a mapping", "dict_type": "expected a mapping", "model_attributes_type": "expected a mapping",
    "list_type": "expected a list", "tuple_type": "expected a list",
    "float_parsing": "expected a number", "float_type": "expected a number", "finite_number": "expected a finite number",
    "int_parsing": "expected an integer", "int_type": "expected an integer", "int_from_float": "expected an integer",
    "int_parsing_size": "expected an integer of at most 4,300 digits",
    "bool_parsing": "expected true or false", "bool_type": "expected true or false",
    "string_type": "expected a string", "missing": "missing (required)",
}


def plain_error(err: dict) -> str:
    """One pydantic error (``ValidationError.errors()[i]``) as the words a person reads: "unknown
    key", "expected a number", not "Extra inputs are not permitted" or "Input should be a valid
    dictionary or instance of LossSpikeRule". A true/false where a number goes says so."""
    typ, value = err.get("type", ""), err.get("input")
    if isinstance(value, bool) and typ in ("greater_than_equal", "greater_than", "less_than_equal", "less_than",
                                           "float_type", "int_type", "multiple_of"):
        return f"expected a number, not {str(value).lower()}"
    msg = _PLAIN.get(typ) or str(err.get("msg", "invalid")).removeprefix("Value error, ")
    return msg



def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def finite_or_none(x: Any) -> float | None:
    """``x`` as a finite float, else None: for numbers in free-form dicts read from files ("x", a
    list, a bool, NaN, an integer too big for a float)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        f = float(x)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None
