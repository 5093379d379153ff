"""``skiplist.json``, ``skiplist.removed.json`` and ``pending_rollback.json``: read, and written
atomically in the trainer's format; and where each skipped range came from (``skip_origins``)."""

from __future__ import annotations

import bisect
import contextlib
import json
import os
from pathlib import Path
from typing import Any

from sentinel.contract.fsio import atomic_write_text
from sentinel.contract.limits import MAX_SAMPLE_ID
from sentinel.contract.ranges import count, merge_ranges, subtract_ranges, valid_ranges
from sentinel.contract.records import TimelineRecord
from sentinel.contract.rundir import PENDING_ROLLBACK as PENDING
from sentinel.contract.rundir import SKIP_REMOVED, SKIPLIST, RunFileError, pending_rollback_error
from sentinel.contract.rundir import read_skip_removals as _read_removals
from sentinel.runfiles.base import RunDirError, config_skip_ranges, load_json_file
from sentinel.runfiles.logs import read_audit, read_directives_log
from sentinel.runfiles.steps import read_records


def read_skiplist(run_dir: str | os.PathLike) -> list[tuple[int, int]]:
    """``skiplist.json`` as merged [lo, hi) ranges; a missing file is an empty list."""
    p = Path(run_dir) / SKIPLIST
    try:
        raw = load_json_file(p, "skip list")
    except FileNotFoundError:
        return []
    try:
        ranges = [(int(lo), int(hi)) for lo, hi in raw]
    except (TypeError, ValueError, OverflowError):
        raise RunDirError(f"skip list {p} is malformed: expected [[lo, hi], ...]") from None
    if any(not 0 <= lo <= hi <= MAX_SAMPLE_ID for lo, hi in ranges):
        raise RunDirError(f"skip list {p} is malformed: ids must satisfy 0 <= lo <= hi <= {MAX_SAMPLE_ID} (int64)")
    return merge_ranges(ranges)


_atomic_write = atomic_write_text  # the one atomic write (contract.fsio)


def write_skiplist(run_dir: str | os.PathLike, ranges) -> list[tuple[int, int]]:
    """Replace ``skiplist.json`` atomically (same format as ``trainer.data.SkipList.save``)."""
    merged = merge_ranges(ranges)
    _atomic_write(Path(run_dir) / SKIPLIST, json.dumps([[lo, hi] for lo, hi in merged]))
    return merged


def read_skip_removals(run_dir: str | os.PathLike) -> list[tuple[int, int]]:
    """``skiplist.removed.json``: the ranges an operator removed that the trainer has not yet made
    stick; [] when there is none. The trainer's own reader (``contract.rundir.read_skip_removals``):
    a file it would refuse is a ``RunDirError`` here."""
    try:
        return _read_removals(run_dir)
    except RunFileError as e:
        raise RunDirError(str(e)) from None


def change_skip_removals(run_dir: str | os.PathLike, *, add=(), drop=()) -> list[tuple[int, int]]:
    """Add ranges to the removals the trainer applies at its next start, or drop ranges from them
    (an operator who adds a range back after removing it); the file goes when none are left."""
    p = Path(run_dir) / SKIP_REMOVED
    after = subtract_ranges(merge_ranges(list(read_skip_removals(run_dir)) + [tuple(r) for r in add]), drop)
    if after:
        _atomic_write(p, json.dumps([[lo, hi] for lo, hi in after]))
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return after


def grow_skiplist(run_dir: str | os.PathLike, ranges) -> tuple[list[tuple[int, int]], int]:
    """Merge ``ranges`` into ``skiplist.json``; returns (new list, number of newly covered ids)."""
    before = read_skiplist(run_dir)
    after = merge_ranges(list(before) + [tuple(r) for r in ranges])
    if after != before:
        write_skiplist(run_dir, after)
    return after, count(after) - count(before)


def read_pending_rollback(run_dir: str | os.PathLike) -> dict | None:
    """The plan in ``pending_rollback.json``, or None; a plan without a valid ``to_step`` and
    ``ranges`` is a ``RunDirError`` naming the file (the trainer could not apply it either)."""
    p = Path(run_dir) / PENDING
    try:
        data = load_json_file(p)
    except FileNotFoundError:
        return None
    bad = pending_rollback_error(data)
    if bad:
        raise RunDirError(f"{p} is malformed: {bad}")
    return data


def pending_rollback_for_view(run_dir: str | os.PathLike | None) -> dict | None:
    """``read_pending_rollback`` for a view (status, checkpoints, skip-list): a malformed plan is
    one stderr warning and shown as none, not a refusal to show the run (the trainer refuses to
    start on it with the same words; the next ``sentinel rollback`` replaces it)."""
    if run_dir is None:
        return None
    try:
        return read_pending_rollback(run_dir)
    except RunDirError as e:
        import sys

        print(f"warning: {e} (the trainer will not start until it is fixed or replaced by `sentinel rollback`)",
              file=sys.stderr)
        return None


def write_pending_rollback(run_dir: str | os.PathLike, *, to_step: int, ranges, reason: str | None, id: str,
                           **extra: Any) -> Path:
    """Write the plan the trainer's ``start()`` consumes: {"to_step", "ranges", "reason", "id", ...}."""
    p = Path(run_dir) / PENDING
    plan = {"to_step": int(to_step), "ranges": [[lo, hi] for lo, hi in merge_ranges(ranges)], "reason": reason,
            "id": id, **extra}
    _atomic_write(p, json.dumps(plan, indent=1, sort_keys=True))
    return p


def skip_origins(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Where the run's skip ranges came from, oldest first: ``{"ranges", "source", "step",
    "reason", "incident_id"}`` for the config's ``data.skip`` (the --skip flag), each rollback (its
    timeline record in steps.jsonl), each applied skip-samples directive (directives.jsonl, which
    logs its ranges), and each skip an operator added offline (audit.jsonl). For "why is sample N
    skipped?" (``sentinel skip-list RUN show``)."""
    d = Path(run_dir)
    out: list[dict[str, Any]] = []
    cfg = config_skip_ranges(d)
    if cfg:
        out.append({"ranges": cfg, "source": "config", "step": None, "reason": "data.skip in config.yaml (--skip)",
                    "incident_id": None})
    for rec in read_records(d):
        if isinstance(rec, TimelineRecord) and rec.kind == "rollback" and rec.skip_ranges:
            out.append({"ranges": merge_ranges(rec.skip_ranges), "source": "rollback", "step": rec.from_step,
                        "reason": rec.reason, "incident_id": None, "directive_id": rec.directive_id})
    by_directive = {o.get("directive_id"): o for o in out if o.get("directive_id")}
    for e in read_directives_log(d):
        if e.get("status") != "applied":
            continue
        if e.get("kind") == "rollback" and e.get("id") in by_directive:  # the timeline record said it: name the incident
            by_directive[e["id"]]["incident_id"] = e.get("incident_id") if isinstance(e.get("incident_id"), str) else None
            continue
        ranges = _ranges_of(e.get("ranges"))  # logged by the trainer since 2026-11-24
        if not ranges:
            continue
        out.append({"ranges": ranges, "source": str(e.get("kind")), "step": e.get("step") if type(e.get("step")) is int else None,
                    "reason": e.get("reason") if isinstance(e.get("reason"), str) else None,
                    "incident_id": e.get("incident_id") if isinstance(e.get("incident_id"), str) else None})
    for a in read_audit(d):
        ranges = _ranges_of(a.get("ranges"))
        if a.get("action") == "skip-samples" and a.get("phase") == "applied" and ranges:
            out.append({"ranges": ranges, "source": "operator", "step": None,
                        "reason": a.get("reason") if isinstance(a.get("reason"), str) else None,
                        "incident_id": None, "who": a.get("who") if isinstance(a.get("who"), str) else None})
    for o in out:
        o.pop("directive_id", None)
    return out


def _ranges_of(raw: Any) -> list[tuple[int, int]]:
    """Sample-id ranges from a log line, merged; [] for anything malformed (``valid_ranges``)."""
    return merge_ranges(valid_ranges(raw))


def origin_of(lo: int, hi: int, origins: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first origin (``skip_origins``) whose ranges overlap ``[lo, hi)``. Each origin's ranges
    are merged (sorted, disjoint): one bisection each."""
    for o in origins:
        rs = o["ranges"]
        i = bisect.bisect_right(rs, (hi, -1)) - 1  # the last range starting before hi
        if i >= 0 and rs[i][1] > lo:
            return o
    return None
