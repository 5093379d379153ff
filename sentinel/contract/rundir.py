"""The run directory's layout: every file name both sides use, and the small state files' formats.

::

    RUN_DIR/
      config.yaml                 the resolved run config (trainer)
      steps.jsonl                 every step / timeline / marker record (trainer; ``records.parse_step_line``)
      skiplist.json               [[lo, hi], ...] the trainer never trains on again
      skiplist.removed.json       ranges an operator took off the list, applied at the next start
      pending_rollback.json       an offline rollback plan, applied at the trainer's next start
      directives.jsonl            the trainer's log of handled directives
      audit.jsonl                 who did what by hand, and why (CLI)
      incidents.jsonl, pages.jsonl   the daemon's mirror of incidents and pages
      sentinel-rules.applied.yaml the rules the daemon applied (for ``sentinel backtest``)
      checkpoints/step-NNNNNNNN/  one checkpoint; ``manifest.json`` written last (``contract.checkpoints``)
      checkpoints/verified.json   ``sentinel verify-resume`` results

A file name is spelled here once; everything else imports it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sentinel.contract.fsio import read_regular_file
from sentinel.contract.limits import MAX_RECORD_BYTES, MAX_SAMPLE_ID, MAX_STEP
from sentinel.contract.parsing import SchemaError, loads_bounded
from sentinel.contract.ranges import merge_ranges, skip_ranges_error

CONFIG = "config.yaml"
STEPS = "steps.jsonl"
SKIPLIST = "skiplist.json"
# sample-id ranges an operator took off the skip list ([[lo, hi], ...]): a checkpoint's saved list would
# add them back at a resume, so the trainer subtracts them at its next start, and deletes the file once
# a checkpoint without them is saved
SKIP_REMOVED = "skiplist.removed.json"
PENDING_ROLLBACK = "pending_rollback.json"  # an offline rollback plan, applied at the trainer's next start
DIRECTIVES_LOG = "directives.jsonl"
AUDIT = "audit.jsonl"
INCIDENTS_LOG = "incidents.jsonl"
PAGES_LOG = "pages.jsonl"
APPLIED_RULES = "sentinel-rules.applied.yaml"  # the rules the daemon applied to the run (resolved), for backtest
CKPT_DIR = "checkpoints"
CHECKPOINT_MANIFEST = "manifest.json"  # written last; sha256 per file under "files"
TRAIN_STATE = "train_state.json"
VERIFIED = "verified.json"
CHECKPOINT_FORMAT = 1
STEP_DIR_RE = re.compile(r"^step-(\d{8,})$")


class RunFileError(ValueError):
    """A run-dir state file that is there but cannot be used (unreadable, malformed): one line that
    names the file."""


def checkpoint_dir_name(step: int) -> str:
    """``checkpoints/step-NNNNNNNN``: zero-padded so names sort by step."""
    return f"step-{int(step):08d}"


def checkpoint_required_files(world_size: int, sharded: bool, *, legacy: bool = False) -> list[str]:
    """Files a checkpoint step directory must hold, and list in its manifest, to be resumable. ``legacy``:
    a checkpoint written before tensor files, whose ``.pt`` files are torch's format."""
    ext = ".pt" if legacy else ".safetensors"
    weights = ["dcp/.metadata"] if sharded else [f"model{ext}", f"optim{ext}"]
    return [TRAIN_STATE, *weights, *(f"rng-rank{r}{ext}" for r in range(world_size))]


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


def read_skip_removals(run_dir) -> list[tuple[int, int]]:
    """The merged ranges of ``skiplist.removed.json``; [] when there is none. The one reader: the
    trainer applies them at its start and the CLI adds to them, so a file one refuses the other
    refuses too. Unreadable (not JSON, a FIFO, over ``MAX_RECORD_BYTES``) or malformed is a
    ``RunFileError`` naming the file."""
    path = Path(run_dir) / SKIP_REMOVED
    try:
        raw = loads_bounded(read_regular_file(path, MAX_RECORD_BYTES), path.name)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise RunFileError(f"{path} is unreadable ({e.strerror or e})") from None
    except SchemaError as e:
        raise RunFileError(f"{path} is unreadable ({e})") from None
    bad = skip_ranges_error(raw)
    if bad:
        raise RunFileError(f"{path} is malformed ({bad})")
    return merge_ranges(tuple(r) for r in raw)
