"""The pure incident policy on synthetic records: a clock, warm-up, noise, damage, and the rollback it leads to."""

from __future__ import annotations

import random

from sentinel.policy import Action, RunPolicy
from sentinel.protocol import CheckpointInfo, StepRecord, TimelineRecord
from sentinel.rules import RuleSet, default_rules

RUN = "run1"
IDS_PER_STEP = 4


class Clock:
    def __init__(self, t: float = 10_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def rec(step: int, loss: float, *, timeline: int = 0, skipped: bool = False) -> StepRecord:
    return StepRecord(run=RUN, step=step, timeline=timeline, loss=loss, loss_max_rank=loss, grad_norm=0.0, lr=1e-3,
                      tokens=step * 1000, batch_fingerprint=f"fp{step}", time=1000.0 + step, skipped=skipped,
                      sample_ids=list(range(step * IDS_PER_STEP, (step + 1) * IDS_PER_STEP)))


def ckpt(step: int, timeline: int = 0) -> CheckpointInfo:
    return CheckpointInfo(run=RUN, step=step, path=f"/ckpt/step-{step}", created=1000.0 + step, bytes=1, manifest_sha256="x",
                          world_size=1, timeline=timeline)


def noise(seed: int):
    rng = random.Random(seed)
    return lambda: 3.0 * (1 + rng.gauss(0, 0.01))


def warm(p: RunPolicy, upto: int = 300, seed: int = 0, ckpt_every: int = 50) -> None:
    x = noise(seed)
    for s in range(1, upto):
        assert p.on_step(rec(s, x())) == []
        if s % ckpt_every == 0:
            p.on_checkpoint(ckpt(s))


def policy(rules: RuleSet | None = None, **kw) -> tuple[RunPolicy, Clock]:
    c = Clock()
    return RunPolicy(RUN, rules or default_rules(), clock=c, **kw), c


DAMAGE_AT = 300


def to_rollback(p: RunPolicy, loss: float = 5.0) -> Action:
    """Healthy run to 299; from 300 the loss stays high (the guard skipped the first step): damage."""
    warm(p)
    return to_rollback_from(p, DAMAGE_AT, loss)


def replay_restored(p: RunPolicy, until: int, seed: int) -> None:
    """The rollback to step 200 happens (timeline 1) and the run trains healthy to ``until`` - 1,
    saving a checkpoint every 50 steps."""
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    x = noise(seed)
    for s in range(201, until):
        p.on_step(rec(s, x(), timeline=1))
        if s % 50 == 0:
            p.on_checkpoint(ckpt(s, timeline=1))


def to_rollback_from(p: RunPolicy, start: int, loss: float = 5.0) -> Action:
    """From ``start`` the loss stays high (the guard skipped the first step) until a rollback."""
    assert p.on_step(rec(start, loss, skipped=True)) == []
    assert p.state == "suspect"  # one high batch is not damage
    acts: list[Action] = []
    s = start
    while not acts:
        s += 1
        assert s < start + 30, "persistent damage was not rolled back"
        acts = p.on_step(rec(s, loss))
    assert [a.kind for a in acts] == ["rollback"]
    return acts[0]


def detect_step(p: RunPolicy) -> int:
    return p.incidents[-1].detect_step


def damage(p: RunPolicy, start: int, timeline: int = 0, loss: float = 5.0) -> list[Action]:
    acts: list[Action] = []
    for s in range(start, start + 30):
        acts += p.on_step(rec(s, loss, timeline=timeline))
        if acts:
            break
    return acts
