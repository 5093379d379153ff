"""The versioned records that cross the control bus or land in a run directory (pydantic schemas).

Compatibility rule: ``SCHEMA_VERSION`` is bumped only for breaking changes. Readers ignore unknown
fields (so a newer writer may add fields) and refuse records whose ``v`` is newer than theirs
(``from_json`` and ``parse_step_line`` raise ``SchemaError``).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, field_validator

from sentinel.contract.limits import (
    MAX_CLOCK_SKEW_S,
    MAX_DIRECTIVE_TTL_S,
    MAX_JSON_DEPTH,
    MAX_RECORD_BYTES,
    MAX_SLICES,
    SCHEMA_VERSION,
    SLICE_NAME_RE,
)
from sentinel.contract.parsing import SchemaError, loads_bounded, plain_error
from sentinel.contract.signing import directive_signature, signature_matches


class _Record(BaseModel):
    # ignore unknown fields (forward compatibility); NaN/inf survive JSON as NaN/Infinity
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="constants", frozen=False)
    # strict: a JSON integer, never "1", 1.0 or true (``from_json`` checks the parsed value the same way)
    v: Annotated[int, Strict()] = SCHEMA_VERSION

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def from_json(cls, data: str | bytes | dict[str, Any]):
        obj = data if isinstance(data, dict) else loads_bounded(data, cls.__name__)
        if not isinstance(obj, dict):
            raise SchemaError(f"{cls.__name__}: expected a JSON object")
        v = obj.get("v", SCHEMA_VERSION)
        if type(v) is not int:
            raise SchemaError(f"{cls.__name__}.v: expected an integer schema version")
        if v > SCHEMA_VERSION:
            raise SchemaError(
                f"{cls.__name__}: schema v{v} is newer than this tool's v{SCHEMA_VERSION}; upgrade sentinel", "newer_schema"
            )
        try:
            return cls.model_validate(obj)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "<root>"
            raise SchemaError(f"{cls.__name__}.{loc}: {plain_error(err)}") from None
        except (RecursionError, ValueError, TypeError, OverflowError) as e:  # pydantic internals on hostile input
            raise SchemaError(f"{cls.__name__}: invalid ({e.__class__.__name__})") from None


# --------------------------------------------------------------------------------------------
# Step stream
# --------------------------------------------------------------------------------------------

def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):  # JSON true is no step number (pydantic's lax int would read it as 1)
        raise ValueError("a boolean is not a step number")
    return v


Step = Annotated[int, BeforeValidator(_not_bool)]  # a step or timeline number: an int, 5.0 or "5"; never true

PHASES = ("data_wait", "forward_backward", "optimizer", "telemetry")
# per-rank phases on ``StepRecord.rank_phases``; a rank's busy time is everything but waiting for the
# others (allreduce_wait): in synchronous data parallelism it, not wall time, names a straggler
RANK_PHASES = ("data_wait", "forward_backward", "allreduce_wait", "optimizer")
BUSY_PHASES = ("data_wait", "forward_backward", "optimizer")


def _check_slices(v: dict[str, float] | None) -> dict[str, float] | None:
    if v is None:
        return v
    if len(v) > MAX_SLICES:
        raise ValueError(f"at most {MAX_SLICES} slices (got {len(v)})")
    for name in v:
        if not re.fullmatch(SLICE_NAME_RE, name):
            raise ValueError(f"slice name {name[:40]!r} does not match {SLICE_NAME_RE}")
    return v


class StepRecord(_Record):
    """One optimizer step. Identical fields in ``RUN_DIR/steps.jsonl`` and on the bus.

    ``loss`` is the global mean over ranks of the step's (accumulated) loss; ``grad_norm`` is the
    pre-clip global L2 norm. ``skipped`` means the in-process guard (or a NaN) dropped the update;
    ``skip_reason`` says why. ``sample_ids`` are the global ids of the samples in the global batch, in
    the order they were assigned to (rank, micro-batch) slots.
    """

    kind: Literal["step"] = "step"
    run: str
    step: Step
    timeline: Step = 0
    loss: float
    loss_max_rank: float
    rank_losses: list[float] | None = None
    grad_norm: float
    lr: float
    tokens: int  # cumulative tokens trained (global)
    batch_tokens: int = 0
    batch_fingerprint: str
    sample_ids: list[int] = Field(default_factory=list)
    skipped: bool = False
    skip_reason: str | None = None
    time: float
    param_digest: str | None = None
    # telemetry extras (optional for sentinels and backtests)
    step_seconds: float | None = None
    phases: dict[str, float] | None = None
    rank_step_seconds: list[float] | None = None
    # per rank r: seconds in each of RANK_PHASES (docs/metrics.md, "Per-rank phase times")
    rank_phases: list[dict[str, float]] | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    val_loss: float | None = None
    val_ppl: float | None = None
    checkpoint_age_seconds: float | None = None
    effective_token_ratio: float | None = None
    world_size: int = 1
    # data mixture slices (names match ``SLICE_NAME_RE``; absent sources are omitted)
    source_loss: dict[str, float] | None = None  # mean training loss per source over this step's global batch
    val_slice_loss: dict[str, float] | None = None  # eval steps: held-out loss per slice
    probe_loss: dict[str, float] | None = None  # eval steps: loss on each slice's fixed probe set

    _slices_ok = field_validator("source_loss", "val_slice_loss", "probe_loss")(_check_slices)


class TimelineRecord(_Record):
    """Written to steps.jsonl (and the step stream) when a run resumes or rolls back.

    Every step record after it with ``step > from_step`` supersedes earlier records for the same
    step number: the last record for a step is the authoritative one.
    """

    kind: Literal["resume", "rollback", "start"]
    run: str
    from_step: Step  # the checkpoint step restored (0 for a fresh start)
    checkpoint: str | None = None
    timeline: Step
    time: float
    reason: str | None = None
    directive_id: str | None = None
    skip_ranges: list[tuple[int, int]] = Field(default_factory=list)


MarkerKind = Literal["warmup_end", "decay_start", "mixture_change", "seq_len_change", "run_end"]
MARKER_KINDS: tuple[str, ...] = ("warmup_end", "decay_start", "mixture_change", "seq_len_change", "run_end")


class MarkerRecord(_Record):
    """A change of training conditions at a step boundary, for the timeline ("did the spike come
    right after X?"). Written to steps.jsonl and the step stream; it supersedes nothing.

    ``step`` is the number of optimizer steps completed when the change took effect: the step
    ``step + 1`` is the first one trained under the new condition.

    ``run_end`` says the training process ended on purpose at ``step`` (its last step: the run completed,
    or a stop directive or signal ended it after a checkpoint). A sentinel then stops its clock rules for
    the run (no "trainer hung" page for a run that is over) until a new step, start or resume arrives. A
    crash writes none: silence after a crash is what the heartbeat rule is for.
    """

    kind: Literal["marker"] = "marker"
    run: str
    step: Step
    timeline: Step = 0
    marker: MarkerKind
    detail: str | None = None
    time: float


StepLine = StepRecord | TimelineRecord | MarkerRecord


def parse_step_line(line: str | bytes) -> StepRecord | TimelineRecord | MarkerRecord:
    """Parse one line of steps.jsonl (a step, a resume/rollback timeline record, or a marker).

    A step record is first validated straight from its text (pydantic-core parses and validates
    in one pass: ~17 against 19-24 us a step record of 64 sample ids, alternated in one process; a
    daemon reads thousands a second). What that pass accepts is what the two steps accept (``loads_bounded``, then
    ``from_json``); everything else takes the two steps, which decide and say why: another kind of
    record, any text the pass refuses, a text with a NaN (``loads_bounded`` keeps json.loads's one
    NaN object), one with more brackets than ``MAX_JSON_DEPTH``, a schema newer than ours, and a
    record with a number that is not finite (an integer literal of 309 digits in a float field
    reads as infinite in one pass and is refused by the other)."""
    if type(line) is str and len(line) <= MAX_RECORD_BYTES and "NaN" not in line \
            and line.count("[") + line.count("{") <= MAX_JSON_DEPTH:
        try:
            rec = StepRecord.model_validate_json(line)
        except (ValidationError, ValueError, TypeError, RecursionError, OverflowError):
            pass
        else:
            if rec.v <= SCHEMA_VERSION and _all_finite(rec):
                return rec
    obj = loads_bounded(line, "steps.jsonl line")
    if not isinstance(obj, dict):
        raise SchemaError("steps.jsonl: a line is not a JSON object")
    kind = obj.get("kind", "step")
    if kind == "step":
        return StepRecord.from_json(obj)
    if kind == "marker":
        return MarkerRecord.from_json(obj)
    return TimelineRecord.from_json(obj)


def _float_fields(model: type[BaseModel]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """A model's float fields by shape, read from its annotations (so a field added later is
    checked too): scalars, lists of floats, dicts of floats, lists of dicts of floats. A float in
    any other shape raises at import: ``_all_finite`` would not see it."""
    def bare(t):
        args = [a for a in get_args(t) if a is not type(None)]
        return args[0] if get_origin(t) in (Union, UnionType) and len(args) == 1 else t

    shapes: dict[object, list[str]] = {float: [], list[float]: [], dict[str, float]: [], list[dict[str, float]]: []}
    for name, field in model.model_fields.items():
        t = bare(field.annotation)
        if t in shapes:
            shapes[t].append(name)
        elif "float" in repr(t):
            raise TypeError(f"{model.__name__}.{name}: a float field of a shape _all_finite does not read ({t!r})")
    return tuple(tuple(v) for v in shapes.values())  # type: ignore[return-value]


_STEP_SCALARS, _STEP_LISTS, _STEP_DICTS, _STEP_DICT_LISTS = _float_fields(StepRecord)


def _all_finite(rec: StepRecord) -> bool:
    """True when every float of a step record is finite (a sum is: an inf or a NaN in it is not,
    and a sum of finite floats that overflows only sends a record the slow way)."""
    total = 0.0
    for name in _STEP_SCALARS:
        x = getattr(rec, name)
        if x is not None:
            total += x
    for name in _STEP_LISTS:
        xs = getattr(rec, name)
        if xs:
            total += sum(xs)
    for name in _STEP_DICTS:
        d = getattr(rec, name)
        if d:
            total += sum(d.values())
    for name in _STEP_DICT_LISTS:
        for d in getattr(rec, name) or ():
            total += sum(d.values())
    return math.isfinite(total)


def authoritative_steps(records) -> dict[int, StepRecord]:
    """Reduce a steps.jsonl sequence to the authoritative record per step (last one wins).
    Markers are ignored: they describe conditions, not steps."""
    out: dict[int, StepRecord] = {}
    for r in records:
        if isinstance(r, StepRecord):
            out[r.step] = r
        elif isinstance(r, TimelineRecord):
            # a rollback/resume invalidates every record after the restored step
            for s in [s for s in out if s > r.from_step]:
                del out[s]
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------------------------
# Control: directives and acks
# --------------------------------------------------------------------------------------------

DirectiveKind = Literal["skip-samples", "rollback", "checkpoint-now", "pause", "resume", "stop"]



class Directive(_Record):
    """A signed command to a trainer. ``sig`` is HMAC-SHA256 over the canonical body."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    run: str
    kind: DirectiveKind
    # skip-samples / rollback: inclusive-exclusive sample-id ranges [lo, hi)
    ranges: list[tuple[int, int]] = Field(default_factory=list)
    # rollback target: a checkpoint step (the trainer picks that checkpoint exactly)
    to_step: int | None = None
    # rollback: the trainer also skips the samples it trained after this step on its current timeline (the
    # damaged branch past the detection), with the rollback itself: no follow-up directive has to reach it
    skip_after: int | None = None
    reason: str | None = None
    incident_id: str | None = None
    issuer: str = "sentinel"
    issued_at: float = Field(default_factory=time.time)
    expires_at: float | None = None
    sig: str | None = None

    def canonical(self) -> bytes:
        # skip_after is signed when set; a directive without it signs as it did before the field existed
        body = self.model_dump(exclude={"sig"} if self.skip_after is not None else {"sig", "skip_after"}, mode="json")
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, secret: bytes) -> Directive:
        return self.model_copy(update={"sig": directive_signature(secret, self.canonical())})

    def verify(self, secret: bytes, now: float | None = None) -> str | None:
        """Return None when authentic and current, else a short reason for rejection."""
        if not self.sig:
            return "unsigned"
        if not signature_matches(directive_signature(secret, self.canonical()), self.sig):
            return "bad signature"
        if not math.isfinite(self.issued_at) or (self.expires_at is not None and not math.isfinite(self.expires_at)):
            return "bad expiry"  # NaN compares false with now: it would never expire
        if self.expires_at is not None and self.expires_at - self.issued_at > MAX_DIRECTIVE_TTL_S:
            return "expiry too far ahead"  # a command must not wait days for a trainer that restarts
        now = now if now is not None else time.time()
        if self.issued_at > now + MAX_CLOCK_SKEW_S:
            return "issued in the future"  # else a skewed or captured directive stays valid for months
        if self.expires_at is not None and now > self.expires_at:
            return "expired"
        return None


class Ack(_Record):
    run: str
    directive_id: str
    kind: DirectiveKind | Literal["unknown"]
    status: Literal["applied", "rejected", "failed", "duplicate"]
    step: Step  # the step boundary at which it was handled (after a rollback: the restored step)
    timeline: Step = 0
    detail: str | None = None
    time: float = Field(default_factory=time.time)
    # the directives-stream entry answered, on a refusal: anyone can XADD a copy of a directive's id
    # with a bad signature, and its "rejected" must not read as the verdict on the signed original
    entry_id: str | None = None


# --------------------------------------------------------------------------------------------
# Events, incidents, checkpoints
# --------------------------------------------------------------------------------------------

Severity = Literal["info", "warning", "critical"]


class Event(_Record):
    """Anything that happened that an operator may want on a timeline (Grafana annotations)."""

    run: str
    kind: str  # e.g. rule_fired, incident_opened, action, escalated, directive_rejected, resume
    severity: Severity = "info"
    step: int | None = None
    message: str
    incident_id: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)
    time: float = Field(default_factory=time.time)


IncidentState = Literal["suspect", "recovered", "incident", "rollback", "verifying", "healthy", "escalated", "awaiting_approval"]


class Incident(_Record):
    id: str
    run: str
    state: IncidentState
    rule: str
    onset_step: int
    detect_step: int
    opened_at: float = Field(default_factory=time.time)
    closed_at: float | None = None
    evidence: list[dict[str, Any]] = Field(default_factory=list)
    actions: list[dict[str, Any]] = Field(default_factory=list)
    rollback_to: int | None = None
    skip_ranges: list[tuple[int, int]] = Field(default_factory=list)
    pattern: str | None = None  # spike episodes of the run: one-off | periodic | increasing (policy._classify)
    suspects: list[tuple[int, int]] = Field(default_factory=list)  # sample ids of a recovered spike (kept, not skipped)
    # why and at which step the policy closed it (RunPolicy._close): the evidence for the outcome,
    # kept on the incident so the run dir's mirror still has it with the bus (and its events) gone
    closed_step: int | None = None
    close_reason: str | None = None


CheckpointVerification = Literal["unverified", "checksum_ok", "resume_verified", "failed"]


class CheckpointInfo(_Record):
    run: str
    step: Step
    path: str
    created: float
    bytes: int
    manifest_sha256: str
    world_size: int
    timeline: Step = 0
    tokens: int = 0
    verified: CheckpointVerification = "checksum_ok"
