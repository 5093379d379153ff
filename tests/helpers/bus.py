"""Step records on a real bus, and polling with a deadline."""

from __future__ import annotations

import time

from sentinel import bus
from sentinel.protocol import Keys, StepRecord

SECRET = b"test-secret-0123456789abcdef"


def step_record(run: str, step: int) -> StepRecord:
    return StepRecord(run=run, step=step, loss=2.0, loss_max_rank=2.1, grad_norm=1.0, lr=1e-3, tokens=step * 512,
                      batch_fingerprint=f"fp{step}", sample_ids=list(range(step * 4, step * 4 + 4)), time=time.time())  # fmt: skip


def poll(pred, timeout: float = 10.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    return pred()


def steps_in_stream(r, run: str) -> list[int]:
    return [bus.decode(bus.Entry(Keys(run).steps, eid, f)).step for eid, f in r.xrange(Keys(run).steps)]
