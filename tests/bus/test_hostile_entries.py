"""Hostile and lost entries on the control bus, replayed against real Redis.

Someone with write access to the bus but not the run's secret (or a buggy writer that has it)
must not be able to stop a run, blind the sentinel or make it forget what it knows:

1. junk on the directives stream, refused by the trainer, must not read as the verdict on the
   sentinel's own rollback (no escalation, no pause); a forged copy under the rollback's id is
   counted; a genuine refusal of the sentinel's directive still escalates;
2. an entry with the largest (or a far-future) stream id must not stop the trainer writing, nor
   move any reader's position past everything written after it;
3. a replayed start/resume/rollback record must not reset the detectors, and replayed steps
   after it must not be judged again;
4. one signed record with an absurd step or time must not refuse every genuine step after it;
5. (the registry flood: tests/daemon/test_control_plane_faults.py, test_hostile_run_registry_members...)
6. a bus that lost its data gets the run's registration, checkpoints and skip list back;
7. a directives key of another Redis type is counted by the trainer and replaced by the CLI;
8. a flood of junk directives is not a flood of acks, events and log lines, and cannot push a
   genuine directive out of the trainer's inbox;
9. a directive issued far ahead of the clock is refused.
"""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

from sentinel import bus
from sentinel.cli import main
from sentinel.client.bus import INBOX_MAX, BusClient
from sentinel.ingest import MAX_FUTURE_S, StepGate
from sentinel.protocol import Ack, CheckpointInfo, Directive, Keys, TimelineRecord, record_mac
from tests.helpers.daemon import (
    NAN_STEP,
    SECRET,
    TARGET,
    directives,
    incident_run,
    make_daemon,
    publish_steps,
    pump,
    register_checkpoints,
    sample,
    step_rec,
)

pytestmark = pytest.mark.timeout(180)

MAX_ID = "18446744073709551615-18446744073709551615"


def _wait(pred, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return bool(pred())


def _rollback_sent(r, run, d):
    """The daemon's rollback of incident_run, and its stream entry id."""
    pump(d, until=lambda: r.xlen(Keys(run).directives) > 0)
    (dv,) = directives(r, run)
    (eid, _), = r.xrange(Keys(run).directives)
    assert dv.kind == "rollback" and dv.to_step == TARGET
    return dv, eid


# ------------------------------------------------------------------ 1. acks that are not the verdict


def test_refused_junk_and_forged_copies_do_not_escalate_the_sentinels_rollback(redis_url, unique_run):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run)
    incident_run(r, run)
    dv, eid = _rollback_sent(r, run, d)
    w = d.watchers[run]
    assert w.policy.state == "rollback"
    # what the trainer acks for junk it refused (signed by the trainer: they are its acks)
    for i in range(50):
        bus.publish(r, k.acks, Ack(run=run, directive_id=f"stream:{i}-0", kind="unknown", status="rejected", step=NAN_STEP,
                                   detail="malformed (Directive.run: Field required)", entry_id=f"{i}-0"), secret=SECRET)
    # a copy of the rollback's id with a bad signature, refused under that id
    bus.publish(r, k.acks, Ack(run=run, directive_id=dv.id, kind="rollback", status="rejected", step=NAN_STEP,
                               detail="bad signature", entry_id="1-1"), secret=SECRET)
    # an operator's directive (not the sentinel's), refused as expired
    bus.publish(r, k.acks, Ack(run=run, directive_id="cli-pause", kind="pause", status="rejected", step=NAN_STEP,
                               detail="expired"), secret=SECRET)
    pump(d, min_iter=5, until=lambda: w.acks_id == r.xrevrange(k.acks, count=1)[0][0])
    assert w.policy.state == "rollback", "junk refused by the trainer is not the verdict on the rollback"
    assert [x.kind for x in directives(r, run)] == ["rollback"], "no pause was sent"
    assert sample(d, "sentinel_records_rejected_total", run=run, stream="acks", reason="forged_copy") == 1
    assert sum("did not send" in line for line in d.logs) == 1, "the junk acks are logged once a minute, not each"
    # the trainer's genuine refusal of the sentinel's own entry (here: another secret) still escalates
    bus.publish(r, k.acks, Ack(run=run, directive_id=dv.id, kind="rollback", status="rejected", step=NAN_STEP,
                               detail="bad signature", entry_id=eid), secret=SECRET)
    pump(d, until=lambda: w.policy.state == "escalated")
    assert [x.kind for x in directives(r, run)] == ["rollback", "pause"]


def test_a_successor_daemon_knows_which_directives_were_sent(redis_url, unique_run):
    """The ids the leader sent travel with its saved state: the next leader still judges their acks."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    a = make_daemon(r, run, consumer="a")
    incident_run(r, run)
    dv, eid = _rollback_sent(r, run, a)
    a.watchers[run].release()
    b = make_daemon(r, run, consumer="b")
    pump(b, until=lambda: run in b.watchers and b.watchers[run].leader)
    assert b.watchers[run]._sent == {dv.id: eid}
    bus.publish(r, k.acks, Ack(run=run, directive_id=dv.id, kind="rollback", status="failed", step=NAN_STEP,
                               detail="no checkpoint of step 20"), secret=SECRET)
    pump(b, until=lambda: b.watchers[run].policy.state == "escalated")


# ------------------------------------------------------------------ 2. far-future stream ids


def test_an_entry_with_the_largest_id_blinds_nobody(redis_url, unique_run):
    r = bus.connect(redis_url)
    raw = bus.connect(redis_url, decode=False)
    run, k = unique_run, Keys(unique_run)
    c = BusClient(redis_url, run, SECRET, poll_interval_s=0.02)
    try:
        d = make_daemon(r, run)
        register_checkpoints(r, run)
        for s in range(1, 11):
            c.publish_step(step_rec(run, s))
        assert _wait(lambda: r.xlen(k.steps) == 10)
        pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 10)
        for key in (k.steps, k.acks, k.directives):  # no writer could XADD to these after this
            raw.xadd(key, {b"json": b"x"}, id=MAX_ID)
        pump(d, min_iter=3, until=lambda: True)
        for s in range(11, NAN_STEP + 1):
            c.publish_step(step_rec(run, s, float("nan") if s == NAN_STEP else None))
        # the trainer (or the daemon, first) repairs the steps stream, and every record is judged
        pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == NAN_STEP, timeout=30)
        assert c.dropped == 0
        assert MAX_ID.encode() not in {eid for eid, _ in raw.xrange(k.steps)}
        # the sentinel's rollback goes out through the poisoned directives stream, and the trainer reads it
        got: list[Directive] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(x.kind == "rollback" for x in got):
            d.iterate(block_ms=10)
            got += c.poll_directives()
        rb = next(x for x in got if x.kind == "rollback")
        assert rb.to_step == TARGET
        # the trainer's ack reaches the daemon through the poisoned acks stream
        c.ack(Ack(run=run, directive_id=rb.id, kind="rollback", status="failed", step=NAN_STEP, detail="test"))
        pump(d, until=lambda: d.watchers[run].policy.state == "escalated", timeout=30)
        assert all(MAX_ID.encode() not in {eid for eid, _ in raw.xrange(key)} for key in (k.acks, k.directives))
    finally:
        c.close()


def test_a_far_future_id_then_a_fresh_stream_leaves_the_daemon_reading(redis_url, unique_run):
    """A future-dated entry, then the stream recreated (FLUSHALL, a Redis restart without its data):
    the daemon's position never moved to the future id, so the new entries are read."""
    r = bus.connect(redis_url)
    raw = bus.connect(redis_url, decode=False)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run)
    publish_steps(r, run, range(1, 6))
    raw.xadd(k.steps, {b"json": step_rec(run, 6).to_json().encode()}, id=f"{int(time.time() * 1000) + 10 * 86_400_000}-0")
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 5)
    pump(d, min_iter=3, until=lambda: True)
    w = d.watchers[run]
    assert not bus.is_future_id(w.last_id)
    r.delete(k.steps)
    publish_steps(r, run, range(6, 11))
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 10)


def test_a_stream_that_started_over_below_the_position_is_read_from_its_start(redis_url, unique_run):
    r = bus.connect(redis_url)
    raw = bus.connect(redis_url, decode=False)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run)
    now_ms = int(time.time() * 1000)
    for s in range(1, 4):  # a server clock an hour ahead (then fixed, and the data lost)
        data = step_rec(run, s).to_json()
        raw.xadd(k.steps, {b"json": data.encode(), b"mac": record_mac(SECRET, k.steps, data).encode()}, id=f"{now_ms + 3_600_000}-{s}")
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 3)
    r.delete(k.steps)
    publish_steps(r, run, range(4, 7))
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 6)
    assert any("started over below the position" in line for line in d.logs)


# ------------------------------------------------------------------ 3, 4. the gate


def _entry(run: str, rec, eid: str = "1-0", secret: bytes = SECRET) -> bus.Entry:
    data = rec.to_json()
    return bus.Entry(Keys(run).steps, eid, {"json": data, "mac": record_mac(secret, Keys(run).steps, data)})


def test_the_gate_refuses_replayed_timelines_absurd_steps_and_future_stamps():
    run, t0 = "gate", time.time() - 200_000
    g = StepGate(run, SECRET)
    start = TimelineRecord(kind="start", run=run, from_step=0, timeline=0, time=t0)
    assert g.check(_entry(run, start)).record is not None
    steps = [step_rec(run, s).model_copy(update={"time": t0 + s}) for s in range(1, 6)]
    assert all(g.check(_entry(run, x)).record is not None for x in steps)
    # a copy of the start: refused, and the steps replayed after it stay refused
    assert g.check(_entry(run, start)).reason == "replayed"
    assert {g.check(_entry(run, x)).reason for x in steps} == {"duplicate", "out_of_order"}
    resume = TimelineRecord(kind="resume", run=run, from_step=3, timeline=1, time=t0 + 10)
    assert g.check(_entry(run, resume)).record is not None
    assert g.check(_entry(run, resume)).reason == "replayed"
    # one signed step 2**52 (a buggy writer): refused, and the genuine steps go on
    assert g.check(_entry(run, step_rec(run, 9, timeline=1).model_copy(update={"step": 2**52, "time": t0 + 11}))).reason == "step_jump"
    assert g.check(_entry(run, step_rec(run, 4, timeline=1).model_copy(update={"time": t0 + 12}))).record is not None
    # a jump the time between the records explains (the sentinel was away for a day) passes
    assert g.check(_entry(run, step_rec(run, 9, timeline=1).model_copy(update={"step": 864_004, "time": t0 + 12 + 86_400}))).record is not None
    far = step_rec(run, 9, timeline=1).model_copy(update={"step": 864_005, "time": time.time() + MAX_FUTURE_S + 60})
    assert g.check(_entry(run, far)).reason == "future_time"
    # the run name used again from scratch: a start stamped after everything seen is a new life
    again = TimelineRecord(kind="start", run=run, from_step=0, timeline=0, time=t0 + 86_500)
    assert g.check(_entry(run, again)).record is not None
    assert g.check(_entry(run, step_rec(run, 1).model_copy(update={"time": t0 + 86_501}))).record is not None


def test_a_replayed_start_does_not_reset_the_daemon(redis_url, unique_run):
    r = bus.connect(redis_url)
    raw = bus.connect(redis_url, decode=False)
    run, k = unique_run, Keys(unique_run)
    d = make_daemon(r, run)
    bus.publish(r, k.steps, TimelineRecord(kind="start", run=run, from_step=0, timeline=0, time=time.time()), secret=SECRET)
    publish_steps(r, run, range(1, 41))
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 40)
    seen = d.watchers[run].policy.engine.state_dict()
    for _eid, fields in raw.xrange(k.steps, count=21):  # the start record and steps 1-20, copied as they are
        raw.xadd(k.steps, fields)
    pump(d, until=lambda: sample(d, "sentinel_records_rejected_total", run=run, stream="steps", reason="replayed") == 1)
    pump(d, until=lambda: sample(d, "sentinel_records_rejected_total", run=run, stream="steps", reason="out_of_order") == 20)
    assert sample(d, "sentinel_steps_processed_total", run=run) == 40
    assert d.watchers[run].policy.engine.state_dict() == seen, "the detectors kept their baselines"


# ------------------------------------------------------------------ 6. a bus that lost its data


def test_the_trainer_registers_again_when_the_bus_lost_its_data(redis_url, unique_run):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    c = BusClient(redis_url, run, SECRET, poll_interval_s=0.02, heartbeat_ttl_s=0.3)
    try:
        c.register({"run_dir": "/r", "world_size": 2})
        for s in (10, 20):
            c.register_checkpoint(CheckpointInfo(run=run, step=s, path=f"/c/{s}", created=time.time(), bytes=1,
                                                 manifest_sha256="0" * 64, world_size=2))
        c.set_skiplist([(5, 9)])
        c.publish_step(step_rec(run, 1))
        assert _wait(lambda: run in bus.list_runs(r) and r.hlen(k.checkpoints) == 2 and r.exists(k.skiplist))
        c.retain_checkpoints([20])
        assert _wait(lambda: set(r.hkeys(k.checkpoints)) == {"20"})
        for key in (Keys.RUNS, k.info, k.checkpoints, k.skiplist):  # what a restart without its data loses
            r.delete(key)
        c.publish_step(step_rec(run, 2))
        assert _wait(lambda: run in bus.list_runs(r) and r.hget(k.info, "world_size") == "2"
                     and set(r.hkeys(k.checkpoints)) == {"20"} and r.get(k.skiplist) == "[[5, 9]]")
    finally:
        c.close()


# ------------------------------------------------------------------ 7, 8, 9. the directives stream


def test_a_wrong_type_directives_key_is_counted_and_the_cli_replaces_it(redis_url, unique_run, tmp_path, monkeypatch):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    c = BusClient(redis_url, run, SECRET, poll_interval_s=0.02)
    try:
        c.register({"world_size": 1})
        c.publish_step(step_rec(run, 1))
        assert _wait(lambda: r.exists(k.heartbeat) and run in bus.list_runs(r))
        r.delete(k.directives)
        r.set(k.directives, "x")
        assert _wait(lambda: c.rejected_by_reason["wrong_type"] == 1)
        time.sleep(0.2)
        assert c.rejected_by_reason["wrong_type"] == 1, "counted once while it lasts, not at every read"
        monkeypatch.setenv("SENTINEL_SECRET", SECRET.decode())
        res = CliRunner().invoke(main, ["pause", run, "--redis-url", redis_url, "--timeout", "1", "--json"])
        assert "WRONGTYPE" not in res.output and "Traceback" not in res.output, res.output
        assert _wait(lambda: any(x.kind == "pause" for x in c.poll_directives())), res.output
    finally:
        c.close()


def test_a_junk_flood_is_counted_not_echoed_and_cannot_push_a_genuine_directive_out(redis_url, unique_run):
    r = bus.connect(redis_url)
    raw = bus.connect(redis_url, decode=False)
    run, k = unique_run, Keys(unique_run)
    t0 = time.monotonic()
    c = BusClient(redis_url, run, SECRET, poll_interval_s=0.01)
    try:
        n = INBOX_MAX + 2_000
        pipe = raw.pipeline(transaction=False)
        for _i in range(n):
            pipe.xadd(k.directives, {b"json": b"{}"})
        pipe.execute()
        genuine = Directive(run=run, kind="checkpoint-now", issuer="t", expires_at=time.time() + 600).signed(SECRET)
        bus.publish(r, k.directives, genuine)
        assert _wait(lambda: len(c._inbox) >= INBOX_MAX, timeout=30)
        time.sleep(0.3)
        assert len(c._inbox) < INBOX_MAX + 100, "reading pauses while the inbox is full"
        got: list[Directive] = []
        assert _wait(lambda: got.extend(c.poll_directives()) or got, timeout=30)
        assert [x.id for x in got] == [genuine.id]
        assert c.rejected == n
        c.flush()
        assert r.xlen(k.acks) <= 21 + (time.monotonic() - t0), "a flood of junk is not a flood of acks"
    finally:
        c.close()


def test_a_directive_issued_far_ahead_of_the_clock_is_refused():
    d = Directive(run="r", kind="pause", issuer="t", issued_at=time.time() + 1e7, expires_at=time.time() + 1e7 + 60).signed(SECRET)
    assert d.verify(SECRET) == "issued in the future"
    ok = Directive(run="r", kind="pause", issuer="t", issued_at=time.time() + 30, expires_at=time.time() + 90).signed(SECRET)
    assert ok.verify(SECRET) is None, "a few seconds of clock skew is not refused"


def test_a_flushall_mid_run_costs_neither_the_judging_nor_the_rollback_targets(redis_url, unique_run):
    """FLUSHALL (or a restart without its data) while both sides run: the trainer's client registers
    the run again with its checkpoints, the daemon recreates its group and goes on judging, and
    damage after it is still rolled back to a checkpoint from before the flush."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    c = BusClient(redis_url, run, SECRET, poll_interval_s=0.02, heartbeat_ttl_s=0.3)
    try:
        c.register({"world_size": 1})
        for s in (10, 20, 30, 40):
            c.register_checkpoint(CheckpointInfo(run=run, step=s, path=f"/c/{s}", created=time.time(), bytes=1,
                                                 manifest_sha256="0" * 64, world_size=1))
        d = make_daemon(r, run)
        for s in range(1, 31):
            c.publish_step(step_rec(run, s))
        pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=run) == 30)
        r.flushall()
        for s in range(31, NAN_STEP + 1):
            c.publish_step(step_rec(run, s, float("nan") if s == NAN_STEP else None))
        pump(d, until=lambda: r.exists(k.directives) and r.xlen(k.directives) > 0, timeout=20)
        assert sample(d, "sentinel_steps_processed_total", run=run) == NAN_STEP
        assert [(x.kind, x.to_step) for x in directives(r, run)] == [("rollback", TARGET)]
        deadline = time.monotonic() + 10  # registered again at the client's next heartbeat
        while run not in bus.list_runs(r) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert run in bus.list_runs(r)
    finally:
        c.close()
