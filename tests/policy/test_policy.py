"""The per-run incident state machine: transitions, rollback targets, skip lists, guardrails,
idempotency and persistence."""

from __future__ import annotations

import json

import pytest

from sentinel.policy import RunPolicy
from sentinel.protocol import Ack, MarkerRecord, TimelineRecord
from sentinel.rules import RuleSet, default_rules
from tests.helpers.policy import (
    DAMAGE_AT,
    IDS_PER_STEP,
    RUN,
    Clock,
    ckpt,
    damage,
    detect_step,
    noise,
    policy,
    rec,
    replay_restored,
    to_rollback,
    to_rollback_from,
    warm,
)


def test_walk_healthy_suspect_incident_rollback_verifying_healthy():
    p, _ = policy()
    assert p.state == "healthy"
    act = to_rollback(p)
    assert p.state == "rollback"
    d = detect_step(p)
    assert DAMAGE_AT < d <= DAMAGE_AT + 16  # it stayed high on the following, different batches
    # PaLM: newest checkpoint at least M=100 steps before the onset (300) -> 200
    assert act.to_step == 200 and act.incident_id == f"{RUN}-t0-s300"
    # skip list: sample ids of steps [onset - 10, detection]: through the end of the elevated region
    assert act.ranges == [(290 * IDS_PER_STEP, (d + 1) * IDS_PER_STEP)]
    assert p.on_ack(Ack(run=RUN, directive_id="d1", kind="rollback", status="applied", step=200, timeline=1)) == []
    assert p.state == "rollback"
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    assert p.state == "verifying"
    x = noise(5)
    for s in range(201, d + 1):
        p.on_step(rec(s, x(), timeline=1))
        assert p.state == "verifying"
    p.on_step(rec(d + 1, x(), timeline=1))
    assert p.state == "healthy"
    inc = p.incidents[0]
    assert inc.state == "healthy" and inc.closed_at is not None and inc.rollback_to == 200
    assert inc.evidence[0]["step"] == 300 and inc.evidence[0]["skipped"] is True
    kinds = [e.kind for e in p.drain_events()]
    for k in ("incident_opened", "incident", "action", "ack", "rollback", "verifying", "incident_closed"):
        assert k in kinds
    assert kinds.index("incident_opened") < kinds.index("incident") < kinds.index("verifying") < kinds.index("incident_closed")


def test_skip_ranges_read_only_the_incident_steps_even_after_a_late_record():
    """The skip list holds the ids of the steps from onset - margin to detection, read walking back
    from the newest step. A record that arrived late (step 250, after step 299) stands between
    them and the newest: the walk must not stop there and lose steps 290-299."""
    p, _ = policy()
    warm(p)
    late = rec(250, noise(3)()).model_copy(update={"sample_ids": [10**6, 10**6 + 1]})  # its ids stand apart
    assert p.on_step(late) == []
    act = to_rollback_from(p, 300)
    assert act.ranges == [(290 * IDS_PER_STEP, (detect_step(p) + 1) * IDS_PER_STEP)]
    # in order, the walk stops at the onset's margin: ids of earlier steps stay out
    q, _ = policy()
    act = to_rollback(q)
    assert act.ranges == [(290 * IDS_PER_STEP, (detect_step(q) + 1) * IDS_PER_STEP)]


@pytest.mark.parametrize("skipped", [True, False])
def test_a_spike_that_recovers_is_annotated_not_rolled_back(skipped):
    """Guard or no guard: one high batch, then the loss is back in band -> recovered, suspects kept."""
    p, _ = policy()
    warm(p)
    acts = p.on_step(rec(300, 5.0, skipped=skipped))
    acts += p.on_step(rec(301, 4.0))  # a two-step spike
    x = noise(1)
    for s in range(302, 401):
        acts += p.on_step(rec(s, x()))
    assert acts == [] and p.state == "healthy"
    inc = p.incidents[0]
    assert inc.state == "recovered" and inc.pattern == "one-off" and inc.rollback_to is None
    assert inc.suspects == [(300 * IDS_PER_STEP, 302 * IDS_PER_STEP)]  # the spike's samples, kept on record
    assert any(e.kind == "incident_closed" and "recovered" in e.message for e in p.drain_events())


def test_many_recovered_spikes_never_become_a_rollback():
    p, _ = policy()
    warm(p)
    acts = []
    x = noise(3)
    for s in range(300, 1200):
        acts += p.on_step(rec(s, 6.0 if s % 50 == 0 or s % 50 == 1 else x()))
    assert [a.kind for a in acts if a.kind in ("rollback", "pause")] == []
    assert {i.state for i in p.incidents} == {"recovered"}


def test_spike_pattern_periodic_and_increasing_pages():
    p, _ = policy()
    warm(p)
    x = noise(4)
    # every 60 steps: periodic
    spikes = {360, 420, 480, 540}
    acts = []
    for s in range(300, 560):
        acts += p.on_step(rec(s, 6.0 if s in spikes else x()))
    assert p.pattern == "periodic" and p.incidents[-1].pattern == "periodic" and acts == []
    # then ever closer together: 560 + 200, +100, +45, +25 ... -> increasing pages once
    p2, _ = policy()
    warm(p2)
    spikes2 = {400, 700, 1000, 1300, 1600, 1700, 1745, 1770}
    acts2 = []
    for s in range(300, 1800):
        acts2 += p2.on_step(rec(s, 6.0 if s in spikes2 else x()))
    assert p2.pattern == "increasing"
    pages = [a for a in acts2 if a.kind == "page"]
    assert len(pages) == 1 and "increasing" in pages[0].reason
    assert not [a for a in acts2 if a.kind in ("rollback", "pause")]


def test_same_data_coming_back_is_periodic():
    p, _ = policy()
    warm(p)
    x = noise(6)
    for s in range(300, 700):
        r = rec(s, 6.0 if s in (400, 650) else x())
        if s == 650:  # the same samples as the spike at 400 (a second epoch over the data)
            r = r.model_copy(update={"sample_ids": list(range(400 * IDS_PER_STEP, 401 * IDS_PER_STEP))})
        p.on_step(r)
    assert p.pattern == "periodic"


def test_persistent_nan_is_immediate_damage_a_single_nan_is_not():
    p, _ = policy()
    warm(p)
    assert p.on_step(rec(300, float("nan"))) == []
    x = noise(7)
    for s in range(301, 340):
        assert p.on_step(rec(s, x())) == []
    acts = []
    for s in range(340, 343):
        acts += p.on_step(rec(s, float("nan"), skipped=True))
    assert [a.kind for a in acts] == ["rollback"] and p.incidents[-1].detect_step == 342  # persist_steps = 3


def test_escalates_when_loss_does_not_recover_within_w():
    rs = RuleSet.model_validate({"policy": {"verify_window_steps": 50}, "rules": {"divergence": {"enabled": False}}})
    p, _ = policy(rs)
    warm(p)
    p.on_step(rec(300, float("nan")))
    p.on_step(rec(301, float("nan")))
    assert [a.kind for a in p.on_step(rec(302, float("nan")))] == ["rollback"]
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    acts = []
    d = p.incidents[0].detect_step
    # W counts past the bad region (the detection at 302), not from the restore: the deadline is 352
    for s in range(201, d + 50):
        acts += p.on_step(rec(s, 3.0 * 1.07, timeline=1))  # 7% high: outside the 5% band, not a spike
    assert p.state == "verifying" and acts == []
    acts += p.on_step(rec(d + 50, 3.0 * 1.07, timeline=1))
    assert p.state == "escalated"
    assert [a.kind for a in acts] == ["pause", "page"] and "did not come back" in acts[0].reason
    assert p.incidents[0].state == "escalated"
    # automation is stopped: a new spike does nothing
    assert p.on_step(rec(d + 51, 9.0, timeline=1)) == []


def test_damage_during_verification_escalates():
    p, _ = policy()
    to_rollback(p)
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    acts = []
    for s in range(201, 240):
        acts += p.on_step(rec(s, 6.0, timeline=1))
        if acts:
            break
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
    acts = damage(p, 300)
    assert p.state == "escalated" and [a.kind for a in acts] == ["pause", "page"]


def test_rate_limit_counts_real_rollbacks_in_time_and_steps():
    rs = RuleSet.model_validate({"policy": {"max_rollbacks_per_hour": 1, "rollback_window_steps": 1000}})
    p, clock = policy(rs)
    to_rollback(p)
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    x = noise(2)
    for s in range(201, 330):
        p.on_step(rec(s, x(), timeline=1))
    assert p.state == "healthy"
    p.on_checkpoint(ckpt(250, timeline=1))
    p.on_checkpoint(ckpt(300, timeline=1))
    for s in range(330, 420):
        p.on_step(rec(s, x(), timeline=1))
    clock.t += 4000  # more than an hour later, but within 1000 trained steps
    acts = damage(p, 420, timeline=1)
    assert [a.kind for a in acts] == ["pause", "page"] and "rate limit" in acts[0].reason and "steps" in acts[0].reason


def test_rate_limit_resets_after_an_hour_and_enough_steps():
    rs = RuleSet.model_validate({"policy": {"max_rollbacks_per_hour": 1, "rollback_window_steps": 100}})
    p, clock = policy(rs)
    to_rollback(p)
    replay_restored(p, 420, seed=2)
    clock.t += 4000
    assert [a.kind for a in damage(p, 420, timeline=1)] == ["rollback"]


def test_dry_run_one_fault_one_incident_and_no_rate_limit_used():
    rs = RuleSet.model_validate({"policy": {"max_rollbacks_per_hour": 1}})
    p, _ = policy(rs, dry_run=True)
    warm(p)
    for s in range(300, 700):  # the damage is never undone (nothing is sent): it persists for 400 steps
        assert p.on_step(rec(s, 5.0)) == []
    events = p.drain_events()
    acted = [e for e in events if e.kind == "action"]
    assert [e.data["action"]["kind"] for e in acted] == ["rollback"] and acted[0].data["dry_run"] is True
    assert len(p.incidents) == 1 and p.incidents[0].actions[0]["dry_run"] is True
    assert p._rollback_log == []  # pretend rollbacks never consume the rate limit
    x = noise(8)
    for s in range(700, 720):  # back in band: the held incident closes
        p.on_step(rec(s, x()))
    assert p.state == "healthy" and p.incidents[0].closed_at is not None
    for s in range(720, 1000):  # a second fault later: its own incident, would-be rollback not rate-limited
        p.on_step(rec(s, 5.0 if s >= 900 else x()))
    kinds = [e.data["action"]["kind"] for e in p.drain_events() if e.kind == "action"]
    assert kinds == ["rollback"] and len(p.incidents) == 2


def test_steps_trained_after_the_decision_join_the_skip_before_the_restore():
    """The trainer applies a rollback at its next step boundary, so a step or two more of the
    damaged branch get trained (and published) after the decision. Their samples are data of the
    elevated region too (a NaN sample one step after the detection step recurred after a rollback
    that skipped only through the detection): each is sent as a skip-samples directive and added to
    the incident's skip list. Steps of the restored branch, and replays, add nothing."""
    p, _ = policy()
    act = to_rollback(p)
    d = detect_step(p)
    assert act.skip_steps == (290, d)
    late = [p.on_step(rec(s, 5.0)) for s in (d + 1, d + 2)]
    assert [[a.kind for a in acts] for acts in late] == [["skip-samples"], ["skip-samples"]]
    assert late[0][0].ranges == [((d + 1) * IDS_PER_STEP, (d + 2) * IDS_PER_STEP)] and late[1][0].skip_steps == (d + 2, d + 2)
    assert len({a[0].idempotency_key for a in late}) == 2
    assert p.on_step(rec(d + 2, 5.0)) == []  # the same step again adds nothing
    inc = p.incidents[0]
    assert inc.skip_ranges == [(290 * IDS_PER_STEP, (d + 3) * IDS_PER_STEP)] and p.state == "rollback"
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    x = noise(5)
    assert all(p.on_step(rec(s, x(), timeline=1)) == [] for s in range(201, d + 10))  # the restored branch
    assert p.incidents[0].skip_ranges == [(290 * IDS_PER_STEP, (d + 3) * IDS_PER_STEP)]


def test_a_trainer_that_never_applies_the_rollback_gets_no_flood_of_skips():
    """A trainer that does not read directives goes on training the damaged branch: its samples
    join the skip for SKIP_LATER_MAX_STEPS steps after the detection, then the policy says once
    that the rollback was not applied and sends nothing more."""
    from sentinel.policy import SKIP_LATER_MAX_STEPS

    p, _ = policy()
    to_rollback(p)
    d = detect_step(p)
    sent = [a for s in range(d + 1, d + 200) for a in p.on_step(rec(s, 5.0))]
    assert [a.kind for a in sent] == ["skip-samples"] * SKIP_LATER_MAX_STEPS
    warned = [e for e in p.drain_events() if e.kind == "rollback_not_applied"]
    assert len(warned) == 1 and "still on the damaged branch" in warned[0].message and p.state == "rollback"


def test_steps_trained_while_approval_is_pending_join_the_waiting_rollback():
    p, _ = policy(require_approval=True)
    warm(p)
    damage(p, 300)
    assert p.state == "awaiting_approval"
    d = p.incidents[0].detect_step
    assert p.on_step(rec(d + 1, 5.0)) == []  # the step before the trainer paused: nothing sent yet ...
    acts = p.approve(p.incidents[0].id)
    assert [a.kind for a in acts] == ["rollback", "resume"]  # ... its samples ride with the rollback
    assert acts[0].ranges == [(290 * IDS_PER_STEP, (d + 2) * IDS_PER_STEP)] and acts[0].skip_steps == (290, d + 1)


def test_require_approval_pauses_and_says_so_then_rolls_back_and_resumes():
    p, _ = policy(require_approval=True)
    warm(p)
    acts = damage(p, 300)
    assert [a.kind for a in acts] == ["pause", "page"] and p.state == "awaiting_approval"
    iid = p.incidents[0].id
    assert iid in acts[1].reason and "paused" in acts[1].reason
    acts = p.approve(iid)
    assert [a.kind for a in acts] == ["rollback", "resume"] and acts[0].to_step == 200 and p.state == "rollback"
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
        for s in range(330, 350):  # a new incident after recovery
            out += p.on_step(rec(s, 5.5, timeline=1))
        return [x.model_dump() for x in out] + [p.state] + [i.model_dump(exclude={"opened_at", "closed_at"}) for i in p.incidents]

    assert tail(a) == tail(b)


def test_stale_timeline_records_are_ignored():
    p, _ = policy()
    to_rollback(p)
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    assert p.on_step(rec(330, 50.0, timeline=0)) == []  # a late record of the abandoned timeline
    assert p.state == "verifying"


def test_a_stale_marker_of_an_abandoned_timeline_changes_nothing():
    """After the rollback to 200 (timeline 1) and a healthy replay to 359, a late resume marker of
    timeline 0 from step 100 arrives. It used to rewind the detectors and drop the live timeline's
    sample ids past step 100; it is now an event and nothing else."""
    p, _ = policy()
    to_rollback(p)
    replay_restored(p, 360, seed=3)
    p.drain_events()
    before = json.dumps(p.state_dict(), sort_keys=True)
    assert p.on_timeline(TimelineRecord(kind="resume", run=RUN, from_step=100, timeline=0, time=2500.0)) == []
    assert [e.kind for e in p.drain_events()] == ["stale_marker"]
    assert json.dumps(p.state_dict(), sort_keys=True) == before  # detectors, samples, forks, checkpoints
    assert p.timeline == 1 and p.last_step == 359

def test_the_saved_state_carries_the_open_incident_and_only_the_newest_closed_ones(monkeypatch):
    """Recovered spikes every 60 steps, then damage: the saved state holds the open incident and the
    newest RECENT_CLOSED closed ones, not all; ``incidents`` still lists every one (a backtest
    reports them), and a policy restored from that state orders the same rollback."""
    monkeypatch.setattr("sentinel.policy.RECENT_CLOSED", 4)
    p, clock = policy()
    x = noise(0)
    spikes = set(range(100, 1000, 60))
    for s in range(1, 1000):
        assert p.on_step(rec(s, 6.0 if s in spikes else x())) == []
        if s % 50 == 0:
            p.on_checkpoint(ckpt(s))
    assert p.on_step(rec(1000, 5.0, skipped=True)) == [] and p.state == "suspect"
    st = json.loads(json.dumps(p.state_dict()))
    kept = [i["onset_step"] for i in st["incidents"]]
    assert kept == sorted(spikes)[-4:] + [1000]
    assert len(p.incidents) == len(spikes) + 1
    q = RunPolicy(RUN, p.rules, clock=clock)
    q.load_state_dict(st)
    for s in range(1001, 1030):
        a, b = p.on_step(rec(s, 5.0)), q.on_step(rec(s, 5.0))
        assert [x.model_dump() for x in a] == [y.model_dump() for y in b]
        if a:
            break
    assert [x.kind for x in a] == ["rollback"] and a[0].to_step <= 950


def test_tick_heartbeat_pages_with_cooldown():
    p, clock = policy()
    warm(p, upto=10)
    acts = p.on_tick(now=10_000.0, heartbeat_time=9_000.0)
    assert [a.kind for a in acts] == ["page"] and "heartbeat" in acts[0].reason
    assert p.on_tick(now=10_060.0, heartbeat_time=9_000.0) == []  # cooldown 900 s
    assert [a.kind for a in p.on_tick(now=11_000.0, heartbeat_time=9_000.0)] == ["page"]


def test_a_run_that_ended_on_purpose_is_not_paged_as_hung_until_it_trains_again():
    """A ``run_end`` marker (the trainer finished or was stopped) rests the clock rules: a finished run's
    heartbeat goes quiet and its newest checkpoint stays the newest, and neither is an incident. The
    next step (a relaunch) wakes them; the state survives a restart of the sentinel."""
    p, clock = policy()
    warm(p, upto=10)
    p.on_checkpoint(ckpt(9))
    p.on_marker(MarkerRecord(run=RUN, step=9, marker="run_end", detail="completed", time=1009.5))
    assert p.ended == {"step": 9, "time": 1009.5, "detail": "completed"}
    assert any(e.kind == "run_ended" for e in p.drain_events())
    assert p.on_tick(now=50_000.0, heartbeat_time=1009.0) == [] and p.last_findings == []
    q, _ = policy()
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.ended == p.ended and q.on_tick(now=50_000.0, heartbeat_time=1009.0) == []
    q.on_step(rec(10, 3.0))  # it trains again: the rules are back
    assert q.ended is None
    assert [a.kind for a in q.on_tick(now=50_000.0, heartbeat_time=1010.0)] == ["page", "checkpoint-now"]


@pytest.mark.parametrize("ended", [[9], {"step": -1, "time": 1.0}, {"step": 9, "time": float("nan")},
                                   {"step": 9, "time": True}, {"step": "9", "time": 1.0},
                                   {"step": 9, "time": 1.0, "detail": 7}, {"step": 9, "time": 1.0, "detail": "x" * 2000}])
def test_a_hostile_saved_run_end_is_refused(ended):
    p, _ = policy()
    warm(p, upto=10)
    d = {**p.state_dict(), "ended": ended}
    with pytest.raises(ValueError, match="ended"):
        policy()[0].load_state_dict(d)


def test_tick_checkpoint_age_requests_checkpoint():
    p, _ = policy()
    p.on_checkpoint(ckpt(100))
    acts = p.on_tick(now=1100.0 + 8000, heartbeat_time=1100.0 + 7990)
    assert [a.kind for a in acts] == ["checkpoint-now"]


def test_an_old_recovered_blip_does_not_drag_a_later_onset_back():
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
    acts = damage(p, 360, loss=6.0)
    (rb,) = [a for a in acts if a.kind == "rollback"]
    inc = p.incidents[-1]
    assert inc.onset_step == 360 and rb.to_step == 250  # newest checkpoint <= 360 - 100
    assert min(lo for lo, _ in rb.ranges) == (360 - 10) * IDS_PER_STEP  # skip window starts at onset - margin
    assert p.incidents[0].state == "recovered"  # the blip's episode was closed, not merged


def test_incidents_view_says_paused_while_awaiting_approval_and_names_dry_runs():
    from sentinel.cli.incidents_cmd import _outcome

    p, _ = policy(require_approval=True)
    warm(p)
    damage(p, 300)
    assert "paused" in _outcome(p.incidents[0], [])
    q, _ = policy(dry_run=True)
    warm(q)
    damage(q, 300)
    assert q.incidents[0].closed_at is None and _outcome(q.incidents[0], []).startswith("dry run")


@pytest.mark.parametrize("marker,acts_expected", [("mixture_change", False), ("seq_len_change", False), ("warmup_end", True), (None, True)])
def test_a_planned_level_change_restarts_the_loss_baselines(marker, acts_expected):
    """A harder mixture raises the loss by plan: with its marker the new level is the new baseline
    (no rollback, one 'rebaseline' event); the same rise without it, or after a marker that does
    not move the level, is damage and is rolled back."""
    from sentinel.protocol import MarkerRecord

    p, _ = policy()
    warm(p, upto=600)
    if marker:
        p.on_marker(MarkerRecord(run=RUN, step=599, marker=marker, detail="drill", time=1599.0))
    x, acts = noise(7), []
    for s in range(600, 900):
        acts += p.on_step(rec(s, x() + 0.3))  # +0.3 nats (10 %), held
        if s % 50 == 0:
            p.on_checkpoint(ckpt(s))
    assert any(a.kind == "rollback" for a in acts) is acts_expected, [a.kind for a in acts]
    events = [e.kind for e in p.drain_events()]
    assert events.count("rebaseline") == (1 if marker in ("mixture_change", "seq_len_change") else 0)


def test_level_markers_every_few_steps_cannot_keep_the_loss_rule_blind():
    """One rebaseline per 200 trained steps: a marker storm (a buggy or hostile schedule) leaves
    the baselines learning once, then judging; real damage after it is still rolled back."""
    from sentinel.protocol import MarkerRecord

    p, _ = policy()
    warm(p, upto=600)
    x, acts = noise(3), []
    for s in range(600, 1000):
        p.on_marker(MarkerRecord(run=RUN, step=s - 1, marker="mixture_change", time=1000.0 + s))
        acts += p.on_step(rec(s, x() + (0.0 if s < 850 else 0.6)))
        if s % 50 == 0:
            p.on_checkpoint(ckpt(s))
    kinds = [e.kind for e in p.drain_events()]
    assert kinds.count("rebaseline") == 2 and kinds.count("rebaseline_skipped") >= 300  # at 600 and 800
    assert any(a.kind == "rollback" for a in acts)
    st = p.state_dict()
    q, _ = policy()
    q.load_state_dict(json.loads(json.dumps(st)))
    assert q._rebaselined_at == p._rebaselined_at
