"""Per-rank phase times of a step, measured without a host-device sync and sent to rank 0 inside the
step's existing loss all-gather (no extra collective).

A step on one rank, between two loss all-gathers::

    data_wait ─> forward_backward ─> allreduce_wait ─> [loss all-gather] ─> optimizer
    (batch)      (until this rank's   (until every
                  last gradient       rank's gradients
                  bucket is ready)    are reduced)

In synchronous data parallelism every rank's *wall* step time is the same (the fast ranks wait for
the slow one in the all-reduce), so wall time cannot name a straggler. Its *busy* time (everything
but ``allreduce_wait``) can: the straggler is the rank that waits least. The end of
``forward_backward`` is taken from a DDP communication hook (called as each gradient bucket becomes
ready); without DDP (one rank, FSDP) it is the end of backward and ``allreduce_wait`` is 0.

Timestamps: on CPU ``time.perf_counter`` (exact: the host is the device). On CUDA, timing CUDA events
on the compute stream, read with ``Event.query()`` only once complete, so the values sent with
step t describe the newest fully finished step (usually t-1 or t-2), never a partial one.
On CPU, ``optimizer`` is the previous step's (this step's update has not run at gather time).
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from sentinel.protocol import RANK_PHASES


class PhaseClock:
    """Stamps of one rank's step boundaries; ``payload()`` gives the 4 phase times to gather."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._cur: dict[str, object] = {}
        self._grads_ready = None
        self._pending: deque[dict[str, object]] = deque()  # CUDA: finished steps whose events may still run
        self._last_optimizer = math.nan  # CPU: the previous step's optimizer time
        self._newest = [math.nan] * len(RANK_PHASES)  # CUDA: the newest fully complete step

    def _stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def begin(self) -> None:
        self._cur = {"begin": self._stamp()}
        self._grads_ready = None

    def data_ready(self) -> None:
        self._cur["data"] = self._stamp()

    def grads_ready(self) -> None:
        """Called by the DDP comm hook for every bucket: the last call marks this rank's gradients done."""
        self._grads_ready = self._stamp()

    def backward_done(self) -> None:
        """After backward (DDP: gradients reduced on every rank). Without a hook, grads were ready now."""
        now = self._stamp()
        self._cur["grads"] = self._grads_ready if self._grads_ready is not None else now
        self._cur["synced"] = now

    def end(self) -> None:
        """After the optimizer update: the step is complete."""
        cur = self._cur
        if "synced" not in cur:  # not a full training step (replay, a failed step): nothing to report
            return
        cur["end"] = self._stamp()
        if self.cuda:
            self._pending.append(cur)
            if len(self._pending) > 8:  # bounded even if the device never catches up
                self._pending.popleft()
        else:
            self._last_optimizer = cur["end"] - cur["synced"]

    def latest(self) -> dict[str, float]:
        """This rank's newest complete step (CPU: the step just ended), for its own Prometheus metrics."""
        if not self.cuda:
            c = self._cur
            if "end" not in c:
                return {}
            return as_dict([c["data"] - c["begin"], c["grads"] - c["data"], c["synced"] - c["grads"], c["end"] - c["synced"]])
        return as_dict(self.payload())

    def payload(self) -> list[float]:
        """The phase times (seconds, ``RANK_PHASES`` order; NaN = not measured yet) this rank sends with
        the current step's loss. Never waits on the device."""
        if not self.cuda:
            c = self._cur
            if "synced" not in c or "data" not in c:
                return [math.nan] * len(RANK_PHASES)
            return [c["data"] - c["begin"], c["grads"] - c["data"], c["synced"] - c["grads"], self._last_optimizer]
        while self._pending and self._pending[0]["end"].query():  # complete: elapsed_time does not block
            c = self._pending.popleft()
            ms = [c["begin"].elapsed_time(c["data"]), c["data"].elapsed_time(c["grads"]),
                  c["grads"].elapsed_time(c["synced"]), c["synced"].elapsed_time(c["end"])]
            self._newest = [m / 1000.0 for m in ms]
        return list(self._newest)


def as_dict(values) -> dict[str, float]:
    """One rank's gathered phase vector as {phase: seconds}; unmeasured (NaN) phases are left out."""
    return {p: max(0.0, float(v)) for p, v in zip(RANK_PHASES, values) if v == v}
