"""The training loop's side of the sentinel's directives: one state machine, for every loop.

Our trainer, the Hugging Face and Lightning callbacks and any loop of your own hand the framework-specific
parts to a :class:`ControlHost` (restore checkpoint N, save now) and let :class:`ControlLoop` do the rest:

- **once per directive**: a directive is applied at most once per run dir, deduplicated by id against
  ``RUN_DIR/directives.jsonl`` (a restarted loop re-reads the stream), logged there and acked;
- **the skip list**: ``skip-samples`` and ``rollback`` grow it, on disk (``skiplist.json``, atomically) and
  on the bus, before anything else happens (a crash between the two never trains on the data again);
- **timelines and markers**: every start, resume and rollback gets a timeline above all earlier ones and a
  ``TimelineRecord`` in ``steps.jsonl`` and on the bus; the sentinel rewinds its baselines on it;
- **pause / resume / stop / checkpoint-now**, with the heartbeat told that a paused run is not a hung one;
- **distributed**: rank 0 reads the bus, ``broadcast`` hands every rank the same list at the same step.

A framework that cannot restore mid-run raises :class:`RelaunchRequired` from ``restore_checkpoint``: the
rollback becomes an offline plan (``pending_rollback.json``, the same file ``sentinel rollback`` writes for a
stopped run), the loop asks the host to stop, and :meth:`ControlLoop.begin` of the next launch consumes it.

No torch, no framework: only the bus client, the step log and the skip list.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sentinel.client.bus import BusClient
from sentinel.client.skiplist import DataError, SkipList
from sentinel.client.steplog import StepLog, clean_text, write_and_publish
from sentinel.protocol import (
    MAX_RECORD_BYTES,
    PENDING_ROLLBACK,
    Ack,
    Directive,
    MarkerRecord,
    SchemaError,
    TimelineRecord,
    atomic_write_text,
    ids_to_ranges,
    loads_bounded,
    merge_ranges,
    pending_rollback_error,
    read_regular_file,
)

DIRECTIVES_LOG = "directives.jsonl"
SKIPLIST_FILE = "skiplist.json"


class RestoreFailed(Exception):
    """Raised by ``ControlHost.restore_checkpoint``: the rollback is acked ``failed`` with this one line."""


class RelaunchRequired(Exception):
    """Raised by ``ControlHost.restore_checkpoint`` when the framework cannot restore in-process: the rollback
    is saved as ``pending_rollback.json``, acked ``applied`` (``relaunch from checkpoint N``) and the loop
    sets ``stop_requested`` and ``relaunch_step``; the next launch resumes from that checkpoint."""


class ControlHost(Protocol):
    """What a framework provides to the control loop."""

    def restore_checkpoint(self, step: int) -> None:
        """Restore the full state saved at ``step`` (weights, optimizer, scheduler, RNG, data position)."""

    def save_checkpoint(self) -> None:
        """Save (and register) a checkpoint of the current state now."""


@dataclass(frozen=True)
class Applied:
    """The outcome of one directive, as acked."""

    kind: str
    directive_id: str
    status: str  # applied | failed | duplicate
    detail: str | None = None
    to_step: int | None = None  # rollback: the step training continues from


def read_pending_plan(path: Path) -> tuple[dict | None, str | None]:
    """(plan, None) from ``pending_rollback.json`` (``sentinel rollback`` of a stopped run, or a rollback a
    framework could only apply at its next launch), or (None, why) when the file is not one: a hostile or
    corrupt plan is refused in one line, never applied half-way and never silently dropped."""
    fix = "fix it or write a new plan with `sentinel rollback`, then start again"
    try:  # bounded: a symlink to /dev/zero or a FIFO is refused, not read forever
        plan = loads_bounded(read_regular_file(path, MAX_RECORD_BYTES), path.name)
    except OSError as e:
        return None, f"{path} is unreadable ({e.strerror or e}): {fix}"
    except SchemaError as e:
        return None, f"{path} is unreadable ({e}): {fix}"
    bad = pending_rollback_error(plan)
    empty = None if bad else next((r for r in plan.get("ranges", []) if r[1] <= r[0]), None)
    if empty is not None:  # what `sentinel rollback --skip` refuses ("need 0 <= LO < HI"): a damaged plan
        bad = f"range {empty} is empty or reversed; need lo < hi"
    if bad:
        return None, f"{path} is malformed ({bad}): {fix}"
    return plan, None


def _single(obj: Any) -> Any:
    return obj


@dataclass
class ControlLoop:
    """Applies the sentinel's signed directives to a training loop (see the module docstring).

    Call :meth:`begin` once the training state is loaded, :meth:`poll` at every step boundary on every
    rank, and honour ``paused`` (or call :meth:`hold_while_paused`) and ``stop_requested``."""

    run_dir: Path
    run: str
    host: ControlHost
    bus: BusClient | None = None
    steplog: StepLog | None = None
    is_main: bool = True
    broadcast: Callable[[Any], Any] | None = None  # rank 0's object to every rank; None: one process
    metrics: Any = None  # sentinel.client.metrics.TrainerMetrics, or None
    log: Callable[[str], None] = print
    skip: SkipList | None = None  # default: RUN_DIR/skiplist.json
    # called before the loop writes steps.jsonl or reads it back (a marker, a directive applied): a host that
    # batches its step records (RunSession) writes what it holds first, so the file stays in step order
    before_write: Callable[[], None] | None = None
    timeline: int = 0
    paused: bool = False
    stop_requested: bool = False
    relaunch_step: int | None = None
    applied: set[str] = field(default_factory=set)
    _rejected_seen: int = 0

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self._share = self.broadcast or _single
        if self.skip is None:  # a bad file is refused in one line (DataError): dropping it would train on it
            self.skip = SkipList.load(self.run_dir / SKIPLIST_FILE)
        self.applied = set(self._share(sorted(self._read_applied()) if self.is_main else None))

    # ------------------------------------------------------------------ start
    def next_timeline(self) -> int:
        """Above every timeline in steps.jsonl (the same on every rank)."""
        self._written()
        last = self.steplog.last_timeline() if self.is_main and self.steplog else -1
        return int(self._share(last)) + 1

    def pending_plan(self) -> dict | None:
        """The rollback plan waiting in ``pending_rollback.json`` (the same on every rank), or None.
        A malformed plan raises ``DataError`` with one line: the operator asked for a rollback."""
        path = self.run_dir / PENDING_ROLLBACK
        plan, bad = (None, None)
        if self.is_main and os.path.lexists(path):  # a FIFO or a dangling link is refused too, not ignored
            plan, bad = read_pending_plan(path)
        plan, bad = self._share((plan, bad))
        if bad:
            raise DataError(bad)
        return plan

    def begin(self, step: int, *, checkpoint: str | None = None) -> None:
        """Mark the start of training at ``step`` (0: fresh, else resumed from ``checkpoint``). A pending
        plan for this very step (a relaunch after :class:`RelaunchRequired`) becomes the ``rollback`` marker
        with the directive's id and ranges, and is deleted."""
        plan = self.pending_plan()
        self.stop_requested, self.relaunch_step = False, None  # a relaunch reuses the loop: a fresh start of it
        self.timeline = self.next_timeline()
        if plan is not None and int(plan["to_step"]) == step:
            ranges = [tuple(r) for r in plan.get("ranges", [])]
            self.add_skip(ranges)
            self.mark("rollback", step, reason=plan.get("reason"), directive_id=plan.get("id"), ranges=ranges,
                      checkpoint=checkpoint)
            if self.is_main:
                (self.run_dir / PENDING_ROLLBACK).unlink(missing_ok=True)
            if self.metrics and self.is_main:
                self.metrics.on_rollback()
            self.log(f"rollback applied at launch: resumed from step {step}")
        elif step == 0 and checkpoint is None:
            if plan is not None:
                self.log(f"pending rollback to step {plan['to_step']} left in place: this launch starts fresh")
            self.mark("start", 0)
        else:
            self.mark("resume", step, checkpoint=checkpoint)
            if self.metrics and self.is_main:
                self.metrics.on_resume()
        self.persist_skiplist()

    # ------------------------------------------------------------------ every step boundary
    def poll(self, step: int) -> list[Applied]:
        """Read, apply and ack the directives that arrived (a collective when distributed)."""
        items: list[dict] = []
        if self.broadcast is None and self.bus and not self.bus.has_news(self._rejected_seen if self.metrics else None):
            return []  # the common case, at every step of a single process: nothing arrived
        if self.is_main and self.bus:
            # forged, unsigned and expired directives never get here: the bus client rejects, acks and counts them
            items = [d.model_dump(mode="json") for d in self.bus.poll_directives()]
            if self.metrics and self.bus.rejected != self._rejected_seen:
                self._rejected_seen = self.bus.rejected
                self.metrics.set_directives_rejected(self.bus.rejected_by_reason)
        if self.broadcast:
            items = self.broadcast(items)
        out = []
        for item in items:
            applied = self.apply(Directive.model_validate(item), step)
            if applied.to_step is not None and applied.status == "applied" and self.relaunch_step is None:
                step = applied.to_step
            out.append(applied)
        return out

    def hold_while_paused(self, step: int, *, interval_s: float = 0.2,
                          give_up: Callable[[], bool] | None = None) -> list[Applied]:
        """Block while paused (polling every ``interval_s``) unless a stop arrives or ``give_up()`` says so."""
        out: list[Applied] = []
        while self.paused and not self.stop_requested and not (give_up and give_up()):
            if self.metrics:
                self.metrics.heartbeat()
            time.sleep(interval_s)
            out += self.poll(step)
        return out

    def apply(self, d: Directive, step: int) -> Applied:
        """Apply one verified directive at ``step``; log it, ack it, and say how it went."""
        self._written()  # the steps it may abandon (skip_after) are in steps.jsonl before anything changes
        if d.id in self.applied:
            self._ack(d, step, "duplicate", "already applied")
            return Applied(d.kind, d.id, "duplicate", "already applied")
        status, detail, to_step = "applied", None, None
        try:  # bounds (int64 ids) are checked before anything changes: a bad range refuses the directive
            SkipList(d.ranges)
        except DataError as e:
            status, detail = "failed", str(e)
        if status != "applied":
            pass
        elif d.kind == "skip-samples":
            self.add_skip(d.ranges)
            detail = f"skip list now covers {len(self.skip)} samples"
        elif d.kind == "rollback":
            status, detail, to_step = self._rollback(d)
            if status == "applied" and to_step is not None and self.relaunch_step is None:
                step = to_step
        elif d.kind == "checkpoint-now":
            self.host.save_checkpoint()
        elif d.kind in ("pause", "resume"):
            self.paused = d.kind == "pause"
            if self.bus:  # on the heartbeat: a paused run is not a hung one (sentinel status, hang rule)
                self.bus.set_paused(self.paused)
        elif d.kind == "stop":
            self.stop_requested = True
        self.applied.add(d.id)
        self._log_directive(d, status, step)
        if self.metrics and status == "applied":
            self.metrics.on_directive(d.kind, True)
        self._ack(d, step, status, detail)
        self.log(f"directive {d.kind} ({d.id[:8]}): {status}" + (f" — {detail}" if detail else ""))
        return Applied(d.kind, d.id, status, detail, to_step)

    def _rollback(self, d: Directive) -> tuple[str, str | None, int | None]:
        if d.to_step is None:
            return "failed", "rollback without to_step", None
        self.add_skip(d.ranges)  # first: a crash mid-restore must not train on the window again
        try:
            self.host.restore_checkpoint(d.to_step)  # (our trainer writes its last steps' records here)
        except RestoreFailed as e:
            return "failed", str(e), None
        except RelaunchRequired:
            self._skip_abandoned(d)
            if self.is_main:
                plan = {"id": d.id, "to_step": d.to_step, "ranges": [list(r) for r in d.ranges],
                        "reason": d.reason, "issuer": d.issuer, "time": time.time()}
                atomic_write_text(self.run_dir / PENDING_ROLLBACK, json.dumps(plan))
            self.stop_requested, self.relaunch_step = True, d.to_step
            return "applied", f"relaunch from checkpoint {d.to_step}", d.to_step
        self._skip_abandoned(d)
        self.timeline += 1
        self.mark("rollback", d.to_step, reason=d.reason, directive_id=d.id, ranges=d.ranges)
        if self.metrics:
            self.metrics.on_rollback()
        return "applied", f"resumed at step {d.to_step}, timeline {self.timeline}", d.to_step

    def _skip_abandoned(self, d: Directive) -> None:
        """``skip_after``: the samples this loop trained after the detection on the branch it abandons go on
        the skip list with the rollback itself (the sentinel's follow-up skip-samples would name the same ones,
        one poll later, or a restart later when its leader died). Computed on rank 0, the same on every rank."""
        if d.skip_after is None:
            return
        ids = self.steplog.recent_ids(self.timeline, d.skip_after) if self.is_main and self.steplog else []
        self.add_skip(self._share(ids_to_ranges(ids)))

    # ------------------------------------------------------------------ state on disk and on the bus
    def add_skip(self, ranges) -> None:
        """Grow the skip list (every rank) and persist it (rank 0: file, then bus)."""
        ranges = list(ranges)
        if ranges:
            self.skip.add(ranges)
            self.persist_skiplist()

    def persist_skiplist(self) -> None:
        if self.is_main:
            self.skip.save(self.run_dir / SKIPLIST_FILE)
            if self.bus:
                self.bus.set_skiplist(self.skip.ranges)

    def mark(self, kind: str, from_step: int, *, reason=None, directive_id=None, ranges=(), checkpoint=None) -> None:
        """A timeline marker (start / resume / rollback) in steps.jsonl and on the bus (rank 0)."""
        if not self.is_main:
            return
        self._written()
        # the reason and id come from a plan file or a directive: any text, maybe not UTF-8 (steplog.clean_text)
        rec = TimelineRecord(kind=kind, run=self.run, from_step=from_step, timeline=self.timeline,
                             time=time.time(), reason=clean_text(reason), directive_id=clean_text(directive_id),
                             skip_ranges=merge_ranges(ranges), checkpoint=checkpoint)
        write_and_publish(rec, self.steplog, self.bus)

    def end(self, step: int, detail: str | None = None) -> None:
        """The run ended on purpose at ``step`` (completed, or stopped after a checkpoint): a ``run_end``
        marker in steps.jsonl and on the bus (rank 0), so a watching sentinel does not page "trainer hung"
        once the heartbeat goes quiet. Not for a crash. Call it before closing the bus."""
        if not self.is_main:
            return
        self._written()
        rec = MarkerRecord(run=self.run, step=int(step), timeline=self.timeline, marker="run_end",
                           detail=clean_text(detail), time=time.time())
        if self.metrics:
            self.metrics.on_timeline_event("run_end")
        write_and_publish(rec, self.steplog, self.bus)

    def _written(self) -> None:
        if self.before_write is not None:
            self.before_write()

    def _ack(self, d: Directive, step: int, status: str, detail: str | None) -> None:
        if self.is_main and self.bus:
            self.bus.ack(Ack(run=self.run, directive_id=d.id, kind=d.kind, status=status, step=step,
                             timeline=self.timeline, detail=detail))

    def _log_directive(self, d: Directive, status: str, step: int) -> None:
        if not self.is_main:
            return
        entry = {"id": d.id, "kind": d.kind, "status": status, "step": step, "timeline": self.timeline,
                 "time": time.time(), "issuer": d.issuer, "reason": d.reason, "incident_id": d.incident_id}
        if d.ranges:  # what it put on the skip list: `sentinel skip-list RUN show` says why each range is there
            entry["ranges"] = [list(r) for r in d.ranges]
        with open(self.run_dir / DIRECTIVES_LOG, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _read_applied(self) -> set[str]:
        ids: set[str] = set()
        p = self.run_dir / DIRECTIVES_LOG
        if p.is_file():
            with open(p, "rb") as f:  # a crash can cut a line (and a UTF-8 character) short: such lines are skipped
                for line in f:
                    with contextlib.suppress(ValueError, KeyError, TypeError, IndexError, RecursionError):
                        did = json.loads(line)["id"]
                        if isinstance(did, str):
                            ids.add(did)
        return ids
