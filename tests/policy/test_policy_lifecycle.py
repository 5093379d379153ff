"""RunPolicy incident lifecycle after the decision: the restore and its verification, a restore
that never comes (or comes without its marker), restarts while a rollback or an approval waits,
which checkpoints may be rollback targets, cooldowns under a clock that steps back, and dry runs
with approval (a backlog replay)."""

from __future__ import annotations

import json
import random

from sentinel.policy import SKIP_LATER_MAX_STEPS, Action, RunPolicy
from sentinel.protocol import CheckpointInfo, StepRecord, TimelineRecord
from sentinel.rules import RuleSet
from tests.helpers.policy import IDS_PER_STEP, RUN, Clock, damage, noise, policy, rec, replay_restored, warm


def ckpt(step: int, timeline: int = 0, **kw) -> CheckpointInfo:
    return CheckpointInfo(run=RUN, step=step, path=f"/ckpt/t{timeline}/step-{step}", created=1000.0 + step, bytes=1,
                          manifest_sha256="x", world_size=1, timeline=timeline, **kw)


def rules(**pol) -> RuleSet:
    return RuleSet.model_validate({"policy": pol})


def kinds(acts: list[Action]) -> list[str]:
    return [a.kind for a in acts]


def roundtrip(p: RunPolicy, clock: Clock) -> RunPolicy:
    q = RunPolicy(RUN, p.rules, clock=clock, dry_run=p.dry_run, require_approval=p.require_approval)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    return q


def to_rollback(p: RunPolicy) -> tuple[Action, int]:
    """Healthy to 299 (checkpoints every 50), damage from 300: a rollback to 200. Returns it and the detection step."""
    warm(p)
    acts = damage(p, 300)
    assert kinds(acts) == ["rollback"] and acts[0].to_step == 200 and p.state == "rollback"
    return acts[0], p.incidents[0].detect_step


# ---------------------------------------------------------------- 1. the replay after a restore


def falling_run(p: RunPolicy, onset: int, curve, ckpt_every: int) -> tuple[dict[int, float], Action]:
    healthy: dict[int, float] = {}
    for s in range(1, onset):
        healthy[s] = curve(s)
        assert p.on_step(rec(s, healthy[s])) == []
        if s % ckpt_every == 0:
            p.on_checkpoint(ckpt(s))
    acts = damage(p, onset, loss=healthy[onset - 1] * 1.6)
    assert kinds(acts) == ["rollback"]
    return healthy, acts[0]


def replay(p: RunPolicy, healthy: dict[int, float], curve, frm: int, to: int) -> list[Action]:
    out: list[Action] = []
    for s in range(frm, to):
        if s not in healthy:
            healthy[s] = curve(s)
        out += p.on_step(rec(s, healthy[s], timeline=1))
        if p.state != "verifying":
            break
    return out


def test_a_healthy_replay_on_a_falling_curve_is_judged_from_the_restored_step():
    """Early in training (loss a + b/sqrt(step)): damage at 400 -> rollback to 300. The replay of
    301.. is the very same healthy curve; judged against the old branch's level at 399 (lower) it
    looked like a climb and was escalated. Rewound to the restored step, it verifies."""
    rng = random.Random(0)

    def curve(s: int) -> float:
        return (2.5 + 20.0 / s ** 0.5) * (1 + rng.gauss(0, 0.005))

    p, _ = policy()
    healthy, act = falling_run(p, 400, curve, 50)
    assert act.to_step == 300
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=300, timeline=1, time=5000.0))
    out = replay(p, healthy, curve, 301, 800)
    inc = p.incidents[0]
    assert out == [] and p.state == "healthy" and inc.state == "healthy", (kinds(out), out and out[0].reason)
    assert inc.closed_step == inc.detect_step + 1  # closed once the replay passed the bad region


def test_the_verification_window_counts_past_the_bad_region_not_from_the_restore():
    """verify_window_steps=50, a checkpoint 100+ steps before the onset on a falling curve: the
    replay's own losses (above the onset's baseline) must not use up the window before the replay
    even reaches the onset (the old deadline, restore + 50, fell at step 350 of a 400 onset)."""
    rng = random.Random(1)

    def curve(s: int) -> float:  # 3.9 at step 200, down to 3.0 at 400 and flat after
        return (3.0 + 0.9 * max(0.0, (400 - s) / 200)) * (1 + rng.gauss(0, 0.003))

    p, _ = policy(rules(verify_window_steps=50))
    healthy, act = falling_run(p, 400, curve, 100)
    assert act.to_step == 300
    d = p.incidents[0].detect_step
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=300, timeline=1, time=5000.0))
    out = replay(p, healthy, curve, 301, 600)
    assert out == [] and p.state == "healthy", (kinds(out), out and out[0].reason)
    assert p.incidents[0].closed_step == d + 1


def test_a_flat_replay_is_not_declared_recovered_before_it_reaches_the_onset():
    """The window counted from the restore also ended verification early: restore at 200, W=50,
    the (healthy) replay was declared recovered at step 250, before the replay reached the onset."""
    p, _ = policy(rules(verify_window_steps=50))
    warm(p, ckpt_every=100)
    acts = damage(p, 300)
    assert kinds(acts) == ["rollback"] and acts[0].to_step == 200
    d = p.incidents[0].detect_step
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=5000.0))
    x = noise(4)
    for s in range(201, d + 1):
        assert p.on_step(rec(s, x(), timeline=1)) == []
        assert p.state == "verifying", s
    p.on_step(rec(d + 1, x(), timeline=1))
    assert p.state == "healthy" and p.incidents[0].closed_step == d + 1


def test_the_deadline_still_escalates_past_the_bad_region():
    rs = RuleSet.model_validate({"policy": {"verify_window_steps": 50}, "rules": {"divergence": {"enabled": False}}})
    p, _ = policy(rs)
    warm(p)
    acts = [a for s in (300, 301, 302) for a in p.on_step(rec(s, float("nan")))]  # persistent NaN: damage
    assert kinds(acts) == ["rollback"] and acts[0].to_step == 200
    d = p.incidents[0].detect_step
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    acts: list[Action] = []
    for s in range(201, d + 50):
        acts += p.on_step(rec(s, 3.0 * 1.07, timeline=1))  # 7% high: outside the 5% band
    assert acts == [] and p.state == "verifying"
    acts = p.on_step(rec(d + 50, 3.0 * 1.07, timeline=1))
    assert kinds(acts) == ["pause", "page"] and "past the bad region" in acts[0].reason and p.state == "escalated"


# ---------------------------------------------------------------- 2. a non-finite loss while verifying


def test_a_nan_during_verification_escalates_instead_of_closing():
    p, _ = policy()
    _, d = to_rollback(p)
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    x = noise(5)
    for s in range(201, d + 1):
        assert p.on_step(rec(s, x(), timeline=1)) == []
    assert p.state == "verifying"
    acts = p.on_step(rec(d + 1, float("nan"), timeline=1, skipped=True))
    assert kinds(acts) == ["pause", "page"] and "non-finite" in acts[0].reason
    assert p.state == "escalated" and p.incidents[0].state == "escalated" and p.incidents[0].closed_at is None
    more = [a for s in range(d + 2, d + 6) for a in p.on_step(rec(s, float("nan"), timeline=1, skipped=True))]
    assert more == [] and len(p.incidents) == 1  # hands off: no second incident, no second rollback


def test_an_inf_loss_early_in_the_replay_escalates_too():
    p, _ = policy()
    to_rollback(p)
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    assert p.on_step(rec(201, 3.0, timeline=1)) == []
    acts = p.on_step(rec(202, float("inf"), timeline=1))
    assert kinds(acts) == ["pause", "page"] and p.state == "escalated"


def test_a_dry_run_hold_does_not_close_on_a_nan():
    """A held dry-run incident closes when the loss is back in band; a NaN in the recent losses
    must not make the median look in band."""
    p, _ = policy(dry_run=True)
    warm(p)
    for s in range(300, 330):
        p.on_step(rec(s, 5.0))
    assert p.state == "verifying" and p._ep.get("held")
    x = noise(2)
    for s in range(330, 340):  # NaN, healthy, NaN, ...: never five finite losses in a row
        p.on_step(rec(s, float("nan") if s % 2 == 0 else x()))
    assert p.state == "verifying"
    for s in range(340, 346):
        p.on_step(rec(s, x()))
    assert p.state == "healthy"


# ---------------------------------------------------------------- 3. a way out of "rollback"


def test_a_lost_rollback_marker_is_inferred_from_the_new_timeline():
    """The restore happened (steps of timeline 1 from step 201) but its marker was trimmed from the
    stream: the first record of the new timeline is the restore; verification follows, and a later
    fault on the restored branch is acted on."""
    p, _ = policy()
    _, d = to_rollback(p)
    x = noise(5)
    out: list[Action] = []
    for s in range(201, 600):
        out += p.on_step(rec(s, x(), timeline=1))
        if s == 201:
            assert p.state == "verifying" and p._ep["verify_from"] == 200
        if s % 50 == 0:
            p.on_checkpoint(ckpt(s, timeline=1))
    assert out == [] and p.state == "healthy"
    inc = p.incidents[0]
    assert inc.state == "healthy" and inc.closed_step == d + 1
    events = [e.kind for e in p.drain_events()]
    assert "timeline_inferred" in events and "verifying" in events
    acts = damage(p, 600, timeline=1, loss=6.0)
    assert kinds(acts) == ["rollback"] and len(p.incidents) == 2 and acts[0].to_step == 500


def test_a_resume_before_the_rollback_was_applied_escalates_after_a_window():
    """The trainer restarted by itself from a checkpoint past the onset before applying the
    rollback: its resumed run must not train on unjudged forever."""
    p, _ = policy(rules(verify_window_steps=60))
    warm(p)
    p.on_checkpoint(ckpt(300))  # a checkpoint of the damaged branch
    acts = damage(p, 300)
    assert kinds(acts) == ["rollback"] and acts[0].to_step == 200
    p.on_timeline(TimelineRecord(kind="resume", run=RUN, from_step=300, timeline=1, time=2000.0))
    assert p.state == "rollback"
    assert "rollback_pending" in [e.kind for e in p.drain_events()]
    out: list[Action] = []
    for s in range(301, 500):
        out += p.on_step(rec(s, 5.0, timeline=1))
        if out:
            break
    assert kinds(out) == ["pause", "page"] and "rollback not applied" in out[0].reason and p.state == "escalated"
    assert s < 301 + 60  # within the window of steps since the rollback was sent


def test_a_rollback_never_applied_escalates_after_a_window_and_survives_a_restart():
    p, clock = policy(rules(verify_window_steps=60))
    _, d = to_rollback(p)
    sent_at = p.steps_seen
    out: list[Action] = []
    for s in range(d + 1, d + 30):
        out += p.on_step(rec(s, 5.0))
    assert p.state == "rollback" and all(a.kind == "skip-samples" for a in out)
    p = roundtrip(p, clock)  # a restarted daemon keeps counting
    out = []
    for s in range(d + 30, d + 200):
        out += [a for a in p.on_step(rec(s, 5.0)) if a.kind != "skip-samples"]
        if out:
            break
    assert kinds(out) == ["pause", "page"] and "rollback not applied" in out[0].reason
    assert p.steps_seen - sent_at == 60


def test_a_rollback_applied_in_time_is_not_escalated():
    """The default window is far longer than a trainer takes to apply a rollback."""
    p, _ = policy()
    _, d = to_rollback(p)
    for s in range(d + 1, d + 3):
        p.on_step(rec(s, 5.0))
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    assert p.state == "verifying"


# ---------------------------------------------------------------- 4. checkpoints of an abandoned branch


def test_a_late_checkpoint_of_the_abandoned_branch_is_never_a_target():
    p, clock = policy()
    _, d = to_rollback(p)
    replay_restored(p, 340, seed=3)
    assert p.state == "healthy"
    p.on_checkpoint(ckpt(d, timeline=0))  # the async save of the damaged branch registers late
    assert d not in p._checkpoints
    assert "checkpoint_ignored" in [e.kind for e in p.drain_events()]
    p.on_checkpoint(ckpt(150, timeline=0))  # before the fork: still on the surviving lineage
    assert 150 in p._checkpoints
    q = roundtrip(p, clock)  # the fork points survive a daemon restart
    q.on_checkpoint(ckpt(d - 1, timeline=0))
    assert d - 1 not in q._checkpoints and q._forks == p._forks
    # and the picker would not choose one even if it were there
    q._checkpoints[d] = ckpt(d, timeline=0)
    assert q._pick_target(d + 100 + 5) == 300


def test_forks_keep_only_the_fork_points_that_matter():
    p, _ = policy()
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=500, timeline=1, time=1.0))
    p.on_timeline(TimelineRecord(kind="resume", run=RUN, from_step=800, timeline=2, time=2.0))
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=400, timeline=3, time=3.0))
    assert p._forks == [[3, 400]]  # timeline 3 forked every older timeline at 400
    p.on_checkpoint(ckpt(460, timeline=2))  # after timeline 3's fork point: abandoned
    p.on_checkpoint(ckpt(700, timeline=1))
    p.on_checkpoint(ckpt(400, timeline=2))  # the fork point itself: the restored checkpoint
    p.on_checkpoint(ckpt(450, timeline=3))
    assert sorted((s, c.timeline) for s, c in p._checkpoints.items()) == [(400, 2), (450, 3)]


# ---------------------------------------------------------------- 5. a checkpoint at the onset step


def test_a_checkpoint_at_the_onset_step_is_never_the_target():
    p, _ = policy(rules(rollback_margin_steps=0))
    warm(p, ckpt_every=100)
    p.on_checkpoint(ckpt(300))
    p.on_step(rec(300, 5.0))
    acts = damage(p, 301)
    assert p.incidents[0].onset_step == 300 and kinds(acts) == ["rollback"] and acts[0].to_step == 200
    q, _ = policy()  # default margin, and the only checkpoint is the onset step's: nothing to roll back to
    warm(q, ckpt_every=10_000)
    q.on_checkpoint(ckpt(300))
    q.on_step(rec(300, 5.0))
    acts = damage(q, 301)
    assert kinds(acts) == ["pause", "page"] and q.state == "escalated"
    r, _ = policy()
    for s in (50, 120, 140):
        r.on_checkpoint(ckpt(s))
    assert r._pick_target(140) == 50 and r._pick_target(50) is None


# ---------------------------------------------------------------- 6. a restart while approval is pending


def test_a_restart_while_awaiting_approval_pauses_again_and_joins_the_skip():
    p, clock = policy(require_approval=True)
    warm(p)
    acts = damage(p, 300)
    assert kinds(acts) == ["pause", "page"] and p.state == "awaiting_approval"
    inc = p.incidents[0]
    d = inc.detect_step
    assert p.on_step(rec(d + 1, 5.0)) == []  # the step before the pause took effect
    p.on_checkpoint(ckpt(d + 1))  # the preempted trainer saved the (damaged) weights, and restarts
    out = p.on_timeline(TimelineRecord(kind="resume", run=RUN, from_step=d + 1, timeline=1, time=3000.0))
    assert kinds(out) == ["pause"] and out[0].incident_id == inc.id and "restarted" in out[0].reason
    assert out[0].idempotency_key != acts[0].idempotency_key and p.state == "awaiting_approval"
    p = roundtrip(p, clock)
    # trained on the new timeline before the new pause took effect: up to SKIP_LATER_MAX_STEPS steps
    # counted from the restart join the waiting rollback (the cap counts anew from the restart)
    for s in range(d + 2, d + 2 + SKIP_LATER_MAX_STEPS + 5):
        assert p.on_step(rec(s, 5.0, timeline=1)) == []
    acts = p.approve(inc.id)
    assert kinds(acts) == ["rollback", "resume"]
    rb = acts[0]
    last = d + 1 + SKIP_LATER_MAX_STEPS
    assert rb.to_step == 200 and rb.skip_steps == (290, last)
    assert rb.ranges == [(290 * IDS_PER_STEP, (last + 1) * IDS_PER_STEP)]


def test_a_late_marker_of_an_old_timeline_does_not_re_pause():
    p, _ = policy(require_approval=True)
    warm(p)
    damage(p, 300)
    d = p.incidents[0].detect_step
    assert kinds(p.on_timeline(TimelineRecord(kind="resume", run=RUN, from_step=d, timeline=1, time=3000.0))) == ["pause"]
    assert p.on_timeline(TimelineRecord(kind="start", run=RUN, from_step=0, timeline=0, time=1000.0)) == []
    assert p.on_step(rec(d + 1, 5.0, timeline=1)) == []
    assert p.approve(p.incidents[0].id)[0].skip_steps == (290, d + 1)  # steps of the current timeline still join


def test_a_lost_marker_while_awaiting_approval_is_a_restart_too():
    p, _ = policy(require_approval=True)
    warm(p)
    damage(p, 300)
    d = p.incidents[0].detect_step
    out = p.on_step(rec(d + 1, 5.0, timeline=1))
    assert kinds(out) == ["pause"] and p.state == "awaiting_approval"
    assert p.on_step(rec(d + 2, 5.0, timeline=1)) == []
    rb = p.approve(p.incidents[0].id)[0]
    assert rb.skip_steps == (290, d + 2)


# ---------------------------------------------------------------- 7. the wall clock steps back


def test_a_clock_stepping_back_does_not_silence_a_hang_page():
    p, _ = policy()
    warm(p, upto=20)
    t0 = 100_000.0
    assert kinds(p.on_tick(now=t0, heartbeat_time=t0 - 1000)) == ["page"]
    t = t0 - 7200  # NTP steps the clock back two hours while the trainer stays hung
    pages = [i for i in range(0, 7200, 60)
             if any(a.kind == "page" for a in p.on_tick(now=t + i, heartbeat_time=t + i - 1000))]
    assert pages[0] == 0  # at once, then every cooldown (900 s) again
    assert all(b - a >= 900 for a, b in zip(pages, pages[1:])) and 7 <= len(pages) <= 9


# ---------------------------------------------------------------- 8. a checkpoint that failed verification


def test_a_checkpoint_re_registered_as_failed_is_withdrawn():
    p, _ = policy()
    warm(p)
    p.on_checkpoint(ckpt(200, verified="failed"))
    assert 200 not in p._checkpoints
    assert "checkpoint_withdrawn" in [e.kind for e in p.drain_events()]
    acts = damage(p, 300)
    assert kinds(acts) == ["rollback"] and acts[0].to_step == 150
    # a failed entry of another timeline's checkpoint at that step withdraws nothing
    q, _ = policy()
    q.on_checkpoint(ckpt(250, timeline=1))
    q.on_checkpoint(ckpt(250, timeline=0, verified="failed"))
    assert q._checkpoints[250].timeline == 1


# ---------------------------------------------------------------- 9. dry run with approval, backlog replay


def test_dry_run_with_approval_holds_and_closes_like_a_dry_run():
    p, _ = policy(dry_run=True, require_approval=True)
    warm(p)
    for s in range(300, 330):
        assert p.on_step(rec(s, 5.0)) == []
    assert p.state == "verifying" and p._ep.get("held") and p._pending == {}
    x = noise(8)
    for s in range(330, 360):
        p.on_step(rec(s, x()))
    assert p.state == "healthy" and p.incidents[0].closed_at is not None
    for s in range(360, 460):
        p.on_step(rec(s, 6.0 if s >= 400 else x()))
    would = [e.data["action"]["kind"] for e in p.drain_events() if e.kind == "action"]
    assert would == ["rollback", "rollback"] and len(p.incidents) == 2  # the second fault is seen


def test_end_replay_closes_a_dry_run_incident_held_or_awaiting_approval():
    p, _ = policy(dry_run=True, require_approval=True)
    warm(p)
    for s in range(300, 330):
        p.on_step(rec(s, 5.0))
    p.end_replay("backlog over")
    assert p.state == "healthy" and p.incidents[0].closed_at is not None
    # an incident parked for approval by a dry run (state saved by an older sentinel): nobody was asked
    q, _ = policy(require_approval=True)
    warm(q)
    damage(q, 300)
    assert q.state == "awaiting_approval"
    for a in q.incidents[0].actions:
        a["dry_run"] = True
    q.end_replay("backlog over")
    assert q.state == "healthy" and q._pending == {} and q.incidents[0].close_reason == "backlog over"
    # a live one (its pause and page were sent) stays
    r, _ = policy(require_approval=True)
    warm(r)
    damage(r, 300)
    r.end_replay("backlog over")
    assert r.state == "awaiting_approval"


def test_a_backlog_replay_with_approval_leaves_the_live_run_watched():
    """The daemon replays an old backlog with dry_run set per record, then calls end_replay."""
    p, _ = policy(require_approval=True)

    def feed(r: StepRecord, history: bool) -> list[Action]:
        if not history:
            return p.on_step(r)
        p.dry_run = True
        try:
            return p.on_step(r)
        finally:
            p.dry_run = False

    x = noise(0)
    for s in range(1, 600):
        assert feed(rec(s, 5.0 if 300 <= s < 330 else x()), True) == []
        if s % 50 == 0:
            p.on_checkpoint(ckpt(s))
    p.end_replay("seen only in the backlog")
    assert p.state == "healthy"
    out: list[Action] = []
    for s in range(600, 640):
        out += feed(rec(s, 6.0), False)
        if out:
            break
    assert kinds(out) == ["pause", "page"] and p.state == "awaiting_approval"


def test_spikes_that_keep_coming_page_once_even_though_each_recovered():
    """Spikes every 8 steps merge into one suspect episode that never goes quiet, so the pattern of
    closed episodes never saw them: 125 spikes over 1000 steps paged nothing. Ten separate spikes in
    one episode now read as "increasing" and page, once; a burst of a few does not."""
    p, _ = policy()
    warm(p)
    x = noise(1)
    acts = []
    for s in range(300, 1300):
        acts += p.on_step(rec(s, x() * (1.6 if s % 8 == 0 else 1.0)))
    pages = [a for a in acts if a.kind == "page"]
    assert len(pages) == 1 and "spikes keep coming" in pages[0].reason, [a.kind for a in acts]
    assert p.pattern == "increasing" and not [a for a in acts if a.kind in ("rollback", "pause")]
    q, _ = policy()
    warm(q)
    y = noise(1)
    acts = []
    for s in range(300, 700):
        acts += q.on_step(rec(s, y() * (1.6 if s in (400, 408, 416) else 1.0)))
    assert [a for a in acts if a.kind == "page"] == [] and q.pattern != "increasing"


def test_the_lineage_check_agrees_with_its_definition_on_random_forks():
    """``_abandoned`` answers by bisection over the forks (it scanned every fork for every
    checkpoint: 7 ms a rollback target after 300 rollbacks). It must say what the definition says:
    a fork (t, s) with t later than the checkpoint's timeline and s before its step."""
    rng = random.Random(5)
    for _ in range(200):
        p, _clock = policy()
        for _ in range(rng.randint(0, 12)):
            p._note_fork(rng.randint(0, 8), rng.randint(0, 500))
        for _ in range(20):
            c = ckpt(rng.randint(0, 520), timeline=rng.randint(0, 9))
            want = any(t > c.timeline and c.step > s for t, s in p._forks)
            assert p._abandoned(c) == want, (p._forks, c.timeline, c.step)
