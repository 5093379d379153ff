"""sentinel.client.bus.BusClient against real servers: order, directives, outages."""

from __future__ import annotations

import json
import logging
import time

import pytest

from sentinel import bus
from sentinel.client.bus import BusClient
from sentinel.protocol import Ack, CheckpointInfo, Directive, Event, Keys, TimelineRecord
from tests.helpers.bus import SECRET, poll, step_record, steps_in_stream
from tests.helpers.services import free_port

# "Never blocks" means: far below any network wait the client could be stuck in (I/O timeout 2 s,
# a paused server 1.5 s). Not a speed target (those live in bench/): a loaded CI core can take
# tens of ms to schedule a thread, so the bound is generous.
NEVER_BLOCKS_S = 0.5


def _poll_until(client: BusClient, n: int, timeout: float = 10.0) -> list[Directive]:
    got: list[Directive] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += client.poll_directives()
        time.sleep(0.02)
    return got


@pytest.fixture
def client_for():
    clients: list[BusClient] = []

    def make(url: str, run: str, **kw) -> BusClient:
        c = BusClient(url, run, SECRET, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close(timeout=0.5)


def test_steps_arrive_in_order_with_heartbeat(redis_url, unique_run, client_for):
    c = client_for(redis_url, unique_run, heartbeat_ttl_s=30)
    c.publish_step(TimelineRecord(kind="start", run=unique_run, from_step=0, timeline=0, time=time.time()))
    for s in range(1, 301):
        c.publish_step(step_record(unique_run, s))
    assert c.flush(10)
    r = bus.connect(redis_url)
    entries = r.xrange(Keys(unique_run).steps)
    recs = [bus.decode(bus.Entry(Keys(unique_run).steps, eid, f)) for eid, f in entries]
    assert isinstance(recs[0], TimelineRecord)
    assert [x.step for x in recs[1:]] == list(range(1, 301))
    assert recs[5].sample_ids == [20, 21, 22, 23]
    assert c.connected and c.dropped == 0
    hb = poll(lambda: (v := r.get(Keys(unique_run).heartbeat)) and json.loads(v)["step"] == 300 and v)
    assert json.loads(hb)["step"] == 300
    assert 0 < r.pttl(Keys(unique_run).heartbeat) <= 30_000


def test_checkpoints_skiplist_acks_events(redis_url, unique_run, client_for):
    c = client_for(redis_url, unique_run)
    k = Keys(unique_run)
    info = CheckpointInfo(run=unique_run, step=100, path="/x/step-00000100", created=time.time(), bytes=10,
                          manifest_sha256="ab" * 32, world_size=2)  # fmt: skip
    c.register_checkpoint(info)
    c.set_skiplist([(10, 20)])
    c.set_skiplist([(10, 20), (30, 40)])  # only the latest value matters
    c.ack(Ack(run=unique_run, directive_id="d1", kind="pause", status="applied", step=7))
    c.publish_event(Event(run=unique_run, kind="resume", message="resumed from 100"))
    assert c.flush(10)
    r = bus.connect(redis_url)
    assert CheckpointInfo.from_json(r.hget(k.checkpoints, "100")).path == "/x/step-00000100"
    assert json.loads(r.get(k.skiplist)) == [[10, 20], [30, 40]]
    assert bus.decode(bus.Entry(k.acks, *r.xrange(k.acks)[0])).directive_id == "d1"
    assert bus.decode(bus.Entry(k.events, *r.xrange(k.events)[0])).message == "resumed from 100"



@pytest.mark.parametrize("flag", [True, False], ids=["pause", "resume"])
def test_a_pause_acked_is_on_the_heartbeat_even_when_a_round_trip_was_in_flight(redis_url, unique_run, client_for,
                                                                                monkeypatch, flag):
    """The control loop calls set_paused, then acks. A round trip already in flight when set_paused ran wrote
    the old flag: the next one (the ack's) must write the new one, or ``sentinel pause`` returns while
    ``sentinel status`` still says live (CI, 2026-11-30). The interleaving is forced, not waited for."""
    import sentinel.client.bus as client_bus

    c = client_for(redis_url, unique_run, heartbeat_ttl_s=30)
    c.set_paused(not flag)
    c.publish_step(step_record(unique_run, 1))
    assert c.flush(10)
    real, armed = client_bus.round_trip, [True]

    def in_flight(r, conn, cmds):  # set_paused lands while this iteration's commands are on the wire
        if armed and any(cmd[0] == "XADD" for cmd in cmds):
            armed.clear()
            c.set_paused(flag)
        return real(r, conn, cmds)

    monkeypatch.setattr(client_bus, "round_trip", in_flight)
    c.publish_step(step_record(unique_run, 2))
    assert c.flush(10) and not armed
    c.ack(Ack(run=unique_run, directive_id="d1", kind="pause" if flag else "resume", status="applied", step=2))
    assert c.flush(10)
    beat = json.loads(bus.connect(redis_url).get(Keys(unique_run).heartbeat))
    assert beat["paused"] is flag and beat["step"] == 2, beat


def test_signed_directive_is_delivered(redis_url, unique_run, client_for):
    c = client_for(redis_url, unique_run)
    r = bus.connect(redis_url)
    d = Directive(run=unique_run, kind="rollback", to_step=100, ranges=[(5, 9)], reason="spike").signed(SECRET)
    bus.publish(r, Keys(unique_run).directives, d)
    got = _poll_until(c, 1)
    assert [x.id for x in got] == [d.id]
    assert got[0].to_step == 100 and got[0].ranges == [(5, 9)]
    assert c.poll_directives() == []  # delivered once
    assert c.rejected == 0


def test_bad_directives_are_rejected_counted_and_acked(redis_url, unique_run, client_for, caplog):
    c = client_for(redis_url, unique_run)
    k = Keys(unique_run)
    r = bus.connect(redis_url)
    good1 = Directive(run=unique_run, kind="pause").signed(SECRET)
    forged = Directive(run=unique_run, kind="stop").signed(b"not-the-secret")
    tampered = Directive(run=unique_run, kind="rollback", to_step=10).signed(SECRET).model_copy(update={"to_step": 0})
    unsigned = Directive(run=unique_run, kind="stop")
    expired = Directive(run=unique_run, kind="pause", expires_at=time.time() - 1).signed(SECRET)
    other_run = Directive(run=unique_run + "-other", kind="stop").signed(SECRET)
    good2 = Directive(run=unique_run, kind="resume").signed(SECRET)
    for d in (good1, forged, tampered, unsigned, expired, other_run, "{not json", good2):
        bus.publish(r, k.directives, d)
    with caplog.at_level(logging.WARNING, logger="sentinel.client.bus"):
        got = _poll_until(c, 2)  # good2 is last, so every bad one has been seen by then
    assert [x.id for x in got] == [good1.id, good2.id]  # stream order, bad ones filtered
    assert c.rejected == 6
    assert c.flush(10)
    acks = [bus.decode(bus.Entry(k.acks, eid, f)) for eid, f in r.xrange(k.acks)]
    assert [a.status for a in acks] == ["rejected"] * 6
    by_id = {a.directive_id: a for a in acks}
    assert by_id[forged.id].detail == "bad signature" and by_id[forged.id].kind == "stop"
    assert by_id[tampered.id].detail == "bad signature"
    assert by_id[unsigned.id].detail == "unsigned"
    assert by_id[expired.id].detail == "expired"
    assert "addressed to run" in by_id[other_run.id].detail
    malformed = [a for a in acks if a.directive_id.startswith("stream:")]
    assert len(malformed) == 1 and malformed[0].kind == "unknown"
    events = [bus.decode(bus.Entry(k.events, eid, f)) for eid, f in r.xrange(k.events)]
    assert len(events) == 6 and {e.kind for e in events} == {"directive_rejected"}
    lines = [rec.getMessage() for rec in caplog.records if "rejected directive" in rec.getMessage()]
    # one line per reason (a flood of junk must not flood the log); every one is counted by reason
    assert len(lines) == 5 and all("\n" not in ln and SECRET.decode() not in ln for ln in lines)
    assert c.rejected_by_reason == {"bad_signature": 2, "unsigned": 1, "expired": 1, "wrong_run": 1, "malformed": 1}


def test_start_after_tail_skips_old_directives(redis_url, unique_run, client_for):
    r = bus.connect(redis_url)
    k = Keys(unique_run)
    old = Directive(run=unique_run, kind="pause").signed(SECRET)
    bus.publish(r, k.directives, old)
    replaying = client_for(redis_url, unique_run)  # default "0-0": re-reads what is there
    tailing = client_for(redis_url, unique_run, start_after_id="$")
    assert [d.id for d in _poll_until(replaying, 1)] == [old.id]
    assert poll(lambda: tailing.connected)
    new = Directive(run=unique_run, kind="resume").signed(SECRET)
    bus.publish(r, k.directives, new)
    assert [d.id for d in _poll_until(tailing, 1)] == [new.id]


def test_redis_down_at_start_never_blocks_or_raises(unique_run, client_for):
    url = f"redis://127.0.0.1:{free_port()}/0"
    t0 = time.perf_counter()
    c = client_for(url, unique_run, queue_max=20)
    assert time.perf_counter() - t0 < NEVER_BLOCKS_S
    lat = []
    for s in range(50):
        t = time.perf_counter()
        c.publish_step(step_record(unique_run, s))
        c.poll_directives()
        lat.append(time.perf_counter() - t)
    assert max(lat) < NEVER_BLOCKS_S, max(lat)
    assert not c.connected
    assert c.dropped == 30
    assert c.flush(timeout=0.2) is False
    t = time.perf_counter()
    c.close(timeout=0.2)
    assert time.perf_counter() - t < 1.5


def test_slow_redis_does_not_stall_the_caller(redis_server, unique_run, client_for):
    c = client_for(redis_server.url, unique_run)
    c.publish_step(step_record(unique_run, 0))
    assert c.flush(5)
    admin = bus.connect(redis_server.url)
    admin.execute_command("CLIENT", "PAUSE", "1500", "WRITE")  # every write now hangs 1.5 s
    lat = []
    for s in range(1, 101):
        t = time.perf_counter()
        c.publish_step(step_record(unique_run, s))
        lat.append(time.perf_counter() - t)
        time.sleep(0.005)
    assert max(lat) < NEVER_BLOCKS_S, max(lat)
    assert c.flush(10)
    assert steps_in_stream(admin, unique_run) == list(range(101))
    assert c.dropped == 0


def test_outage_buffers_drops_oldest_and_recovers(redis_server, unique_run, client_for):
    k = Keys(unique_run)
    c = client_for(redis_server.url, unique_run, queue_max=50)
    c.publish_step(step_record(unique_run, 0))
    assert c.flush(5) and c.connected

    redis_server.stop()  # an outage (no persistence: the server comes back empty)
    t_down = time.monotonic()
    lat = []
    for s in range(1, 101):
        t = time.perf_counter()
        c.publish_step(step_record(unique_run, s))
        c.poll_directives()
        lat.append(time.perf_counter() - t)
        time.sleep(0.01)
    assert max(lat) < NEVER_BLOCKS_S, f"max {max(lat) * 1e3:.1f} ms"
    assert poll(lambda: not c.connected, timeout=5)
    assert c.dropped == 50  # 100 published into a 50-record buffer: the 50 oldest went
    time.sleep(max(0.0, 3.0 - (time.monotonic() - t_down)))

    redis_server.start()  # back on the same port
    assert c.flush(timeout=15), f"pending={c.pending}"
    assert c.connected
    r = bus.connect(redis_server.url)
    assert steps_in_stream(r, unique_run) == list(range(51, 101))  # the newest 50, in order
    c.publish_step(step_record(unique_run, 101))
    d = Directive(run=unique_run, kind="checkpoint-now").signed(SECRET)
    bus.publish(r, k.directives, d)
    assert [x.id for x in _poll_until(c, 1)] == [d.id]
    assert c.flush(5)
    assert steps_in_stream(r, unique_run)[-1] == 101
    assert json.loads(r.get(k.heartbeat))["step"] == 101
