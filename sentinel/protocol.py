"""Kept for compatibility: the contract between the trainer and the sentinel now lives in
``sentinel.contract`` (one module per job: records, keys, signing, ranges, rundir, fsio, limits).
This module re-exports the names callers imported from here; new code imports from the contract
modules directly. It imports nothing of ours but the contract, and no torch."""

from sentinel.contract.bounds import record_range_error
from sentinel.contract.fsio import (
    UnreadableFileError,
    atomic_write_text,
    fsync_dir,
    open_regular,
    read_regular_file,
    sha256_file,
)
from sentinel.contract.keys import STEP_CONSUMER_GROUP, Keys
from sentinel.contract.limits import (
    MAX_CLOCK_SKEW_S,
    MAX_COUNT,
    MAX_DIRECTIVE_TTL_S,
    MAX_JSON_DEPTH,
    MAX_MAGNITUDE,
    MAX_RECORD_BYTES,
    MAX_SAMPLE_ID,
    MAX_SLICES,
    MAX_STATE_BYTES,
    MAX_STEP,
    MAX_TIMELINE,
    SCHEMA_VERSION,
    SLICE_NAME_RE,
)
from sentinel.contract.parsing import REJECT_REASONS, SchemaError, finite_or_none, is_finite, loads_bounded, plain_error
from sentinel.contract.ranges import ids_to_ranges, merge_ranges, skip_ranges_error, subtract_ranges
from sentinel.contract.records import (
    BUSY_PHASES,
    MARKER_KINDS,
    PHASES,
    RANK_PHASES,
    Ack,
    CheckpointInfo,
    CheckpointVerification,
    Directive,
    DirectiveKind,
    Event,
    Incident,
    IncidentState,
    MarkerKind,
    MarkerRecord,
    Severity,
    Step,
    StepLine,
    StepRecord,
    TimelineRecord,
    authoritative_steps,
    parse_step_line,
)
from sentinel.contract.rundir import (
    CHECKPOINT_MANIFEST,
    PENDING_ROLLBACK,
    SKIP_REMOVED,
    checkpoint_dir_name,
    checkpoint_required_files,
    pending_rollback_error,
)
from sentinel.contract.signing import RECORD_MAC_FIELD, record_mac, record_mac_error

__all__ = [
    "BUSY_PHASES", "CHECKPOINT_MANIFEST", "MARKER_KINDS", "MAX_CLOCK_SKEW_S", "MAX_COUNT", "MAX_DIRECTIVE_TTL_S",
    "MAX_JSON_DEPTH", "MAX_MAGNITUDE", "MAX_RECORD_BYTES", "MAX_SAMPLE_ID", "MAX_SLICES", "MAX_STATE_BYTES", "MAX_STEP",
    "MAX_TIMELINE", "PENDING_ROLLBACK", "PHASES", "RANK_PHASES", "RECORD_MAC_FIELD", "REJECT_REASONS", "SCHEMA_VERSION",
    "SKIP_REMOVED", "SLICE_NAME_RE", "STEP_CONSUMER_GROUP", "Ack", "CheckpointInfo", "CheckpointVerification",
    "Directive", "DirectiveKind", "Event", "Incident", "IncidentState", "Keys", "MarkerKind", "MarkerRecord",
    "SchemaError", "Severity", "Step", "StepLine", "StepRecord", "TimelineRecord", "UnreadableFileError",
    "atomic_write_text", "authoritative_steps", "checkpoint_dir_name", "checkpoint_required_files", "finite_or_none",
    "fsync_dir", "ids_to_ranges", "is_finite", "loads_bounded", "merge_ranges", "open_regular",
    "parse_step_line", "pending_rollback_error", "plain_error", "read_regular_file", "record_mac", "record_mac_error",
    "record_range_error", "sha256_file", "skip_ranges_error", "subtract_ranges",
]
