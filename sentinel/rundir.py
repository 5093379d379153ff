"""Torch-free readers (and the few writers the CLI needs) for a run directory: one API over
``sentinel.runfiles`` (one module per file kind) and the contract's file names and range helpers.

The on-call commands (`sentinel status`, `checkpoints`, `rollback`, `skip-list`, ...) must work on
a laptop without torch and must never import the training loop, so everything they need from
``RUN_DIR`` is reachable here:

* ``steps.jsonl`` (``runfiles.steps``): the last N records, read backwards; every record, streamed;
  the summary ``sentinel status`` shows;
* ``checkpoints/step-*/`` (``runfiles.checkpoints``): listing, sizes, a re-hash against the
  manifest (judged by the trainer's own validator), and ``verified.json``;
* ``skiplist.json``, ``skiplist.removed.json``, ``pending_rollback.json`` (``runfiles.skips``);
* ``directives.jsonl``, ``audit.jsonl``, ``incidents.jsonl``, ``pages.jsonl`` and the applied rules
  (``runfiles.logs``).

The layout itself (file names, formats) is ``sentinel.contract.rundir``.
"""

from __future__ import annotations

from sentinel.contract.fsio import sha256_file
from sentinel.contract.ranges import count, fmt_ranges, intersect_ranges, merge_ranges, parse_range, subtract_ranges
from sentinel.contract.rundir import (
    APPLIED_RULES,
    AUDIT,
    CHECKPOINT_FORMAT,
    CKPT_DIR,
    CONFIG,
    DIRECTIVES_LOG,
    INCIDENTS_LOG,
    PAGES_LOG,
    SKIPLIST,
    STEPS,
    VERIFIED,
)
from sentinel.contract.rundir import CHECKPOINT_MANIFEST as MANIFEST
from sentinel.contract.rundir import PENDING_ROLLBACK as PENDING
from sentinel.runfiles.base import (
    RunDirError,
    config_skip_ranges,
    load_json_file,
    planned_steps,
    require_run_dir,
    run_config,
    run_id_of,
    tail_lines,
)
from sentinel.runfiles.checkpoints import (
    Checkpoint,
    check_checkpoint,
    checkpoint_steps,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_verified,
    step_dir_name,
)
from sentinel.runfiles.logs import (
    PAGE_FIELDS,
    JsonlMirror,
    append_audit,
    normalize_page,
    parse_incident,
    read_audit,
    read_directives_log,
    read_incidents_log,
    read_pages_log,
    write_applied_rules,
)
from sentinel.runfiles.skips import (
    change_skip_removals,
    grow_skiplist,
    origin_of,
    pending_rollback_for_view,
    read_pending_rollback,
    read_skip_removals,
    read_skiplist,
    skip_origins,
    write_pending_rollback,
    write_skiplist,
)
from sentinel.runfiles.steps import (
    StepsSummary,
    effective_steps,
    parse_file_record,
    read_records,
    steps_mtime,
    summarize,
    tail_records,
)

__all__ = [
    "APPLIED_RULES", "AUDIT", "CHECKPOINT_FORMAT", "CKPT_DIR", "CONFIG", "DIRECTIVES_LOG", "INCIDENTS_LOG", "MANIFEST",
    "PAGES_LOG", "PAGE_FIELDS", "PENDING", "SKIPLIST", "STEPS", "VERIFIED", "Checkpoint", "JsonlMirror", "RunDirError",
    "StepsSummary", "append_audit", "change_skip_removals", "check_checkpoint", "checkpoint_steps", "config_skip_ranges",
    "count", "effective_steps", "find_checkpoint", "fmt_ranges", "grow_skiplist", "intersect_ranges", "list_checkpoints",
    "load_checkpoint", "load_json_file", "merge_ranges", "normalize_page", "origin_of", "parse_file_record",
    "parse_incident", "parse_range", "pending_rollback_for_view", "planned_steps", "read_audit", "read_directives_log",
    "read_incidents_log", "read_pages_log", "read_pending_rollback", "read_records", "read_skip_removals",
    "read_skiplist", "read_verified", "require_run_dir", "run_config", "run_id_of", "sha256_file", "skip_origins",
    "step_dir_name", "steps_mtime", "subtract_ranges", "summarize", "tail_lines", "tail_records", "write_applied_rules",
    "write_pending_rollback", "write_skiplist",
]
