"""The per-run incident state machine: transitions, rollback targets, skip lists, guardrails,
idempotency and persistence."""

from __future__ import annotations

import json
import random

import pytest

from sentinel.policy import Action, RunPolicy
from sentinel.protocol import Ack, CheckpointInfo, StepRecord, TimelineRecord
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


def to_rollback(p: RunPolicy) -> Action:
    """Healthy run to 299, a guard-skipped spike at 300 (suspect), an unskipped one at 301 (incident)."""
    warm(p)
    assert p.on_step(rec(300, 5.0, skipped=True)) == []
    assert p.state == "suspect"
    acts = p.on_step(rec(301, 5.2))
    assert [a.kind for a in acts] == ["rollback"]
    return acts[0]


def test_walk_healthy_suspect_incident_rollback_verifying_healthy():
    p, _ = policy()
    assert p.state == "healthy"
    act = to_rollback(p)
    assert p.state == "rollback"
    # PaLM: newest checkpoint at least M=100 steps before the onset (300) -> 200
    assert act.to_step == 200 and act.incident_id == f"{RUN}-t0-s300"
    # skip list: sample ids of steps [onset - 10, detection] = [290, 301]
    assert act.ranges == [(290 * IDS_PER_STEP, 302 * IDS_PER_STEP)]
    assert p.on_ack(Ack(run=RUN, directive_id="d1", kind="rollback", status="applied", step=200, timeline=1)) == []
    assert p.state == "rollback"
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    assert p.state == "verifying"
    x = noise(5)
    for s in range(201, 302):
        p.on_step(rec(s, x(), timeline=1))
        assert p.state == "verifying"
    p.on_step(rec(302, x(), timeline=1))
    assert p.state == "healthy"
    inc = p.incidents[0]
    assert inc.state == "healthy" and inc.closed_at is not None and inc.rollback_to == 200
    assert [e["step"] for e in inc.evidence] == [300, 301] and inc.evidence[0]["skipped"] is True
    kinds = [e.kind for e in p.drain_events()]
    for k in ("incident_opened", "incident", "action", "ack", "rollback", "verifying", "incident_closed"):
        assert k in kinds
    assert kinds.index("incident_opened") < kinds.index("incident") < kinds.index("verifying") < kinds.index("incident_closed")


def test_suspect_clears_when_quiet():
    p, _ = policy()
    warm(p)
    p.on_step(rec(300, 5.0, skipped=True))
    x = noise(1)
    for s in range(301, 401):
        p.on_step(rec(s, x()))
    assert p.state == "healthy" and p.incidents[0].state == "healthy"


def test_too_many_skipped_anomalies_become_an_incident():
    p, _ = policy()
    warm(p)
    kinds = []
    for s in range(300, 304):
        kinds += [a.kind for a in p.on_step(rec(s, 5.0, skipped=True))]
    assert kinds == ["rollback"]  # the 4th skipped spike exceeds suspect_max_skipped=3


def test_escalates_when_loss_does_not_recover_within_w():
    rs = RuleSet.model_validate({"policy": {"verify_window_steps": 50}, "rules": {"divergence": {"enabled": False}}})
    p, _ = policy(rs)
    to_rollback(p)
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    acts = []
    for s in range(201, 251):
        acts += p.on_step(rec(s, 3.0 * 1.07, timeline=1))  # 7% high: outside the 5% band, not a spike
    assert p.state == "escalated"
    assert [a.kind for a in acts] == ["pause", "page"]
    assert p.incidents[0].state == "escalated"
    # automation is stopped: a new spike does nothing
    assert p.on_step(rec(251, 9.0, timeline=1)) == []


def test_anomaly_during_verification_escalates():
    p, _ = policy()
    to_rollback(p)
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    acts = p.on_step(rec(201, 6.0, timeline=1))
    assert p.state == "escalated" and [a.kind for a in acts] == ["pause", "page"]


def test_rejected_rollback_escalates():
    p, _ = policy()
    to_rollback(p)
    acts = p.on_ack(Ack(run=RUN, directive_id="d1", kind="rollback", status="rejected", step=301, detail="bad signature"))
    assert p.state == "escalated" and [a.kind for a in acts] == ["pause", "page"]


def test_rollback_target_selection():
    p, _ = policy()
    for s in (50, 120, 180, 250):
        p.on_checkpoint(ckpt(s))
    assert p._pick_target(300) == 180  # newest <= 300 - 100
    assert p._pick_target(140) == 50  # none <= 40: the oldest <= onset
    assert p._pick_target(30) is None
    p.on_checkpoint(ckpt(190).model_copy(update={"verified": "failed"}))
    assert p._pick_target(300) == 180  # failed checkpoints are never targets


def test_no_checkpoint_escalates():
    p, _ = policy()
    warm(p, ckpt_every=10_000)
    acts = p.on_step(rec(300, 5.0))
    assert p.state == "escalated" and [a.kind for a in acts] == ["pause", "page"]


def test_rate_limit_escalates():
    rs = RuleSet.model_validate({"policy": {"max_rollbacks_per_hour": 1}})
    p, clock = policy(rs)
    warm(p)
    assert [a.kind for a in p.on_step(rec(300, 5.0))] == ["rollback"]
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    x = noise(2)
    for s in range(201, 302):
        p.on_step(rec(s, x(), timeline=1))
    assert p.state == "healthy"
    p.on_checkpoint(ckpt(250, timeline=1))
    p.on_checkpoint(ckpt(300, timeline=1))
    for s in range(302, 420):
        p.on_step(rec(s, x(), timeline=1))
    clock.t += 600  # ten minutes later: still inside the hour
    acts = p.on_step(rec(420, 5.0, timeline=1))
    assert [a.kind for a in acts] == ["pause", "page"] and "rate limit" in acts[0].reason


def test_dry_run_emits_nothing_but_records_decisions():
    p, _ = policy(dry_run=True)
    warm(p)
    assert p.on_step(rec(300, 5.0)) == []
    events = p.drain_events()
    acted = [e for e in events if e.kind == "action"]
    assert acted and acted[0].data["dry_run"] is True and acted[0].data["action"]["kind"] == "rollback"
    assert p.incidents[0].actions[0]["dry_run"] is True
    assert p.state == "healthy"  # nothing will be restored, so it keeps watching


def test_require_approval_waits_for_approve():
    p, _ = policy(require_approval=True)
    warm(p)
    acts = p.on_step(rec(300, 5.0))
    assert [a.kind for a in acts] == ["page"] and p.state == "awaiting_approval"
    iid = p.incidents[0].id
    assert iid in acts[0].reason
    acts = p.approve(iid)
    assert [a.kind for a in acts] == ["rollback"] and acts[0].to_step == 200 and p.state == "rollback"
    with pytest.raises(ValueError):
        p.approve(iid)
    with pytest.raises(ValueError):
        p.approve("nope")


def test_approve_after_escalation_resumes():
    p, _ = policy()
    to_rollback(p)
    p.on_ack(Ack(run=RUN, directive_id="d1", kind="rollback", status="failed", step=301))
    acts = p.approve(p.incidents[0].id)
    assert [a.kind for a in acts] == ["resume"] and p.state == "healthy"


def test_idempotency_keys_are_deterministic():
    a, _ = policy()
    b, _ = policy()
    ka, kb = to_rollback(a).idempotency_key, to_rollback(b).idempotency_key
    assert ka == kb == f"{RUN}:{RUN}-t0-s300:rollback:1"


def test_state_dict_round_trip_mid_incident_gives_identical_actions():
    a, clock_a = policy()
    to_rollback(a)
    a.drain_events()
    sd = json.loads(json.dumps(a.state_dict()))  # must be plain JSON
    b = RunPolicy(RUN, default_rules(), clock=Clock(clock_a.t))
    b.load_state_dict(sd)
    assert b.state == a.state == "rollback"

    def tail(p: RunPolicy) -> list[dict]:
        out = p.on_ack(Ack(run=RUN, directive_id="d1", kind="rollback", status="applied", step=200, timeline=1, time=5.0))
        out += p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
        x = noise(9)
        for s in range(201, 330):
            out += p.on_step(rec(s, x(), timeline=1))
            if s % 50 == 0:
                p.on_checkpoint(ckpt(s, timeline=1))
        out += p.on_step(rec(330, 5.5, timeline=1))  # a new incident after recovery
        return [x.model_dump() for x in out] + [p.state] + [i.model_dump(exclude={"opened_at", "closed_at"}) for i in p.incidents]

    assert tail(a) == tail(b)


def test_stale_timeline_records_are_ignored():
    p, _ = policy()
    to_rollback(p)
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    assert p.on_step(rec(302, 50.0, timeline=0)) == []  # a late record of the abandoned timeline
    assert p.state == "verifying"


def test_tick_heartbeat_pages_with_cooldown():
    p, clock = policy()
    warm(p, upto=10)
    acts = p.on_tick(now=10_000.0, heartbeat_time=9_000.0)
    assert [a.kind for a in acts] == ["page"] and "heartbeat" in acts[0].reason
    assert p.on_tick(now=10_060.0, heartbeat_time=9_000.0) == []  # cooldown 900 s
    assert [a.kind for a in p.on_tick(now=11_000.0, heartbeat_time=9_000.0)] == ["page"]


def test_tick_checkpoint_age_requests_checkpoint():
    p, _ = policy()
    p.on_checkpoint(ckpt(100))
    acts = p.on_tick(now=1100.0 + 8000, heartbeat_time=1100.0 + 7990)
    assert [a.kind for a in acts] == ["checkpoint-now"]


def test_an_old_guard_handled_blip_does_not_drag_a_later_onset_back():
    """A NaN the guard skipped at step 300, then real damage at 360: the rollback must be planned
    from onset 360 (target <= 260, skip window from 350), not from 300 (which would lose 60 more steps
    of data and skip samples that did nothing wrong)."""
    p, _ = policy()
    warm(p, upto=300)
    for s in (300, 350):  # checkpoints around the blip
        p.on_checkpoint(ckpt(s))
    p.on_step(rec(300, float("nan"), skipped=True))
    assert p.state == "suspect"
    x = noise(2)
    for s in range(301, 360):
        p.on_step(rec(s, x()))
    acts = []
    for s in range(360, 366):
        acts += p.on_step(rec(s, 6.0))
    (rb,) = [a for a in acts if a.kind == "rollback"]
    inc = p.incidents[-1]
    assert inc.onset_step == 360 and rb.to_step == 250  # newest checkpoint <= 360 - 100
    assert min(lo for lo, _ in rb.ranges) == (360 - 10) * IDS_PER_STEP  # skip window starts at onset - margin
    assert p.incidents[0].state == "healthy"  # the blip's episode was closed, not merged
