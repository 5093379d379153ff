"""Timelines as branches: after a rollback a step can exist on an abandoned timeline and on the
surviving one. Which records belong to which branch, which checkpoints hold a branch's state, and
the one a replay of a step on a branch restores (the contract's rollback-target rule)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from sentinel.contract.rundir import CHECKPOINT_MANIFEST
from sentinel.contract.targets import SUSPECT_UPDATES, rollback_target
from sentinel.offline import OfflineError
from sentinel.offline.loss_band import abnormal, loss_band

# ------------------------------------------------------------------------------------ branches
#
# After a rollback (or a resume) the steps after the restored checkpoint are trained again on a new
# timeline, so one step number can have a record on an abandoned branch (often the damaged one the
# on-call engineer asks about) and another on the surviving branch. Each timeline's view of the run
# is its own lineage: the records of the timeline before it up to the step it restored, then its own.
# This is the same reading as ``authoritative_steps`` (a timeline record supersedes every later step
# of the timeline before it); the surviving branch is the last timeline of the log.


@dataclass
class Branch:
    """One timeline and the records its weights went through, step by step."""

    timeline: int
    kind: str  # start | resume | rollback (how the timeline began)
    parent: int | None  # the timeline whose state it restored; None for a fresh start
    from_step: int  # the checkpoint step it restored (0 for a fresh start)
    records: dict = field(default_factory=dict)  # step -> StepRecord: the ancestors' up to from_step, then its own (kept steps)
    first: int | None = None  # the branch's first and last step, kept or not
    last: int | None = None

    def trained(self, step: int) -> bool:
        """Did this timeline train ``step`` itself (rather than inherit the record of its parent)?"""
        return step in self.records and (self.parent is None or step > self.from_step)

    def span(self) -> str:
        return f"steps {self.first}..{self.last}" if self.last is not None else "no steps"


def branches(lines, keep=lambda step: True) -> dict[int, Branch]:
    """Every timeline of a steps.jsonl record sequence, in log order (the last one survives). Only
    the records of the steps ``keep`` says yes to are held (a long run's log is millions); the
    branches' structure and spans are the whole log's."""
    from sentinel.protocol import StepRecord, TimelineRecord

    out: dict[int, Branch] = {}
    cur: Branch | None = None
    for r in lines:
        if isinstance(r, TimelineRecord):
            parent = cur if r.kind != "start" else None  # a fresh start inherits no state
            prefix = {s: x for s, x in parent.records.items() if s <= r.from_step} if parent else {}
            cur = Branch(r.timeline, r.kind, parent.timeline if parent else None, r.from_step, prefix)
            if parent is not None and parent.first is not None and parent.first <= r.from_step:
                cur.first, cur.last = parent.first, min(parent.last, r.from_step)
            out.pop(r.timeline, None)  # keep log order if a timeline number is reused
            out[r.timeline] = cur
        elif isinstance(r, StepRecord):
            if cur is None:  # a log that does not begin with a timeline record
                cur = out[r.timeline] = Branch(r.timeline, "start", None, 0)
            if keep(r.step):
                cur.records[r.step] = r
            if cur.first is None:
                cur.first = r.step
            cur.last = r.step
    return out


def owner(views: dict[int, Branch], timeline: int, step: int) -> int | None:
    """The timeline whose training produced the state after ``step`` on ``timeline``'s branch (its
    checkpoint at ``step`` is that timeline's); None for a timeline the log does not know."""
    b = views.get(timeline)
    while b is not None and b.parent is not None and step <= b.from_step:
        b = views.get(b.parent)
    return None if b is None else b.timeline


def manifest_timeline(path: Path) -> int | None:
    """The timeline a checkpoint says it was written on (its manifest; verified later), or None."""
    try:
        t = json.loads((path / CHECKPOINT_MANIFEST).read_bytes()).get("timeline")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return t if isinstance(t, int) and not isinstance(t, bool) else None


def on_branch(views: dict[int, Branch], timeline: int, ck_step: int, ck_timeline: int | None) -> bool:
    """Is checkpoint ``ck_step``, written on ``ck_timeline``, a state of ``timeline``'s branch? Yes when
    both lineages got the state after ``ck_step`` from the same timeline: the checkpoint a rollback
    restored is the common ancestor of both branches, one saved after the fork belongs to one only
    (a later timeline re-saving a step overwrites the abandoned branch's checkpoint). A checkpoint
    that names no timeline (older trainers) is taken for the surviving branch's, the last writer."""
    if ck_timeline is None:
        ck_timeline = next(reversed(views)) if views else timeline
    mine = owner(views, timeline, ck_step)
    return mine is not None and owner(views, ck_timeline, ck_step) == mine


def newest_on_branch(tr, onset: int, fits, *, suspect_updates: int = SUSPECT_UPDATES) -> tuple:
    """The contract's rollback target for ``onset`` (``rollback_target``) among the checkpoints
    ``fits(step, timeline)`` accepts and that verify: (the checkpoint or None, "step (timeline T)"
    of each one passed over for its lineage). ``suspect_updates=1`` for the state step ``onset``
    trained from (a replay); the default 2 for weights no damage seen at ``onset`` can be in. The
    lineage is read from the manifest before any sha256 is computed."""
    from trainer.checkpoint import CheckpointError, ValidCheckpoint, list_checkpoints, verify

    foreign: list[str] = []
    paths = dict(list_checkpoints(tr.ckpt.root))
    while (s := rollback_target(paths, onset, suspect_updates=suspect_updates)) is not None:
        path = paths.pop(s)
        t = manifest_timeline(path)
        if not fits(s, t):
            foreign.append(f"{s} (timeline {t if t is not None else 'unnamed'})")
            continue
        try:
            return ValidCheckpoint(s, path, verify(path)), foreign
        except CheckpointError as e:
            if tr.env.is_main:
                tr.ckpt.log(f"warning: checkpoint {e}; falling back to the previous one")
    return None, foreign


def and_list(items) -> str:
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def abandoned_by(views: dict[int, Branch], timeline: int, step: int) -> Branch | None:
    """The timeline that abandoned ``timeline``'s record of ``step``: the first later one that
    restored a checkpoint before the step (each timeline continues the one before it in the log)."""
    order = list(views)
    for b in (views[t] for t in order[order.index(timeline) + 1:]):
        if b.from_step < step:
            return b
    return None


def pick_branch(views: dict[int, Branch], run_dir: Path, step: int, timeline: int | None) -> tuple[int, dict]:
    """(branch, its records) to replay ``step`` on: ``timeline``'s, or by default the surviving one's.
    A step the chosen branch never reached is a one-line OfflineError that names where it is."""
    if not views:
        raise OfflineError(f"step {step} is not in the step log of {run_dir} (no steps)")
    elsewhere = [t for t, b in views.items() if b.trained(step)]
    if timeline is None:
        timeline = next(reversed(views))
        if step not in views[timeline].records:
            span = views[timeline].span()
            if elsewhere:
                ts = " or ".join(f"--timeline {t}" for t in elsewhere)
                raise OfflineError(f"step {step} is not on the surviving timeline {timeline} ({span}); it was trained "
                                   f"on abandoned timeline(s) {and_list(elsewhere)}: pass {ts} to replay it")
            raise OfflineError(f"step {step} is not in the step log of {run_dir} ({span})")
    elif timeline not in views:
        raise OfflineError(f"timeline {timeline} is not in the step log of {run_dir} (timelines {and_list(views)})")
    recs = views[timeline].records
    if step not in recs:
        where = f"; it was trained on timeline(s) {and_list(elsewhere)}" if elsewhere else ""
        raise OfflineError(f"step {step} is not on timeline {timeline} ({views[timeline].span()}){where}")
    return timeline, recs


def branch_warning(views: dict[int, Branch], step: int, timeline: int) -> str | None:
    """One line when ``step`` was trained on more than one timeline: which ones, which record is
    replayed, and how to replay the others. An abandoned record outside its own branch's loss band
    (or dropped by the guard) is called anomalous: that is the batch someone asking about a spike
    wants, and the default replays the surviving, usually healthy, one."""
    trained = [t for t, b in views.items() if b.trained(step)]
    if len(trained) < 2:
        return None
    rec = views[timeline].records[step]
    mine = rec.timeline if rec.timeline in trained else timeline
    surviving = views[next(reversed(views))].records.get(step)
    which = "the surviving" if surviving is rec else "the abandoned"
    head = (f"warning: step {step} was trained on timelines {and_list(trained)}: replaying {which} timeline {mine}'s "
            f"record (loss {rec.loss:.4g})")
    others = []
    for t in (t for t in trained if t != mine):
        r, by = views[t].records[step], abandoned_by(views, t, step)
        if r is surviving or by is None:
            others.append(f"timeline {t}'s is the surviving record (loss {r.loss:.4g}; replayed without --timeline)")
            continue
        odd = abnormal(r, loss_band(views[t].records, step))
        state = f"{'anomalous: ' if odd else ''}loss {r.loss:.4g}{', dropped by the guard' if r.skipped else ''}"
        others.append(f"timeline {t}'s was abandoned by a {by.kind} to step {by.from_step} ({state}): "
                      f"pass --timeline {t} to replay it")
    return head + "; " + "; ".join(others)
