"""How a run starts: a pending offline rollback, else the newest valid checkpoint, else a fresh start.

Before anything is loaded, the files an operator may have left are read and refused in one line when
malformed: ``pending_rollback.json`` (``sentinel rollback`` of a stopped run) and ``skiplist.removed.json``
(``sentinel skip-list remove``). A run dir whose checkpoints all fail, or vanished, is never started over on
top of its history. The ControlLoop then writes the start / resume / rollback marker with a new timeline.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sentinel.contract.rundir import RunFileError
from sentinel.contract.rundir import read_skip_removals as removals_in_file
from sentinel.protocol import (
    SKIP_REMOVED,
    subtract_ranges,
)
from trainer.checkpoint import step_dir_name
from trainer.data import DataError
from trainer.errors import TrainingError


def _log(env, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


def read_skip_removals(run_dir: Path) -> tuple[list[tuple[int, int]] | None, str | None]:
    """(ranges, None) from ``skiplist.removed.json`` (``sentinel skip-list remove``; [] or no file: none),
    or (None, why) when it is unreadable or malformed: refused in one line like a bad plan (the operator asked)."""
    try:
        return removals_in_file(run_dir), None
    except RunFileError as e:
        return None, f"{e}: fix or delete it, then start again"


def start(tr) -> None:
    """Load the run's state (a pending offline rollback, else the newest valid checkpoint, else a fresh
    start) and mark it: the ControlLoop writes the start/resume/rollback marker with a new timeline."""
    env = tr.env
    tr.checkpoints.ckpt.clean_partial()
    if tr.cfg.checkpoint.async_save and not tr.checkpoints.state.sharded:  # its torch import overlaps the load
        tr.checkpoints.ckpt.start_writer()
    env.barrier()
    removed = _read_skip_removals(tr)  # a bad file is refused here, before any record is logged
    try:  # every rank stops with the same line; the plan stays on disk for the operator to fix
        plan = tr.control.pending_plan()
    except DataError as e:
        raise TrainingError(str(e)) from None
    fresh = False
    if plan is not None:
        ranges = [tuple(r) for r in plan.get("ranges", [])]
        tr.control.add_skip(ranges)  # on disk before the load: a crash now never trains on them again
        tr.load_checkpoint(int(plan["to_step"]), restore_skiplist=True)
        tr.skip.add(ranges)
        _apply_skip_removals(tr, removed, keep=ranges)
        tr.control.begin(tr.state.step, checkpoint=step_dir_name(tr.state.step))
        _log(env, f"rollback prepared offline: resumed from step {tr.state.step}")
    else:
        resumed = tr.load_checkpoint()
        if resumed is None and tr.checkpoints.unloadable:
            raise TrainingError(_unloadable_message(tr))
        if resumed is None:
            gone = _checkpoints_gone(tr)
            if gone:
                raise TrainingError(gone)
        _apply_skip_removals(tr, removed, keep=[])
        tr.control.begin(resumed or 0, checkpoint=step_dir_name(resumed) if resumed is not None else None)
        fresh = resumed is None
        _log(env, f"run {tr.run_id}: fresh start" if fresh else f"run {tr.run_id}: resumed from checkpoint step {resumed}")
    if env.is_main:  # atomically: a kill mid-write must not leave a truncated config.yaml
        tmp = tr.run_dir / ".config.yaml.tmp"
        tmp.write_text(tr._config_text)
        os.replace(tmp, tr.run_dir / "config.yaml")
        info = {"run": tr.run_id, "world_size": env.world_size, "parallelism": tr.cfg.parallelism,
                "model": tr.cfg.preset or "custom", "data_dir": str(Path(tr.data_dir).resolve()),
                "dataset_fingerprint": tr.ds.fingerprint, "device": env.device.type,
                "timeline": tr.control.timeline, "started": time.time()}
        tmp = tr.run_dir / ".run.json.tmp"
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, tr.run_dir / "run.json")
    env.barrier()
    if fresh and tr.cfg.checkpoint.initial and tr.cfg.checkpoint.every:
        # the initial state is a rollback target too: without it, damage before the first periodic
        # save can only be paged, and a NaN at step 30 would stop the run for a human. Synchronous even
        # with async saves: a run killed in its first steps resumes from it (nothing to overlap yet)
        tr.checkpoints.save(sync=True)


def _read_skip_removals(tr) -> list[tuple[int, int]]:
    """The ranges in ``skiplist.removed.json``, the same on every rank; a malformed file stops the
    start in one line before anything is loaded or logged (no ``resume`` record for a start that
    did not happen)."""
    removed, bad = None, None
    if tr.env.is_main:
        removed, bad = read_skip_removals(tr.run_dir)
    removed, bad = tr.env.broadcast_object((removed, bad))
    if bad:
        raise TrainingError(bad)
    return [tuple(r) for r in removed or []]


def _apply_skip_removals(tr, removed, keep) -> None:
    """Ranges an operator took off the skip list (``sentinel skip-list remove``, run stopped) stay
    off: the checkpoint just restored saved them, so they are subtracted here, on every rank
    alike (but not ``keep``: a pending rollback's own ranges). The file is deleted once a
    checkpoint without them is saved (``_on_checkpoint_done``)."""
    removed = subtract_ranges(removed, keep)
    if not removed:
        return
    n = tr.skip.remove(removed)
    tr.checkpoints.removals_applied = True
    _log(tr.env, f"skip list: {n} samples an operator removed ({SKIP_REMOVED}) are trained on again")


def _checkpoints_gone(tr) -> str | None:
    """A run dir whose step log reached past its first periodic checkpoint, with no checkpoint at
    all (deleted, or a mount that did not come up): a start over would append a second history
    to steps.jsonl and then save step 0, 10, ... over what comes back. Refused in one line."""
    every = tr.cfg.checkpoint.every
    last = tr.steplog.last_step() if tr.env.is_main else -1
    last = int(tr.env.broadcast_object(last))
    if not every or last < every:
        return None
    return (f"{tr.run_dir}/steps.jsonl logs steps up to {last}, but {tr.checkpoints.ckpt.root} holds no checkpoint (deleted, "
            "or a mount that did not come up?): refusing to start the run over on top of its history. Restore the "
            "checkpoints, or start a new run dir (or move steps.jsonl away to train this one from scratch)")


def _unloadable_message(tr) -> str:
    """Why a run dir whose every checkpoint failed is not started over. A fresh start would append
    a new timeline to steps.jsonl and then save step 0, 10, ... over the old step directories and
    prune the rest: the run's only copies, maybe damaged by something passing (a disk, a copy cut
    short) that a human can still repair. So nothing is touched; the operator decides."""
    n = len(tr.checkpoints.unloadable)
    shown = "; ".join(tr.checkpoints.unloadable[:3]) + (f"; and {n - 3} more" if n > 3 else "")
    return (f"none of the {n} checkpoint(s) in {tr.checkpoints.ckpt.root} can be loaded ({shown}); refusing to start over "
            f"and overwrite them: repair or restore them, or move {tr.checkpoints.ckpt.root} aside to start this run "
            "from scratch")
