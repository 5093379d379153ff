"""Drive the real daemon by hand against a real bus: synthetic step records, checkpoints, one iteration at a time."""

from __future__ import annotations

import math
import time

from sentinel import bus
from sentinel.daemon import Daemon, Options
from sentinel.metrics import SentinelMetrics
from sentinel.protocol import (
    CheckpointInfo,
    Directive,
    Keys,
    StepRecord,
)
from sentinel.rules import parse_rules

SECRET = b"test-secret-0123456789abcdef"
RULES = """\
version: 1
policy:
  rollback_margin_steps: 20
  skip_margin_steps: 2
  verify_window_steps: 40
rules:
  nonfinite:
    persist_steps: 1        # one NaN is damage: act at once
  val_divergence:
    enabled: false
"""


NAN_STEP = 45  # the step whose loss is NaN
CKPTS = (10, 20, 30, 40)  # checkpoints the "trainer" registered; rollback target = newest <= 45 - 20 = 20
TARGET = 20
PER_STEP = 8  # samples per step: step s trains ids [s*8, s*8+8)


def ids_of(step: int) -> list[int]:
    return list(range(step * PER_STEP, (step + 1) * PER_STEP))


def step_rec(run: str, step: int, loss: float | None = None, timeline: int = 0) -> StepRecord:
    if loss is None:
        loss = 3.0 - 0.001 * step + 0.01 * math.sin(step)  # a healthy, slowly falling loss
    bad = not math.isfinite(loss)
    return StepRecord(run=run, step=step, timeline=timeline, loss=loss, loss_max_rank=loss, grad_norm=1.0 + 0.01 * (step % 7),
                      lr=3e-4, tokens=step * 1024, batch_fingerprint=f"{step:016x}", sample_ids=ids_of(step),
                      skipped=bad, skip_reason="nonfinite" if bad else None, time=time.time())  # fmt: skip


def publish_steps(r, run: str, steps, *, nan_at: int | None = None, timeline: int = 0) -> None:
    for s in steps:
        bus.publish(r, Keys(run).steps, step_rec(run, s, float("nan") if s == nan_at else None, timeline), secret=SECRET)


def register_checkpoints(r, run: str, steps=CKPTS) -> None:
    now = time.time()
    r.hset(Keys(run).checkpoints, mapping={
        str(s): CheckpointInfo(run=run, step=s, path=f"/ckpt/step-{s:08d}", created=now, bytes=1, manifest_sha256="0" * 64,
                               world_size=1).to_json() for s in steps})  # fmt: skip


def make_daemon(r, run: str, consumer: str = "a", *, metrics: SentinelMetrics | None = None, lease_ms: int = 10_000,
                **opts) -> Daemon:
    o = Options(rules=parse_rules(RULES), secret=SECRET, consumer=consumer, lease_ms=lease_ms, **opts)
    logs: list[str] = []
    d = Daemon(r, o, runs=[run], metrics=metrics or SentinelMetrics(), log=logs.append)
    d.logs = logs  # type: ignore[attr-defined]
    return d


def leading(r, run: str, consumer: str = "a", **opts) -> tuple[Daemon, object]:
    """A daemon (``make_daemon``'s options) that has taken the run's lease, and its run watcher."""
    d = make_daemon(r, run, consumer, **opts)
    pump(d, until=lambda: d.watchers[run].leader)
    return d, d.watchers[run]


def pump(*daemons: Daemon, until=lambda: False, timeout: float = 10.0, min_iter: int = 1) -> None:
    """Iterate the daemons (20 ms blocking reads) until ``until()`` holds; at least ``min_iter`` rounds."""
    deadline = time.monotonic() + timeout
    n = 0
    while True:
        for d in daemons:
            d.iterate(block_ms=20)
        n += 1
        if n >= min_iter and until():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met after {timeout}s; logs: {[getattr(d, 'logs', [])[-5:] for d in daemons]}")


def directives(r, run: str) -> list[Directive]:
    return [bus.decode(bus.Entry(Keys(run).directives, eid, f)) for eid, f in r.xrange(Keys(run).directives)]


def sample(d: Daemon, name: str, **labels) -> float:
    return d.m.registry.get_sample_value(name, labels) or 0.0


def incident_run(r, run: str) -> None:
    """Checkpoints plus steps 1..NAN_STEP (NaN at the last one): enough for one rollback."""
    register_checkpoints(r, run)
    publish_steps(r, run, range(1, NAN_STEP + 1), nan_at=NAN_STEP)
