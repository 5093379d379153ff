"""The async save's thread: one per ``trainer.checkpoint.Checkpointer``, running its saves one at a time, at
``SCHED_IDLE`` when asked, with short GIL turns while a save runs; and ``host_copy``, the snapshot the thread
takes when it writes the files itself (``checkpoint.async_writer: thread``)."""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import weakref

import torch


def map_leaves(obj, leaf: type, fn):
    """``obj`` with every ``leaf`` instance replaced by ``fn(it)``: dicts and lists rebuilt, the rest shared
    (the containers of a checkpoint's state dicts)."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_leaves(v, leaf, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_leaves(v, leaf, fn) for v in obj]
    return obj


def built(files: dict) -> dict:
    """``files`` (name -> object) with each callable replaced by what it returns: a file an async save's
    thread builds itself (``trainer.state.CheckpointState.files(defer_live=True)``)."""
    return {name: obj() if callable(obj) else obj for name, obj in files.items()}


def host_copy(obj):
    """``obj`` with every tensor replaced by a host copy of it."""
    return map_leaves(obj, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))


# While an async save runs, a thread that waits for the GIL asks the save's thread for it after this long, not
# after Python's 5 ms. The loop's thread waits for it after every collective and every torch op (they release
# it), and the save's thread holds it while it pickles: with 2 ranks on 2 cores, every wait of a rank's loop
# frees a core that its save's thread takes, GIL included (bench/checkpoint_cost.py, 2 ranks, `small`: the
# loop blocked 2.4-2.9 ms against 3.8-7.0 ms, alternating). Python's own value comes back after each save.
ASYNC_SWITCH_INTERVAL_S = 0.0005


_turns_lock = threading.Lock()
_turns = [0, 0.0]  # async saves running in this process (any Checkpointer), the interval before the first


@contextlib.contextmanager
def _short_gil_turns():
    """``ASYNC_SWITCH_INTERVAL_S`` as the interpreter's switch interval for the block (never a longer one).
    The interval is process-wide: the first of overlapping saves sets it, the last one puts it back."""
    with _turns_lock:
        if _turns[0] == 0:
            _turns[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_turns[1], ASYNC_SWITCH_INTERVAL_S))
        _turns[0] += 1
    try:
        yield
    finally:
        with _turns_lock:
            _turns[0] -= 1
            if _turns[0] == 0:
                sys.setswitchinterval(_turns[1])


def _run_jobs(jobs: queue.SimpleQueue, idle: threading.Event, owner: weakref.ref, idle_priority: bool) -> None:
    """The checkpoint thread of one ``Checkpointer`` (``owner``): its async saves, one at a time, until
    it is let go of (a None job). It holds no reference to it between jobs, so it can be collected."""
    if idle_priority:  # this thread only (Linux schedules threads); the hashing threads it starts inherit it
        with contextlib.suppress(AttributeError, OSError):  # not Linux: normal priority
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while (job := jobs.get()) is not None:
        try:
            with _short_gil_turns():
                job()
        except BaseException as e:  # noqa: BLE001 - the thread lives on; wait() reports it
            if (ck := owner()) is not None:
                ck._async_error = ck._async_error or e
            ck = None  # a local would keep it alive while the thread waits
        finally:
            job = None  # the job's closure holds the Checkpointer: not kept while waiting for the next
            idle.set()
