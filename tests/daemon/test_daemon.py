"""The sentinel daemon against real Redis servers (embedded valkey and Debian redis-server).

No trainer here: the tests publish synthetic ``StepRecord``s with ``sentinel.bus.publish`` (and
the checkpoints, acks and timeline markers a trainer would write), drive ``Daemon.iterate`` by
hand, and check what lands in Redis: signed directives, idempotency, the leader lease, pending
entry recovery, persisted state, dry runs, approvals, and the ``sentinel_*`` metrics.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from prometheus_client import generate_latest

from sentinel import bus
from sentinel.protocol import (
    STEP_CONSUMER_GROUP,
    Ack,
    CheckpointInfo,
    Directive,
    Event,
    Keys,
    TimelineRecord,
)
from tests.helpers.daemon import (
    CKPTS,
    NAN_STEP,
    SECRET,
    TARGET,
    directives,
    ids_of,
    incident_run,
    leading,
    make_daemon,
    publish_steps,
    pump,
    register_checkpoints,
    sample,
    step_rec,
)
from tests.helpers.services import require_binary

pytestmark = pytest.mark.timeout(120)


def events(r, run: str) -> list[Event]:
    return [Event.from_json(f["json"]) for _eid, f in r.xrange(Keys(run).events)]


# ------------------------------------------------------------------ detection -> signed directive, metrics


def test_detects_and_sends_a_signed_rollback(redis_url, unique_run):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run)
    incident_run(r, run)
    t_pub = time.time()
    pump(d, until=lambda: r.xlen(k.directives) > 0)

    (dv,) = directives(r, run)
    assert dv.kind == "rollback" and dv.run == run and dv.to_step == TARGET
    assert dv.verify(SECRET) is None, "the directive must verify with the run's secret"
    assert dv.verify(b"another-secret") == "bad signature"
    skipped = {i for lo, hi in dv.ranges for i in range(lo, hi)}
    assert set(ids_of(NAN_STEP)) <= skipped  # the damaging batch ...
    assert set(ids_of(NAN_STEP - 2)) <= skipped  # ... and skip_margin_steps before it
    assert not skipped & set(ids_of(NAN_STEP - 3))
    assert dv.expires_at and dv.expires_at > time.time()
    # the incident is recorded in Redis, idempotency key -> directive id
    (inc,) = [json.loads(v) for v in r.hgetall(k.incidents).values()]
    assert inc["rule"] == "nonfinite" and inc["onset_step"] == NAN_STEP and inc["rollback_to"] == TARGET
    assert dv.incident_id == inc["id"] and dv.id in r.hvals(k.applied)

    # metrics after the detection
    assert sample(d, "sentinel_steps_processed_total", run=run) == NAN_STEP
    assert sample(d, "sentinel_rule_fired_total", run=run, rule="nonfinite") == 1
    assert sample(d, "sentinel_actions_total", run=run, action="rollback", outcome="sent") == 1
    assert sample(d, "sentinel_incidents_open", run=run) == 1
    assert sample(d, "sentinel_leader", run=run) == 1
    assert sample(d, "sentinel_detection_latency_seconds_count", run=run) == 1
    lat = sample(d, "sentinel_detection_latency_seconds_sum", run=run)
    assert 0 <= lat < 5.0
    last = sample(d, "sentinel_last_action_timestamp_seconds", run=run, action="rollback")
    assert t_pub - 1 <= last <= time.time()
    assert sample(d, "sentinel_bus_errors_total") == 0

    # the "trainer" applies it: ack, rollback marker, healthy steps on the new timeline -> incident closes
    bus.publish(r, k.acks, Ack(run=run, directive_id=dv.id, kind="rollback", status="applied", step=TARGET, timeline=1), secret=SECRET)
    bus.publish(r, k.steps, TimelineRecord(kind="rollback", run=run, from_step=TARGET, timeline=1, time=time.time(),
                                           directive_id=dv.id, skip_ranges=dv.ranges), secret=SECRET)
    publish_steps(r, run, range(TARGET + 1, NAN_STEP + 6), timeline=1)
    pump(d, until=lambda: sample(d, "sentinel_incidents_open", run=run) == 0)
    (inc,) = [json.loads(v) for v in r.hgetall(k.incidents).values()]
    assert inc["state"] == "healthy" and inc["closed_at"]
    assert len(directives(r, run)) == 1
    assert sample(d, "sentinel_steps_processed_total", run=run) == NAN_STEP + (NAN_STEP + 5 - TARGET)
    kinds = [e.kind for e in events(r, run)]
    for want in ("rule_fired", "incident_opened", "incident", "action", "ack", "rollback", "verifying", "incident_closed"):
        assert want in kinds, f"no {want} event in {kinds}"

    # warm stop releases the lease and the gauge
    for w in d.watchers.values():
        w.release()
    assert sample(d, "sentinel_leader", run=run) == 0
    assert r.get(k.leader) is None


# ------------------------------------------------------------------ idempotency, persisted state


def test_replay_after_state_reset_sends_nothing_twice(redis_url, unique_run):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d1 = make_daemon(r, run, "a")
    incident_run(r, run)
    pump(d1, until=lambda: r.xlen(k.directives) > 0)
    for w in d1.watchers.values():
        w.release()

    # lose every bit of daemon state except the idempotency hash: the group re-delivers everything
    r.delete(k.policy)
    r.xgroup_destroy(k.steps, STEP_CONSUMER_GROUP)
    d2 = make_daemon(r, run, "b")
    pump(d2, until=lambda: sample(d2, "sentinel_steps_processed_total", run=run) == NAN_STEP, min_iter=3)
    assert sample(d2, "sentinel_actions_total", run=run, action="rollback", outcome="duplicate") == 1
    assert sample(d2, "sentinel_actions_total", run=run, action="rollback", outcome="sent") == 0
    assert r.xlen(k.directives) == 1
    # the replayed policy reached the same decision: same incident, same rollback target
    w2 = d2.watchers[run]
    assert w2.policy.state == "rollback" and w2.policy.incidents[0].rollback_to == TARGET


def test_policy_state_round_trips_through_redis(redis_url, unique_run):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d1 = make_daemon(r, run, "a")
    incident_run(r, run)
    pump(d1, until=lambda: r.xlen(k.directives) > 0)
    w1 = d1.watchers[run]
    for w in d1.watchers.values():
        w.release()  # saves the state
    saved = json.loads(r.get(k.policy))
    assert saved["last_id"] == w1.last_id and saved["policy"]["state"] == "rollback"
    assert saved["checkpoints_seen"] == list(CKPTS)

    d2 = make_daemon(r, run, "b")
    pump(d2, until=lambda: d2.watchers[run].leader)
    w2 = d2.watchers[run]
    assert w2.last_id == w1.last_id and w2.checkpoints_seen == set(CKPTS)
    a, b = w1.policy.state_dict(), w2.policy.state_dict()
    a.pop("events"), b.pop("events")
    assert a == b
    # and the restored daemon carries the incident on: the ack + marker + healthy steps close it
    (dv,) = directives(r, run)
    bus.publish(r, k.acks, Ack(run=run, directive_id=dv.id, kind="rollback", status="applied", step=TARGET, timeline=1), secret=SECRET)
    bus.publish(r, k.steps, TimelineRecord(kind="rollback", run=run, from_step=TARGET, timeline=1, time=time.time(), directive_id=dv.id),
                secret=SECRET)
    publish_steps(r, run, range(TARGET + 1, NAN_STEP + 6), timeline=1)
    pump(d2, until=lambda: w2.policy.state == "healthy")
    assert r.xlen(k.directives) == 1


@pytest.mark.parametrize("raw", [
    "[" * 100_000 + "]" * 100_000,  # nested past the recursion limit
    "INF-COUNT",  # a real saved state whose first count is 1e999 (an int() of inf)
    '{"policy": 5}', "not json", '{"policy": {"state": "healthy"}}',
    "NO-LAST-ID", "GATE-TEXT", "SEEN-TEXT",  # a real saved state with one field broken
], ids=["deep", "inf-count", "number", "text", "partial", "no-last-id", "gate-text", "seen-text"])
def test_an_unreadable_persisted_policy_state_starts_fresh(redis_url, unique_run, raw):
    """The daemon's own saved state in Redis is input too: whatever is there, the leader starts
    (from a fresh policy, saying so) and goes on judging steps."""
    import re

    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    if raw in ("INF-COUNT", "NO-LAST-ID", "GATE-TEXT", "SEEN-TEXT"):
        kind = raw
        d0 = make_daemon(r, run, "z")
        publish_steps(r, run, range(1, 80))
        pump(d0, until=lambda: d0.watchers.get(run) is not None and d0.watchers[run].leader, min_iter=3)
        for w in d0.watchers.values():
            w.release()
        saved = r.get(k.policy)
        saved = saved if isinstance(saved, str) else saved.decode()
        if kind == "INF-COUNT":
            raw, n = re.subn(r'"n": \d+', '"n": 1e999', saved, count=1)
            assert n == 1
        else:
            st = json.loads(saved)
            if kind == "NO-LAST-ID":
                del st["last_id"]
            elif kind == "GATE-TEXT":
                st["gate"] = "x"
            else:
                st["checkpoints_seen"] = ["x"]
            raw = json.dumps(st)
        r.delete(k.steps)
    r.set(k.policy, raw)
    d = make_daemon(r, run, "a")
    incident_run(r, run)
    pump(d, until=lambda: r.xlen(k.directives) > 0)
    assert d.watchers[run].leader and r.xlen(k.directives) == 1


# ------------------------------------------------------------------ leader lease


def test_only_the_leader_acts_and_a_standby_takes_over(redis_url, unique_run):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    lease = 600
    a = make_daemon(r, run, "a", lease_ms=lease)
    b = make_daemon(r, run, "b", lease_ms=lease)
    register_checkpoints(r, run)
    pump(a, b, until=lambda: a.watchers and b.watchers)
    publish_steps(r, run, range(1, 21))
    pump(a, b, until=lambda: sample(a, "sentinel_steps_processed_total", run=run) == 20, min_iter=3)
    assert r.get(k.leader) == "a"
    assert sample(a, "sentinel_leader", run=run) == 1 and sample(b, "sentinel_leader", run=run) == 0
    assert sample(b, "sentinel_steps_processed_total", run=run) == 0

    # 1) warm stop of the leader releases the lease: the standby takes over at its next renewal
    for w in a.watchers.values():
        w.release()
    t0 = time.monotonic()
    pump(b, until=lambda: b.watchers[run].leader, timeout=5)
    assert time.monotonic() - t0 < lease / 1000, "a released lease is taken without waiting for it to expire"
    publish_steps(r, run, range(21, NAN_STEP + 1), nan_at=NAN_STEP)
    pump(b, until=lambda: r.xlen(k.directives) > 0)
    assert sample(b, "sentinel_steps_processed_total", run=run) == NAN_STEP - 20  # continued from a's state
    assert sample(b, "sentinel_actions_total", run=run, action="rollback", outcome="sent") == 1

    # 2) the leader dies without releasing: nobody acts until its lease expires, then a standby does
    b.iterate(block_ms=1)  # b is now a "dead" leader: never called again, lease left in Redis
    assert r.get(k.leader) == "b"
    c = make_daemon(r, run, "c", lease_ms=lease)
    c.iterate(block_ms=1)
    assert not c.watchers[run].leader and r.get(k.leader) == "b"
    t0 = time.monotonic()
    pump(c, until=lambda: c.watchers[run].leader, timeout=5)
    assert time.monotonic() - t0 >= lease / 1000 * 0.5, "took over a live lease"
    assert c.watchers[run].policy.state == "rollback"  # b's persisted incident
    assert r.xlen(k.directives) == 1


# ------------------------------------------------------------------ pending entries (crash mid-batch)


@pytest.mark.parametrize("restart_as", ["same-consumer", "other-consumer"])
def test_read_but_unacked_entries_are_processed_after_restart(redis_url, unique_run, restart_as):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    bus.ensure_group(r, k.steps, STEP_CONSUMER_GROUP)
    incident_run(r, run)
    # a daemon "a" read the batch and died before processing it: the entries sit in a's pending list
    got = bus.read_group(r, k.steps, STEP_CONSUMER_GROUP, "a", count=1000)
    assert len(got) == NAN_STEP
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == NAN_STEP
    # nothing new arrives: only recovery can find the NaN step
    consumer = "a" if restart_as == "same-consumer" else "b"
    d = make_daemon(r, run, consumer)
    pump(d, until=lambda: r.xlen(k.directives) > 0)
    assert sample(d, "sentinel_steps_processed_total", run=run) == NAN_STEP
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0
    assert directives(r, run)[0].to_step == TARGET


def test_new_leader_claims_what_the_dead_leader_left_pending(redis_url, unique_run):
    """A short lease: the standby that takes over must still claim
    the entries the dead leader had read, although they have barely been idle."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    lease = 500
    a = make_daemon(r, run, "a", lease_ms=lease)
    b = make_daemon(r, run, "b", lease_ms=lease)
    pump(a, b, until=lambda: a.watchers[run].leader)
    incident_run(r, run)
    # a reads the batch and dies before processing it, holding the lease
    assert len(bus.read_group(r, k.steps, STEP_CONSUMER_GROUP, "a", count=1000)) == NAN_STEP
    t0 = time.monotonic()
    pump(b, until=lambda: r.xlen(k.directives) > 0, timeout=5)
    assert time.monotonic() - t0 < 3.0
    assert sample(b, "sentinel_steps_processed_total", run=run) == NAN_STEP
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0


def test_a_deferred_state_save_loses_nothing_and_sends_nothing_twice(redis_url, unique_run):
    """``state_save_s`` (``sentinel run``: 4 s): step records alone do not save the state, and
    their entries stay pending until a save covers them. A leader that dies then leaves them to
    its successor, which judges them again from the saved state; the decision to roll back is
    still saved before its directive goes out (one directive, from either leader); a warm stop
    saves and acknowledges everything."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    a = make_daemon(r, run, "a", state_save_s=3600.0)
    pump(a, until=lambda: a.watchers[run].leader)
    register_checkpoints(r, run)
    pump(a, until=lambda: len(a.watchers[run].checkpoints_seen) == len(CKPTS))  # a checkpoint saves at once
    saved = json.loads(r.get(k.policy))
    publish_steps(r, run, range(1, 31))
    pump(a, until=lambda: sample(a, "sentinel_steps_processed_total", run=run) == 30)
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 30  # judged, not yet covered by a save
    assert json.loads(r.get(k.policy))["last_id"] == saved["last_id"] == "0-0"
    # a dies without a word; its lease lapses: b judges the 30 steps again, then the NaN
    r.delete(k.leader)
    b = make_daemon(r, run, "b", state_save_s=3600.0)
    publish_steps(r, run, range(31, NAN_STEP + 1), nan_at=NAN_STEP)
    pump(b, until=lambda: r.xlen(k.directives) > 0)
    assert sample(b, "sentinel_steps_processed_total", run=run) == NAN_STEP
    assert json.loads(r.get(k.policy))["policy"]["state"] == "rollback"  # saved before the directive
    (dv,) = directives(r, run)
    assert dv.to_step == TARGET
    # the saves before the directive and at the event covered everything judged by then
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0
    publish_steps(r, run, range(NAN_STEP + 1, NAN_STEP + 6))
    pump(b, until=lambda: sample(b, "sentinel_steps_processed_total", run=run) == NAN_STEP + 5)
    b.watchers[run].release()  # warm stop
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0
    last = r.xrevrange(k.steps, count=1)[0][0]
    assert json.loads(r.get(k.policy))["last_id"] == (last.decode() if isinstance(last, bytes) else last)
    assert len(directives(r, run)) == 1 and not a.watchers[run]._sent  # a never sent anything


def test_a_healthy_runs_acks_wait_for_their_cadence_and_an_incidents_are_read_at_every_poll(redis_url, unique_run):
    """``side_read_s`` (``sentinel run``: 0.5 s): a healthy run's acks and approvals are read, and
    its clock rules run, at most that often, not at each step; once due they are read. A run sent
    a directive reads its acks at the next poll, and at every poll while its incident is open. Its
    checkpoints are read at every poll whatever the cadence."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d, w = leading(r, run, side_read_s=3600.0)
    publish_steps(r, run, range(1, 6))
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 5)  # the first poll read them: due at 0
    acks_before = w.acks_id
    # an operator's directive acknowledged by the trainer: nothing this sentinel awaits
    bus.publish(r, k.acks, Ack(run=run, directive_id="op-1", kind="pause", status="applied", step=5, timeline=0), secret=SECRET)
    register_checkpoints(r, run)
    publish_steps(r, run, range(6, 16))
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 15)
    assert w.checkpoints_seen == set(CKPTS) and w.policy.state == "healthy"
    assert w.acks_id == acks_before  # not due for an hour
    w._next_side_read = 0.0  # the cadence came round
    publish_steps(r, run, range(16, 17))
    pump(d, until=lambda: w.acks_id != acks_before, timeout=2.0)
    publish_steps(r, run, range(17, NAN_STEP + 1), nan_at=NAN_STEP)
    pump(d, until=lambda: r.xlen(k.directives) > 0)
    (dv,) = directives(r, run)
    assert dv.to_step == TARGET and w.policy.state != "healthy"
    acks_before = w.acks_id
    bus.publish(r, k.acks, Ack(run=run, directive_id=dv.id, kind="rollback", status="applied", step=TARGET, timeline=1), secret=SECRET)
    pump(d, until=lambda: w.acks_id != acks_before, timeout=2.0)  # no step record: the idle polls read it
    assert any(f"ack rollback {dv.id[:8]}: applied" in line for line in d.logs)


def test_step_reads_are_paced_by_the_runs_led_but_a_backlog_is_read_at_once(redis_url, unique_run):
    """``pace_per_run_s`` (``sentinel run``: 25 µs a run, 7.5 ms at 300 runs): a read that returned
    records sets ``next_read_at`` that far after the iteration began, capped at ``PACE_MAX_S``; a
    full batch (more waiting) or an empty read does not; and a fleet does not read a paced member
    again before then."""
    from sentinel.daemon import PACE_MAX_S
    from sentinel.fleet import Fleet, Member

    r = bus.connect(redis_url)
    run = unique_run
    d = make_daemon(r, run, "a", pace_per_run_s=0.01, batch=10)
    pump(d, until=lambda: d.watchers[run].leader)
    publish_steps(r, run, range(1, 4))
    t0 = time.monotonic()
    assert d.iterate(block_ms=20) == 3
    assert t0 < d.next_read_at <= time.monotonic() + 0.01  # one run led: 10 ms after the iteration began
    paced = d.next_read_at
    assert d.iterate(block_ms=20) == 0 and d.next_read_at == paced  # an empty read waited its block already
    publish_steps(r, run, range(4, 30))  # 26 records, batches of 10: the first read is full
    before = d.next_read_at
    assert d.iterate(block_ms=20) == 10 and d.next_read_at == before  # behind: read again at once
    # a fleet leaves a paced member alone until its time
    fleet = Fleet([Member(d, redis_url)], d.m, log=lambda _m: None)
    d.next_read_at = time.monotonic() + 60.0
    fleet.iterate()
    assert sample(d, "sentinel_steps_processed_total", run=run) == 13
    d.next_read_at = 0.0
    fleet.iterate()
    assert sample(d, "sentinel_steps_processed_total", run=run) == 23
    # capped: however many runs, a verdict waits at most PACE_MAX_S for its read
    d.opts.pace_per_run_s = 10.0
    publish_steps(r, run, range(30, 31))
    t0 = time.monotonic()
    assert d.iterate(block_ms=20) == 7  # steps 24-30: not a full batch
    assert t0 + PACE_MAX_S <= d.next_read_at <= time.monotonic() + PACE_MAX_S


def test_an_iteration_judges_the_runs_oldest_record_first(redis_url, unique_run):
    """After a stall the iteration's backlog spans every run: judged in the runs' order, the oldest
    record of the last run would wait behind newer ones of the others. The runs are judged in the
    order of their oldest new record (stream ids: the bus's clock), whatever the order they are led in."""
    from sentinel.daemon import Daemon
    from sentinel.metrics import SentinelMetrics

    r = bus.connect(redis_url)
    runs = [f"{unique_run}-{i}" for i in range(3)]
    d = Daemon(r, make_daemon(r, unique_run).opts, runs=runs, metrics=SentinelMetrics(), log=lambda _m: None)
    pump(d, until=lambda: len(d.watchers) == 3 and all(w.leader for w in d.watchers.values()))
    led = [w.run for w in d._leading()[0]]
    order: list[str] = []

    def note_order(w):  # each watcher's judge, noting which run it judged
        judge = w.judge

        def judged(entries):
            order.append(w.run)
            return judge(entries)
        w.judge = judged

    for w in d.watchers.values():
        note_order(w)
    for step, run in ((1, led[2]), (1, led[0]), (2, led[2]), (1, led[1])):  # the last run led wrote first
        publish_steps(r, run, [step])
        time.sleep(0.002)  # each record its own millisecond on the bus's clock
    assert d.iterate(block_ms=20) == 4
    assert order == [led[2], led[0], led[1]]
    assert all(sample(d, "sentinel_steps_processed_total", run=run) == n for run, n in zip(led, (1, 1, 2)))


def test_a_checkpoint_registered_before_a_record_is_known_when_the_record_is_judged(redis_url, unique_run):
    """Every poll reads its run's checkpoints hash, with the step read: a checkpoint the trainer
    registered before it wrote a step record is known when that record is judged (a NaN at step 5
    rolls back to step 0's checkpoint, tests/e2e/test_sentinel_e2e.py). Reading the side keys every
    ~0.5 s instead saved ~7 % of a 300-run sentinel's CPU and broke that, so it was reverted; the
    acks' and approvals' cadence (``side_read_s``, set here as ``sentinel run`` sets it) leaves the
    checkpoints out."""
    from sentinel.cli.run_cmd import SIDE_READ_S

    r = bus.connect(redis_url)
    run = unique_run
    d = make_daemon(r, run, "a", side_read_s=SIDE_READ_S)
    pump(d, until=lambda: d.watchers[run].leader)
    w = d.watchers[run]
    publish_steps(r, run, range(1, 3))
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 2)
    assert not w.checkpoints_seen
    register_checkpoints(r, run)
    publish_steps(r, run, range(3, 4))
    assert d.iterate(block_ms=20) == 1
    assert w.checkpoints_seen == set(CKPTS)
    # a hash found as the last poll took it is skipped whole (_refresh_checkpoints): an entry rewritten
    # (a rollback rewrites its step's) and one deleted (retention) must still be taken at the next poll
    s0, s1 = CKPTS[:2]
    r.hset(Keys(run).checkpoints, str(s0), CheckpointInfo(run=run, step=s0, path="/ckpt/rewritten", created=time.time(),
                                                           bytes=2, manifest_sha256="1" * 64, world_size=1).to_json())
    r.hdel(Keys(run).checkpoints, str(s1))
    publish_steps(r, run, range(4, 5))
    assert d.iterate(block_ms=20) == 1
    assert w.checkpoints_seen == set(CKPTS) - {s1}
    assert w.policy._checkpoints[s0].path == "/ckpt/rewritten" and s1 not in w.policy._checkpoints


def test_a_fleet_collects_once_after_a_pass_that_added_many_watchers(redis_url, unique_run):
    """``Fleet._settle``: the pass that created 20 watchers ends in one full collection (their
    objects old at once, not walked by every collection of the young generations); the next pass,
    with no watcher added, collects nothing in full."""
    import gc

    from sentinel.daemon import Daemon
    from sentinel.fleet import Fleet, Member
    from sentinel.metrics import SentinelMetrics

    r = bus.connect(redis_url)
    d = Daemon(r, make_daemon(r, unique_run).opts, runs=[f"{unique_run}-{i}" for i in range(20)], metrics=SentinelMetrics(),
               log=lambda _m: None)
    fleet = Fleet([Member(d, redis_url)], d.m, log=lambda _m: None)
    full: list[int] = []

    def seen(phase, info):
        if phase == "stop" and info["generation"] == 2:
            full.append(len(d.watchers))

    gc.callbacks.append(seen)
    gc.disable()  # no automatic collection in between (one fell mid-creation in a run of this test): only _settle's
    try:
        fleet.iterate()
        assert len(d.watchers) == 20 and full == [20]
        fleet.iterate()
        assert full == [20]
    finally:
        gc.enable()
        gc.callbacks.remove(seen)


def test_recovered_spikes_are_annotated_and_their_pattern_is_a_metric(redis_url, unique_run):
    """Spikes that recover send nothing; they are counted as recovered episodes, and a fixed
    interval between them shows as sentinel_spike_pattern{pattern="periodic"} = 1."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run)
    register_checkpoints(r, run)
    spikes = {100, 160, 220, 280}
    for s in range(1, 330):
        bus.publish(r, k.steps, step_rec(run, s, 6.0 if s in spikes else None), secret=SECRET)
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 329)
    assert r.xlen(k.directives) == 0
    assert sample(d, "sentinel_spike_pattern", run=run, pattern="periodic") == 1
    assert sample(d, "sentinel_spike_pattern", run=run, pattern="one-off") == 0
    assert sample(d, "sentinel_anomaly_episodes_total", run=run, outcome="recovered") == 4
    states = {json.loads(v)["state"] for v in r.hgetall(k.incidents).values()}
    assert states == {"recovered"}


def test_closed_incidents_leave_the_saved_state_but_stay_on_the_bus(redis_url, unique_run, monkeypatch):
    """An 18-day run closes thousands of incidents (each recovered spike is one). The saved policy
    state and each incident write used to carry all of them, so both grew with the run. Now the
    state keeps the newest ``RECENT_CLOSED`` closed ones, each write carries only what changed, and
    the bus hash still holds every incident, across a restart too."""
    monkeypatch.setattr("sentinel.policy.RECENT_CLOSED", 3)
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    written: list[int] = []
    hset = r.hset

    def counting_hset(key, *a, mapping=None, **kw):
        if key == k.incidents:
            written.append(len(mapping or {}))
        return hset(key, *a, mapping=mapping, **kw)

    monkeypatch.setattr(r, "hset", counting_hset)
    d = make_daemon(r, run)
    register_checkpoints(r, run)
    spikes = list(range(100, 700, 60))  # 10 spikes, each a recovered incident
    for s in range(1, 720):
        bus.publish(r, k.steps, step_rec(run, s, 6.0 if s in spikes else None), secret=SECRET)
        if s % 20 == 0 or s == 719:  # as a live run sends them: a few steps per poll
            pump(d, until=lambda s=s: sample(d, "sentinel_steps_processed_total", run=run) == s)
    assert r.xlen(k.directives) == 0
    on_bus = {json.loads(v)["onset_step"]: json.loads(v)["state"] for v in r.hgetall(k.incidents).values()}
    assert on_bus == {s: "recovered" for s in spikes}
    saved = json.loads(r.get(k.policy))["policy"]["incidents"]
    assert [i["onset_step"] for i in saved] == spikes[-3:]
    assert written and max(written) <= 2  # what changed (the incident an event named, a closing one), never all ten

    for w in d.watchers.values():
        w.release()  # a warm stop: saves the state, hands the lease over
    d2 = make_daemon(r, run, consumer="b")
    for s in range(720, 800):
        bus.publish(r, k.steps, step_rec(run, s, 6.0 if s == 760 else None), secret=SECRET)
    pump(d2, until=lambda: sample(d2, "sentinel_steps_processed_total", run=run) == 80)
    on_bus = {json.loads(v)["onset_step"] for v in r.hgetall(k.incidents).values()}
    assert on_bus == set(spikes) | {760}


# ------------------------------------------------------------------ dry run, approvals


def test_dry_run_records_but_sends_nothing(redis_url, unique_run):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run, dry_run=True)
    incident_run(r, run)
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == NAN_STEP, min_iter=2)
    pump(d, min_iter=3, until=lambda: True)
    assert r.xlen(k.directives) == 0 and r.hlen(k.applied) == 0
    acts = [e for e in events(r, run) if e.kind == "action"]
    assert acts and all(e.data["dry_run"] for e in acts)
    assert acts[0].data["action"]["kind"] == "rollback" and acts[0].data["action"]["to_step"] == TARGET
    (inc,) = [json.loads(v) for v in r.hgetall(k.incidents).values()]
    # nothing was restored, so the damage is still there: the one incident is held open, not re-opened
    assert inc["state"] == "verifying" and inc["rollback_to"] == TARGET and not inc.get("closed_at")
    assert sample(d, "sentinel_actions_total", run=run, action="rollback", outcome="sent") == 0
    assert sample(d, "sentinel_actions_total", run=run, action="rollback", outcome="dry_run") == 1
    assert sample(d, "sentinel_incidents_open", run=run) == 1


def test_require_approval_pages_then_acts_on_a_signed_approval(redis_url, unique_run):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run, require_approval=True)
    incident_run(r, run)
    pump(d, until=lambda: any(e.kind == "page" for e in events(r, run)))
    (page,) = [e for e in events(r, run) if e.kind == "page"]
    assert page.severity == "critical" and "approval needed" in page.message and page.incident_id
    assert "paused" in page.message
    # no training on damaged weights while a human decides: the run is paused
    assert [dv.kind for dv in directives(r, run)] == ["pause"]
    assert sample(d, "sentinel_actions_total", run=run, action="page", outcome="sent") == 1
    assert sample(d, "sentinel_incidents_open", run=run) == 1
    iid = page.incident_id

    # forged and malformed approvals are ignored
    bus.publish(r, k.approvals, Directive(run=run, kind="resume", incident_id=iid).signed(b"not-the-secret"))
    bus.publish(r, k.approvals, Directive(run=run, kind="resume", incident_id=iid))  # unsigned
    bus.publish(r, k.approvals, Directive(run=run, kind="resume").signed(SECRET))  # no incident
    pump(d, min_iter=5, until=lambda: True)
    assert r.xlen(k.directives) == 1
    for reason in ("bad_signature", "unsigned", "malformed"):
        assert sample(d, "sentinel_records_rejected_total", run=run, stream="approvals", reason=reason) == 1, reason

    bus.publish(r, k.approvals, Directive(run=run, kind="resume", incident_id=iid, issuer="human:alice").signed(SECRET))
    pump(d, until=lambda: r.xlen(k.directives) > 2)
    _pause, dv, resume = directives(r, run)
    assert dv.kind == "rollback" and dv.to_step == TARGET and dv.incident_id == iid and dv.verify(SECRET) is None
    assert resume.kind == "resume"  # after the restore the run goes on
    assert sample(d, "sentinel_actions_total", run=run, action="rollback", outcome="sent") == 1
    assert sample(d, "sentinel_actions_total", run=run, action="page", outcome="sent") == 1  # paged once only
    pump(d, min_iter=3, until=lambda: True)
    assert r.xlen(k.directives) == 3


# ------------------------------------------------------------------ bus errors, exposition


def test_bus_outage_is_counted_and_survived(redis_server, unique_run):
    """Debian redis-server killed and restarted empty on the same port under a running daemon."""
    r = bus.connect(redis_server.url)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run)
    th = threading.Thread(target=d.run_forever, daemon=True)
    th.start()
    try:
        publish_steps(r, run, range(1, 11))
        deadline = time.monotonic() + 10
        while sample(d, "sentinel_steps_processed_total", run=run) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sample(d, "sentinel_steps_processed_total", run=run) == 10
        redis_server.stop()
        deadline = time.monotonic() + 10
        while sample(d, "sentinel_bus_errors_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sample(d, "sentinel_bus_errors_total") >= 1
        redis_server.start()  # no persistence: streams, group and lease are gone
        r2 = bus.connect(redis_server.url)
        register_checkpoints(r2, run)
        publish_steps(r2, run, range(11, NAN_STEP + 1), nan_at=NAN_STEP)
        deadline = time.monotonic() + 20
        while r2.xlen(k.directives) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r2.xlen(k.directives) == 1, d.logs[-5:]
        assert sample(d, "sentinel_leader", run=run) == 1
    finally:
        d.stop_requested = True
        th.join(10)
    assert not th.is_alive()
    assert any("control bus error" in line for line in d.logs)


@pytest.mark.parametrize("values", [
    [0.0, 0.001, 0.0010001, 0.05, 0.0499999, 10.0, 10.5],  # on and beside the bounds, and above the last
    [float("inf"), float("nan"), 1e-300, 0.2],
    [i / 997 for i in range(2000)],
    [],
])
def test_the_verdict_histogram_exposes_what_prometheus_clients_does(values):
    """``LoopHistogram`` (the verdict latency, observed at every step record without a lock) is
    exposed line for line as prometheus-client's ``Histogram`` of the same buckets exposes it."""
    import math

    from prometheus_client import CollectorRegistry, Histogram

    from sentinel.metrics import VERDICT_BUCKETS, LoopHistogram

    ours_reg, ref_reg = CollectorRegistry(), CollectorRegistry()
    ours = LoopHistogram("sentinel_verdict_latency_seconds", "doc", VERDICT_BUCKETS, ours_reg)
    ref = Histogram("sentinel_verdict_latency_seconds", "doc", buckets=VERDICT_BUCKETS, registry=ref_reg)
    for v in values:
        ours.observe(v)
        ref.observe(v)

    def lines(reg):
        return [x for x in generate_latest(reg).decode().splitlines() if "_created" not in x]

    if any(math.isnan(v) for v in values):  # a NaN sum prints alike, but NaN != NaN: compare the rest
        assert [x for x in lines(ours_reg) if "_sum" not in x] == [x for x in lines(ref_reg) if "_sum" not in x]
        assert "NaN" in next(x for x in lines(ours_reg) if x.startswith("sentinel_verdict_latency_seconds_sum"))
    else:
        assert lines(ours_reg) == lines(ref_reg)
    counted = sum(1 for v in values if not math.isnan(v))
    assert f'_bucket{{le="+Inf"}} {float(counted)}' in generate_latest(ours_reg).decode()


def test_promtool_accepts_the_exposition(embedded_bus, unique_run):
    promtool = require_binary("promtool")  # fails under CI=true when missing, skips elsewhere
    r = bus.connect(embedded_bus.url)
    run = unique_run
    d = make_daemon(r, run)
    incident_run(r, run)
    pump(d, until=lambda: sample(d, "sentinel_actions_total", run=run, action="rollback", outcome="sent") == 1)
    text = generate_latest(d.m.registry)
    for name in ("sentinel_steps_processed_total", "sentinel_rule_fired_total", "sentinel_actions_total",
                 "sentinel_incidents_open", "sentinel_detection_latency_seconds_bucket",
                 "sentinel_last_action_timestamp_seconds", "sentinel_leader", "sentinel_bus_errors_total"):
        assert name.encode() in text, name
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (res.stdout + res.stderr).decode()
