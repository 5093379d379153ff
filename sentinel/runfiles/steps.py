"""``steps.jsonl``: the last N records read backwards from the end (a run's log can be huge), every
record streamed, and the summary ``sentinel status`` shows."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sentinel.contract.bounds import record_range_error
from sentinel.contract.parsing import SchemaError
from sentinel.contract.ranges import count
from sentinel.contract.records import StepRecord, TimelineRecord, authoritative_steps, parse_step_line
from sentinel.contract.rundir import STEPS
from sentinel.runfiles.base import _reject, tail_lines


def parse_file_record(line: bytes | str) -> StepRecord | TimelineRecord:
    """One line of ``steps.jsonl``, held to the same bounds as a record from the bus (a negative or
    10**60 step, a -inf loss, a non-finite time): a line no trainer writes is a ``SchemaError``, so a
    hostile line cannot stretch a status or a report to step 10**60."""
    rec = parse_step_line(line)
    bad = record_range_error(rec)
    if bad:
        raise SchemaError(f"steps.jsonl: {bad}", "out_of_range")
    return rec


def tail_records(run_dir: str | os.PathLike, n: int = 1000, rejected: list[str] | None = None) -> list[StepRecord | TimelineRecord]:
    """The last ``n`` records of ``steps.jsonl``; [] if there is none. A malformed line is skipped,
    and its one-line reason appended to ``rejected`` when given."""
    path = Path(run_dir) / STEPS
    if not path.is_file():
        _not_a_log(path, rejected)
        return []
    out = []
    lines = tail_lines(path, n)
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(parse_file_record(line))
        except SchemaError as e:
            _reject(rejected, f"{STEPS} (line {i} of the last {len(lines)}): {e}")
    return out


def _not_a_log(path: Path, rejected: list[str] | None) -> None:
    """A steps.jsonl that is there but no regular file (a directory, a FIFO, a link to a device) is
    no log to read, and not "no steps yet" either: said, as a rejected line is."""
    if os.path.lexists(path):
        import stat

        try:
            mode = os.stat(path).st_mode
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "no regular file")
        except OSError as e:
            kind = f"unreadable ({e.strerror or e.__class__.__name__})"
        _reject(rejected, f"{STEPS} is {kind}: not read")


def read_records(run_dir: str | os.PathLike, rejected: list[str] | None = None):
    """Every record of ``steps.jsonl``, in order (streamed; a torn tail line is skipped). A malformed
    or out-of-range line is skipped, and its one-line reason ("steps.jsonl:N: ...") appended to
    ``rejected`` when given."""
    path = Path(run_dir) / STEPS
    if not path.is_file():
        _not_a_log(path, rejected)
        return
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                return
            if line.strip():
                try:
                    yield parse_file_record(line)
                except SchemaError as e:
                    if rejected is not None:
                        rejected.append(f"{STEPS}:{n}: {e}")


def effective_steps(records: Iterable) -> list[StepRecord]:
    """The authoritative step records of a record sequence (a rollback supersedes later steps)."""
    return list(authoritative_steps(records).values())


def steps_mtime(run_dir: str | os.PathLike) -> float | None:
    try:
        return (Path(run_dir) / STEPS).stat().st_mtime
    except OSError:
        return None


@dataclass
class StepsSummary:
    """What ``sentinel status`` shows for a run, computed from a window of step records."""

    step: int | None = None
    timeline: int | None = None
    loss: float | None = None
    loss_median: float | None = None
    val_ppl: float | None = None
    grad_norm: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    guard_skips: int = 0
    window: int = 0
    last_time: float | None = None
    checkpoint_age_seconds: float | None = None
    last_timeline_event: dict | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def summarize(records: list, now: float | None = None) -> StepsSummary:
    now = time.time() if now is None else now
    steps = effective_steps(records)
    s = StepsSummary(window=len(steps))
    for r in records:
        if isinstance(r, TimelineRecord):
            s.last_timeline_event = {"kind": r.kind, "from_step": r.from_step, "timeline": r.timeline, "time": r.time,
                                     "reason": r.reason, "skip_samples": count(r.skip_ranges)}
    if not steps:
        return s
    last = steps[-1]
    s.step, s.timeline, s.loss, s.grad_norm, s.last_time = last.step, last.timeline, last.loss, last.grad_norm, last.time
    s.tokens_per_second, s.mfu = last.tokens_per_second, last.mfu
    recent = [r.loss for r in steps[-51:-1] if r.loss == r.loss and not r.skipped]
    if recent:
        recent.sort()
        m = len(recent) // 2
        s.loss_median = recent[m] if len(recent) % 2 else (recent[m - 1] + recent[m]) / 2
    for r in reversed(steps):
        if r.val_ppl is not None:
            s.val_ppl = r.val_ppl
            break
    s.guard_skips = sum(1 for r in steps if r.skipped)
    if last.checkpoint_age_seconds is not None:
        s.checkpoint_age_seconds = last.checkpoint_age_seconds + max(0.0, now - last.time)
    return s
