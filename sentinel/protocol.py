"""The contract between the trainer and the sentinel.

Versioned schemas for everything that crosses the control bus or lands in a run directory,
plus the Redis key names and directive signing. This module imports nothing of ours, and no
torch, so both ``trainer/`` and ``sentinel/`` (and any third-party tool) can depend on it.

Compatibility rule: ``SCHEMA_VERSION`` is bumped only for breaking changes. Readers ignore
unknown fields (so a newer writer may add fields) and refuse records whose ``v`` is newer than
theirs (``parse_*`` raise ``SchemaError``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

SCHEMA_VERSION = 1


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

MAX_RECORD_BYTES = 1 << 20  # a step record of a 4096-sample global batch is ~60 KB
MAX_JSON_DEPTH = 16  # our records nest 3 deep; Event.data a little more


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
    try:
        obj = json.loads(data)
    except RecursionError:
        raise SchemaError(f"{what}: JSON nested too deep", "too_deep") from None
    except ValueError as e:  # JSONDecodeError, and int strings over the digit limit
        raise SchemaError(f"{what}: not valid JSON ({getattr(e, 'msg', None) or str(e)[:80]})") from None
    if _depth_exceeds(obj, MAX_JSON_DEPTH):
        raise SchemaError(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH}", "too_deep")
    return obj


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


class _Record(BaseModel):
    # ignore unknown fields (forward compatibility); NaN/inf survive JSON as NaN/Infinity
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="constants", frozen=False)
    v: int = SCHEMA_VERSION

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)

    @classmethod
    def from_json(cls, data: str | bytes | dict[str, Any]):
        obj = data if isinstance(data, dict) else loads_bounded(data, cls.__name__)
        if not isinstance(obj, dict):
            raise SchemaError(f"{cls.__name__}: expected a JSON object")
        v = obj.get("v", SCHEMA_VERSION)
        if type(v) is not int:  # noqa: E721 - bool is an int subclass and is not a version
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
# data-mixture slice (source) names: also Prometheus label values, so short and bounded
SLICE_NAME_RE = r"[a-z0-9_]{1,32}"
MAX_SLICES = 16


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


MarkerKind = Literal["warmup_end", "decay_start", "mixture_change", "seq_len_change"]
MARKER_KINDS: tuple[str, ...] = ("warmup_end", "decay_start", "mixture_change", "seq_len_change")


class MarkerRecord(_Record):
    """A change of training conditions at a step boundary, for the timeline ("did the spike come
    right after X?"). Written to steps.jsonl and the step stream; it supersedes nothing.

    ``step`` is the number of optimizer steps completed when the change took effect: the step
    ``step + 1`` is the first one trained under the new condition.
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
    """Parse one line of steps.jsonl (a step, a resume/rollback timeline record, or a marker)."""
    obj = loads_bounded(line, "steps.jsonl line")
    if not isinstance(obj, dict):
        raise SchemaError("steps.jsonl: a line is not a JSON object")
    kind = obj.get("kind", "step")
    if kind == "step":
        return StepRecord.from_json(obj)
    if kind == "marker":
        return MarkerRecord.from_json(obj)
    return TimelineRecord.from_json(obj)


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


MAX_DIRECTIVE_TTL_S = 86_400.0  # a directive that expires later than this after its issue is refused
MAX_CLOCK_SKEW_S = 600.0  # a directive issued later than this ahead of the reader's clock is refused


class Directive(_Record):
    """A signed command to a trainer. ``sig`` is HMAC-SHA256 over the canonical body."""

    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    run: str
    kind: DirectiveKind
    # skip-samples / rollback: inclusive-exclusive sample-id ranges [lo, hi)
    ranges: list[tuple[int, int]] = Field(default_factory=list)
    # rollback target: a checkpoint step (the trainer picks that checkpoint exactly)
    to_step: int | None = None
    reason: str | None = None
    incident_id: str | None = None
    issuer: str = "sentinel"
    issued_at: float = Field(default_factory=time.time)
    expires_at: float | None = None
    sig: str | None = None

    def canonical(self) -> bytes:
        body = self.model_dump(exclude={"sig"}, mode="json")
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    def signed(self, secret: bytes) -> "Directive":
        return self.model_copy(update={"sig": hmac.new(secret, self.canonical(), hashlib.sha256).hexdigest()})

    def verify(self, secret: bytes, now: float | None = None) -> str | None:
        """Return None when authentic and current, else a short reason for rejection."""
        if not self.sig:
            return "unsigned"
        want = hmac.new(secret, self.canonical(), hashlib.sha256).hexdigest()
        # compare bytes: compare_digest refuses str with non-ASCII characters (a forger's choice)
        if not hmac.compare_digest(want.encode(), self.sig.encode("utf-8", "surrogatepass")):
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


# --------------------------------------------------------------------------------------------
# Key names (Redis). Everything for a run lives under one prefix so ACLs can scope it.
# --------------------------------------------------------------------------------------------


class Keys:
    """Redis key names for one run. ``Keys(run).steps`` etc.; ``Keys.RUNS`` is the run registry."""

    PREFIX = f"sentinel:v{SCHEMA_VERSION}"
    RUNS = f"{PREFIX}:runs"  # set of run ids

    MAX_RUN_ID = 256

    def __init__(self, run: str):
        # no control characters either: a run id is printed in every log line and table, and one
        # registered by anyone with bus access must not drive the operator's terminal (escapes)
        if (not run or len(run) > self.MAX_RUN_ID or any(c in run for c in " :{}\n")
                or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in run)):
            raise ValueError(f"invalid run id {run[:64]!r}: use letters, digits, '-', '_' or '.' (at most {self.MAX_RUN_ID})")
        self.run = run
        p = f"{self.PREFIX}:run:{run}"
        self.steps = f"{p}:steps"  # stream of StepRecord / TimelineRecord / MarkerRecord
        self.directives = f"{p}:directives"  # stream of Directive
        self.acks = f"{p}:acks"  # stream of Ack
        self.events = f"{p}:events"  # stream of Event
        self.skiplist = f"{p}:skiplist"  # string: JSON list of [lo, hi) ranges
        self.checkpoints = f"{p}:checkpoints"  # hash step -> CheckpointInfo JSON
        self.incidents = f"{p}:incidents"  # hash id -> Incident JSON
        self.applied = f"{p}:applied"  # hash action idempotency key -> directive id
        self.heartbeat = f"{p}:heartbeat"  # string with TTL: last step + time
        self.leader = f"{p}:leader"  # lease: holder id, with TTL
        self.info = f"{p}:info"  # hash: run metadata (run dir, world size, model, ...)
        self.policy = f"{p}:policy"  # string: the leader sentinel's persisted policy state (JSON)
        self.approvals = f"{p}:approvals"  # stream of signed approvals (`sentinel approve`)


STEP_CONSUMER_GROUP = "sentinel"


# --------------------------------------------------------------------------------------------
# Small helpers shared by both sides
# --------------------------------------------------------------------------------------------


MAX_SAMPLE_ID = 2**63 - 1  # sample ids are int64 wherever they go (numpy, torch, the bus): HI at most this


def merge_ranges(ranges) -> list[tuple[int, int]]:
    """Normalise [lo, hi) ranges: drop empties, sort, merge overlapping/adjacent ones."""
    rs = sorted((int(lo), int(hi)) for lo, hi in ranges if int(hi) > int(lo))
    out: list[tuple[int, int]] = []
    for lo, hi in rs:
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def subtract_ranges(ranges, remove) -> list[tuple[int, int]]:
    """``ranges`` less the ids of ``remove``, merged ([lo, hi) ranges)."""
    out: list[tuple[int, int]] = []
    rem = merge_ranges(remove)
    for lo, hi in merge_ranges(ranges):
        pieces = [(lo, hi)]
        for rlo, rhi in rem:
            nxt = []
            for a, b in pieces:
                if rhi <= a or rlo >= b:
                    nxt.append((a, b))
                    continue
                if a < rlo:
                    nxt.append((a, rlo))
                if rhi < b:
                    nxt.append((rhi, b))
            pieces = nxt
        out.extend(pieces)
    return merge_ranges(out)


def ids_to_ranges(ids) -> list[tuple[int, int]]:
    """Compress sample ids into merged [lo, hi) ranges."""
    return merge_ranges((i, i + 1) for i in ids)


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


# --------------------------------------------------------------------------------------------
# Run-directory files both sides read and write (formats are part of the contract)
# --------------------------------------------------------------------------------------------

CHECKPOINT_MANIFEST = "manifest.json"  # written last; sha256 per file under "files"
PENDING_ROLLBACK = "pending_rollback.json"  # an offline rollback plan, applied at the trainer's next start
# sample-id ranges an operator took off the skip list ([[lo, hi], ...]): a checkpoint's saved list would
# add them back at a resume, so the trainer subtracts them at its next start, and deletes the file once
# a checkpoint without them is saved
SKIP_REMOVED = "skiplist.removed.json"


def skip_ranges_error(raw: Any) -> str | None:
    """None when ``raw`` (a parsed ranges file) is ``[[lo, hi], ...]`` with 0 <= lo < hi <= MAX_SAMPLE_ID."""
    if not isinstance(raw, list) or not all(isinstance(r, list) and len(r) == 2 for r in raw):
        return "expected [[lo, hi], ...]"
    if not all(type(x) is int for r in raw for x in r) or any(not 0 <= r[0] < r[1] <= MAX_SAMPLE_ID for r in raw):
        return f"ids must be integers with 0 <= lo < hi <= {MAX_SAMPLE_ID}"
    return None


def pending_rollback_error(plan: Any) -> str | None:
    """None when ``plan`` (parsed ``pending_rollback.json``) is a plan both sides can apply:
    ``{"to_step": N, "ranges": [[lo, hi], ...], ...}``; else what is wrong with it, in a few words."""
    def is_int(x: Any, hi: int) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= hi

    if not isinstance(plan, dict):
        return "expected a JSON object"
    if not is_int(plan.get("to_step"), MAX_STEP):
        return f"to_step {str(plan.get('to_step'))[:40]!r} is not a step"
    ranges = plan.get("ranges", [])
    if not isinstance(ranges, list) or not all(
            isinstance(r, list) and len(r) == 2 and all(is_int(x, MAX_SAMPLE_ID) for x in r) for r in ranges):
        return "ranges must be [[lo, hi], ...] sample ids"
    return None


def checkpoint_required_files(world_size: int, sharded: bool) -> list[str]:
    """Files a checkpoint step directory must hold, and list in its manifest, to be resumable."""
    weights = ["dcp/.metadata"] if sharded else ["model.pt", "optim.pt"]
    return ["train_state.json", *weights, *(f"rng-rank{r}.pt" for r in range(world_size))]


def checkpoint_dir_name(step: int) -> str:
    """``checkpoints/step-NNNNNNNN``: zero-padded so names sort by step."""
    return f"step-{int(step):08d}"


def sha256_file(path, bufsize: int = 1 << 20) -> str:
    """Checksum of one file, as recorded in checkpoint manifests and dataset metadata."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_text(path, text: str) -> None:
    """tmp + fsync + rename + fsync(dir): a crash leaves the old content or the new, never half."""
    import os
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_STATE_BYTES = 64 << 20  # a state file (skip list, manifest, plan, config) is kilobytes; more is not one of ours


class UnreadableFileError(OSError):
    """A path that is no regular file (a device, a FIFO, a socket) or is too large to be what it
    should be. The message says which, without the path: the caller names the file its own way.
    An ``OSError``, so a caller that only knows "unreadable" treats it like any other."""


def _require_regular(mode: int, path) -> None:
    import errno
    import os
    import stat

    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "an unknown kind of file")
    raise UnreadableFileError(f"not a regular file: {kind}")


def open_regular(path):
    """``path`` (symlinks followed) opened for binary reading, when it is a regular file. Reading
    /dev/zero or /dev/urandom never ends and opening a FIFO waits for a writer that may never come,
    so anything else is an ``UnreadableFileError`` (a directory: ``IsADirectoryError``) before it is
    read. Checked before opening (opening a device can have effects) and again on the open file
    (the path can change in between; O_NONBLOCK keeps that open of a FIFO from waiting). Other
    ``OSError`` (missing, a symlink loop, a name too long) passes through."""
    import os

    _require_regular(os.stat(path).st_mode, path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_regular(os.fstat(fd).st_mode, path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path, limit: int) -> bytes:
    """The bytes of a small file: ``open_regular``, and at most ``limit`` bytes (more is an
    ``UnreadableFileError``: a state or rules file of gigabytes is a mistake or an attack, and
    reading it would take the memory with it). The state files both sides read (skip list,
    pending rollback plan, config, manifests) go through here."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFileError(f"larger than {limit:,} bytes")
    return data


# --------------------------------------------------------------------------------------------
# Bus records from untrusted transport: ranges and authentication
# --------------------------------------------------------------------------------------------

MAX_STEP = 2**53  # beyond this a float step counter would already have lost precision
MAX_TIMELINE = 2**31
MAX_COUNT = 2**62  # tokens, sample ids
MAX_MAGNITUDE = 3.5e38  # float32 max: no tensor of ours can produce a finite value beyond it
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


def record_range_error(rec: _Record) -> str | None:
    """None when every number in a step/timeline/ack/event/incident record is plausible, else what is not.

    A NaN or +inf loss or grad norm is legitimate (that is what the NaN rule watches for); a
    negative one, -inf, a finite value beyond float32, a negative step or count, or a non-finite
    time or learning rate can only come from a bug or a forger.
    """
    checks: list[str | None] = []
    if isinstance(rec, StepRecord):
        checks += [_bad_int("step", rec.step, 0, MAX_STEP), _bad_int("timeline", rec.timeline, 0, MAX_TIMELINE),
                   _bad_int("tokens", rec.tokens, 0, MAX_COUNT), _bad_int("batch_tokens", rec.batch_tokens, 0, MAX_COUNT),
                   _bad_int("world_size", rec.world_size, 1, 1 << 24)]
        checks += [_bad_int("sample_ids", i, 0, MAX_COUNT) for i in rec.sample_ids if not 0 <= i <= MAX_COUNT][:1]
        for name in ("loss", "loss_max_rank", "grad_norm", "lr", "time", "step_seconds", "tokens_per_second", "mfu",
                     "val_loss", "val_ppl", "checkpoint_age_seconds", "effective_token_ratio"):
            x = getattr(rec, name)
            if x is not None:
                checks.append(_bad_float(name, x, nonfinite_ok=name in _NONFINITE_OK))
        for name, xs in (("rank_losses", rec.rank_losses), ("rank_step_seconds", rec.rank_step_seconds),
                         ("phases", list((rec.phases or {}).values())),
                         ("rank_phases", [x for ph in rec.rank_phases or () for x in ph.values()])):
            checks += [_bad_float(name, x, nonfinite_ok=name == "rank_losses") for x in xs or ()]
    elif isinstance(rec, TimelineRecord):
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


RECORD_MAC_FIELD = "mac"  # stream field beside ``json``: HMAC-SHA256 of the exact JSON text


def record_mac(secret: bytes, stream: str, data: str) -> str:
    """HMAC-SHA256 over (domain, stream key, record JSON text), hex.

    The trainer MACs every step record and ack it puts on the bus with the run's directive
    secret; the sentinel refuses entries whose MAC is missing or wrong, so whoever can write to
    the bus but does not hold the secret cannot make the sentinel act. The stream key binds a
    record to its run and stream (no replay into another run), and the domain prefix keeps these
    MACs apart from directive signatures made with the same key.
    """
    msg = b"sentinel-record-v1\x00" + stream.encode() + b"\x00" + data.encode("utf-8", "surrogatepass")
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def record_mac_error(secret: bytes, stream: str, data: str, mac: str | None) -> str | None:
    """None when ``mac`` authenticates ``data`` on ``stream``; else the reject reason."""
    if not mac:
        return "unsigned"
    if not hmac.compare_digest(record_mac(secret, stream, data).encode(), mac.encode("utf-8", "surrogatepass")):
        return "bad_signature"
    return None
