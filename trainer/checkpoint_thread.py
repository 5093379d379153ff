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


class HostStage:
    """A sync save's copy of its device tensors to the host: into buffers kept from one save to the next
    (pinned where CUDA is there), all copies queued, then one wait. ``tensor_file`` would otherwise copy
    each tensor on its own into fresh pageable memory: on an H200 that took 0.95 s of a gpt2-124m save
    (1.5 GB), against 0.10 s for an async save's copy into its writer's arena. Views of the same memory
    (tied weights) get the same host tensor, so the file still writes them once.

    The buffers are kept only while they take at most ``KEEP_BYTES`` and an eighth of the host's memory:
    a larger state is copied into buffers of its own save, dropped with it (pageable: pinning that much
    for a moment costs more than it saves). Where the host refuses pinned memory (a locked-memory
    limit), the kept buffers are pageable."""

    KEEP_BYTES = 8 << 30

    def __init__(self, device_type: str = "cuda"):
        self.device_type = device_type  # whose tensors are copied ("cpu" in a test: copies of host tensors)
        self.specs: list | None = None
        self.buffers: list[torch.Tensor] = []
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (OSError, ValueError):
            host = 0
        self.keep_bytes = min(self.KEEP_BYTES, host // 8) if host else self.KEEP_BYTES

    def stage(self, *objs):
        found: dict[tuple, int] = {}
        tensors: list[torch.Tensor] = []

        def key(t: torch.Tensor) -> tuple:
            return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

        def collect(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == self.device_type and found.setdefault(key(t), len(tensors)) == len(tensors):
                tensors.append(t)
            return t

        for obj in objs:
            map_leaves(obj, torch.Tensor, collect)
        if not tensors:
            return objs
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        if sum(t.numel() * t.element_size() for t in tensors) > self.keep_bytes:
            self.specs, self.buffers = None, []
            buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]  # this save's own
        else:
            if specs != self.specs:
                self.buffers = []  # the old ones go before the new ones are taken
                self.buffers = self._allocate(specs)
                self.specs = specs
            buffers = self.buffers
        for dst, src in zip(buffers, tensors):
            dst.copy_(src.detach(), non_blocking=True)
        if self.device_type == "cuda":
            torch.cuda.synchronize(tensors[0].device)
        return tuple(map_leaves(obj, torch.Tensor, lambda t: buffers[found[key(t)]] if t.device.type == self.device_type else t)
                     for obj in objs)

    def _allocate(self, specs: list) -> list[torch.Tensor]:
        if self.device_type == "cuda":
            try:
                return [torch.empty(shape, dtype=dtype, pin_memory=True) for shape, dtype in specs]
            except RuntimeError:  # no pinned memory to be had here: pageable, still kept
                pass
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]


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
