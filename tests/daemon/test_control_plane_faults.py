"""Faults and attacks on the control plane (the bus between trainer and sentinel), on real buses.

Each test replays one attack or fault from the issue against real parts (embedded valkey, the
real trainer, the real daemon) and checks the outcome the issue asks for: rejected, counted by
reason, acknowledged, never re-read, no crash, no wedge, no data lost. Every test prints one
``CHAOS`` line with what it measured (run with ``-s`` to see them; docs/reliability.md quotes
them). CI runs the default sizes in a few minutes; ``SENTINEL_CHAOS_LONG=1`` scales them up.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from sentinel import bus
from sentinel.cli.run_cmd import _bus_groups
from sentinel.daemon import Daemon, Options
from sentinel.embedded import PID_FILE, bus_dir, ensure_embedded, read_password, stop_embedded
from sentinel.fleet import Fleet, Member
from sentinel.metrics import SentinelMetrics
from sentinel.protocol import (
    STEP_CONSUMER_GROUP,
    CheckpointInfo,
    Directive,
    Keys,
    TimelineRecord,
    record_mac,
)
from sentinel.rules import parse_rules
from tests.helpers.daemon import (
    RULES,
    SECRET,
    directives,
    make_daemon,
    publish_steps,
    pump,
    register_checkpoints,
    sample,
    step_rec,
)
from tests.helpers.trainer import trainer_cmd, trainer_env

pytestmark = pytest.mark.timeout(600)
LONG = os.environ.get("SENTINEL_CHAOS_LONG") == "1"


def chaos(case: str, **figures) -> None:
    print(f"CHAOS {case}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


def _kill_bus(run_dir: Path) -> int:
    pid = int((bus_dir(run_dir) / PID_FILE).read_text())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        time.sleep(0.02)
    raise AssertionError("the bus did not die")


# ------------------------------------------------------------------ item 3: the daemon's step reader


def test_hostile_records_are_rejected_by_reason_acked_and_never_reread(embedded_bus, unique_run):
    """The six records that crashed the daemon, and the nine it processed as real, against a live daemon."""
    r = bus.connect(embedded_bus.url)
    raw = bus.connect(embedded_bus.url, decode=False)
    k = Keys(unique_run)
    d = make_daemon(r, unique_run)
    pump(d, until=lambda: d.watchers[unique_run].leader)
    publish_steps(r, unique_run, range(1, 11))  # a healthy prefix: steps 1..10

    def signed(rec: dict) -> dict:  # authentic but hostile: only the range/order checks can stop these
        data = json.dumps(rec, allow_nan=True)
        return {"json": data, "mac": record_mac(SECRET, k.steps, data)}

    good = json.loads(step_rec(unique_run, 11).to_json())
    cases = {
        "v string": ({"json": json.dumps({**good, "v": "abc"})}, "unsigned"),
        "v null (signed)": (signed({**good, "v": None}), "malformed"),
        "v list (signed)": (signed({**good, "v": []}), "malformed"),
        "100,000-deep (signed)": ({"json": '{"a":' * 100_000 + "1" + "}" * 100_000,
                                   "mac": record_mac(SECRET, k.steps, '{"a":' * 100_000 + "1" + "}" * 100_000)}, "too_deep"),
        "non-UTF-8 value": ({b"json": b"\xff\xfe{"}, "not_utf8"),
        "non-UTF-8 field name": ({b"\xffjson": b"{}"}, "not_utf8"),
        "-inf loss": (signed({**good, "loss": float("-inf")}), "out_of_range"),
        "1e308 loss": (signed({**good, "loss": 1e308}), "out_of_range"),
        "negative loss": (signed({**good, "loss": -1.0}), "out_of_range"),
        "NaN time": (signed({**good, "time": float("nan")}), "out_of_range"),
        "inf rank phase": (signed({**good, "rank_phases": [{"forward_backward": 0.4}, {"forward_backward": float("inf")}]}),
                           "out_of_range"),
        "negative step": (signed({**good, "step": -5}), "out_of_range"),
        "another run": (signed({**good, "run": unique_run + "-x"}), "wrong_run"),
        "out of order": (signed({**good, "step": 3}), "out_of_order"),
        "duplicate": (signed({**good, "step": 10}), "duplicate"),
        "unsigned NaN": ({"json": json.dumps({**good, "loss": float("nan")}, allow_nan=True)}, "unsigned"),
        "forged MAC": ({"json": json.dumps(good), "mac": "00" * 32}, "bad_signature"),
    }
    for fields, _ in cases.values():
        raw.xadd(k.steps, fields)
    publish_steps(r, unique_run, range(11, 16))  # genuine records behind the junk
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=unique_run) >= 15)
    want: dict[str, int] = {}
    for _, reason in cases.values():
        want[reason] = want.get(reason, 0) + 1
    got = {reason: sample(d, "sentinel_records_rejected_total", run=unique_run, stream="steps", reason=reason) for reason in want}
    assert got == want
    assert sample(d, "sentinel_steps_processed_total", run=unique_run) == 15
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0
    assert directives(r, unique_run) == []  # nothing hostile made it act
    # a restarted daemon does not re-read (or re-die on) any of them
    d.watchers[unique_run].release()
    d2 = make_daemon(r, unique_run, consumer="b")
    pump(d2, min_iter=5, until=lambda: d2.watchers[unique_run].leader)
    assert sample(d2, "sentinel_steps_processed_total", run=unique_run) == 0
    assert sum(sample(d2, "sentinel_records_rejected_total", run=unique_run, stream="steps", reason=x) for x in want) == 0
    chaos("daemon hostile step records", tried=len(cases), rejected=sum(got.values()), reasons=len(want),
          genuine_processed=15, pending_after=0, reread_after_restart=0)


# ------------------------------------------------------------------ item 4: the bus is closed; records are authenticated


def test_local_user_without_the_secret_cannot_make_the_sentinel_act(embedded_bus, unique_run):
    """The issue's attack: fake NaN step records. Without the password: refused. With it but no secret: ignored."""
    d_bus = bus_dir(embedded_bus.run_dir)
    host = embedded_bus.url.rsplit("@", 1)[1]
    with pytest.raises(bus.BusError, match="authentication failed"):
        bus.connect(f"redis://{host}")  # what any local user could reach before: now NOAUTH
    r = bus.connect(embedded_bus.url)
    # the password is only for the run's owner, and nothing in bus/ is readable by others (AOF included)
    assert stat.S_IMODE(d_bus.stat().st_mode) == 0o700
    r.set("chaos:aof-touch", "1")
    loose = [str(p) for p in d_bus.rglob("*") if stat.S_IMODE(p.stat().st_mode) & 0o077]
    assert not loose, loose
    aof = [p for p in d_bus.rglob("*.aof*") if p.is_file()]
    assert aof and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in aof)
    assert r.config_get("bind")["bind"] == "127.0.0.1"
    # someone who has the password but not the secret: fake NaN records are refused, nothing is signed
    d = make_daemon(r, unique_run)
    register_checkpoints(r, unique_run)
    publish_steps(r, unique_run, range(1, 30))
    for s in range(30, 40):
        bus.publish(r, Keys(unique_run).steps, step_rec(unique_run, s, float("nan")))  # no MAC
    for s in range(40, 45):
        bus.publish(r, Keys(unique_run).steps, step_rec(unique_run, s, float("nan")), secret=b"guessed-secret")
    pump(d, min_iter=10, until=lambda: sample(d, "sentinel_steps_processed_total", run=unique_run) >= 29)
    assert directives(r, unique_run) == []
    assert sample(d, "sentinel_records_rejected_total", run=unique_run, stream="steps", reason="unsigned") == 10
    assert sample(d, "sentinel_records_rejected_total", run=unique_run, stream="steps", reason="bad_signature") == 5
    chaos("forged NaN records", without_password="NOAUTH", forged=15, rejected=15, directives_sent=0,
          bus_dir_mode="0700", aof_files=len(aof), aof_mode="0600")


# ------------------------------------------------------------------ items 1-2: the trainer's directive reader


def _steps_on_stream(r, run: str) -> int:
    return sum(1 for _eid, f in r.xrange(Keys(run).steps) if json.loads(f["json"]).get("kind", "step") == "step")


def test_trainer_survives_hostile_directives_and_restarts_without_rereading(tmp_path, dataset):
    run_dir = tmp_path / "chaos"
    run = run_dir.name
    url = ensure_embedded(run_dir)
    try:
        r = bus.connect(url)
        raw = bus.connect(url, decode=False)
        k = Keys(run)
        junk = [{b"v": b"abc"}, {b"json": b'{"v": "abc"}'}, {b"json": b"\xff\xfe\x00"}, {b"\xff": b"x"},
                {b"json": b'{"a":' * 100_000 + b"1" + b"}" * 100_000}, {b"json": b"[1, 2"}]
        for fields in junk * (20 if LONG else 1):
            raw.xadd(k.directives, fields)
        n_junk = len(junk) * (20 if LONG else 1)
        steps = 30
        args = ("--preset", "tiny", "--data", str(dataset), "--ckpt-every", "0", "--eval-every", "0",
                "--redis-url", "embedded", "--metrics-port", "0")
        t0 = time.monotonic()
        p = subprocess.run(trainer_cmd(run_dir, *args, "--max-steps", str(steps)), env=trainer_env(dataset),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "Traceback" not in p.stderr + p.stdout
        acks = [json.loads(f["json"]) for _e, f in r.xrange(k.acks)]
        assert len(acks) == n_junk and {a["status"] for a in acks} == {"rejected"}
        on_stream = _steps_on_stream(r, run)
        assert steps <= on_stream <= steps + 5, f"{on_stream} step records for {steps} steps: a resend storm"
        assert (run_dir / "directives.cursor").is_file()
        # the control channel still works after the junk: a signed stop ends the restarted run at once
        stop = Directive(run=run, kind="stop", reason="chaos over").signed(bus.load_secret(run_dir))
        bus.publish(r, k.directives, stop)
        p2 = subprocess.run(trainer_cmd(run_dir, *args, "--max-steps", str(steps + 1000)), env=trainer_env(dataset),
                            capture_output=True, text=True, timeout=300)
        assert p2.returncode == 0, p2.stderr[-3000:]
        acks = [json.loads(f["json"]) for _e, f in r.xrange(k.acks)]
        assert len(acks) == n_junk + 1, "a restart re-read (and re-rejected) entries it had handled"
        assert acks[-1]["directive_id"] == stop.id and acks[-1]["status"] == "applied"
        chaos("trainer hostile directives", junk=n_junk, rejected_acked=n_junk, steps=steps, step_entries=on_stream,
              rejected_again_after_restart=0, signed_stop_after_junk="applied", seconds=round(time.monotonic() - t0, 1))
    finally:
        stop_embedded(run_dir)


# ------------------------------------------------------------------ item 8: several runs, one daemon; overload


def _run_dir_with_bus(root: Path, name: str) -> tuple[Path, str]:
    run_dir = root / name
    url = ensure_embedded(run_dir)
    (run_dir / "config.yaml").write_text(f"run_id: {name}\n")
    return run_dir, url


def test_one_sentinel_watches_two_runs_each_on_its_own_bus_and_secret(tmp_path):
    a_dir, a_url = _run_dir_with_bus(tmp_path, "run-a")
    b_dir, b_url = _run_dir_with_bus(tmp_path, "run-b")
    try:
        groups = _bus_groups([str(a_dir), str(b_dir)], None, None)
        assert len(groups) == 2 and {key[1] for key in groups} == {bus.load_secret(a_dir), bus.load_secret(b_dir)}
        m = SentinelMetrics()
        opts = Options(rules=parse_rules(RULES), secret=b"", consumer="fleet")
        from dataclasses import replace

        members = [Member(Daemon(bus.connect(url), replace(opts, secret=secret), runs=ids, metrics=m, log=lambda _m: None), url, rd)
                   for (url, secret, rd), ids in groups.items()]
        fleet = Fleet(members, m, log=lambda _m: None)
        ra, rb = bus.connect(a_url), bus.connect(b_url)
        sa, sb = bus.load_secret(a_dir), bus.load_secret(b_dir)
        for _ in range(3):
            fleet.iterate()
        # run-a healthy on bus A; run-b has an incident on bus B
        for s in range(1, 30):
            bus.publish(ra, Keys("run-a").steps, step_rec("run-a", s), secret=sa)
        register_checkpoints(rb, "run-b")
        for s in range(1, 46):
            bus.publish(rb, Keys("run-b").steps, step_rec("run-b", s, float("nan") if s == 45 else None), secret=sb)
        deadline = time.monotonic() + 30
        while not rb.xlen(Keys("run-b").directives) and time.monotonic() < deadline:
            fleet.iterate()
        (dv,) = directives(rb, "run-b")
        assert dv.kind == "rollback" and dv.verify(sb) is None and dv.verify(sa) == "bad signature"
        assert ra.xlen(Keys("run-a").directives) == 0
        for run, n in (("run-a", 29), ("run-b", 45)):
            assert m.registry.get_sample_value("sentinel_steps_processed_total", {"run": run}) == n
        chaos("one sentinel, two runs", buses=2, secrets=2, run_a_steps=29, run_b_steps=45, run_b_rollback_to=dv.to_step,
              cross_signed=0)
        fleet.stop_requested = True
        fleet.run_forever()  # releases the leases
    finally:
        stop_embedded(a_dir), stop_embedded(b_dir)


def test_sentinel_run_cli_with_two_run_dirs(tmp_path):
    a_dir, _ = _run_dir_with_bus(tmp_path, "run-a")
    b_dir, _ = _run_dir_with_bus(tmp_path, "run-b")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for key in (bus.ENV_URL, bus.ENV_SECRET):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, "-m", "sentinel", "run", str(a_dir), str(b_dir)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ra, rb = bus.connect(bus.resolve_url(a_dir)), bus.connect(bus.resolve_url(b_dir))
            if ra.get(Keys("run-a").leader) and rb.get(Keys("run-b").leader):
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the sentinel did not take both leases")
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        for d in (a_dir, b_dir):
            assert read_password(bus_dir(d)) not in out  # never print a secret
        assert "runs: run-a" in out and "runs: run-b" in out and "Traceback" not in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        stop_embedded(a_dir), stop_embedded(b_dir)


def test_overload_counts_records_trimmed_unread(embedded_bus, unique_run):
    r = bus.connect(embedded_bus.url)
    k = Keys(unique_run)
    logs: list[str] = []
    d = make_daemon(r, unique_run)
    d.log = logs.append
    for w in d.watchers.values():
        w.log = logs.append
    pump(d, until=lambda: d.watchers.get(unique_run) is not None and d.watchers[unique_run].leader)
    n, cap = (200_000, 10_000) if LONG else (20_000, 1_000)
    pipe = r.pipeline(transaction=False)
    for s in range(1, n + 1):  # the trainer outruns a sentinel that is not reading
        data = step_rec(unique_run, s, 2.5).to_json()
        pipe.xadd(k.steps, {"json": data, "mac": record_mac(SECRET, k.steps, data)}, maxlen=cap, approximate=True)
        if s % 2000 == 0:
            pipe.execute()
    pipe.execute()
    length = r.xlen(k.steps)
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=unique_run) >= length, timeout=120)
    trimmed = sample(d, "sentinel_records_trimmed_unread_total", run=unique_run)
    processed = sample(d, "sentinel_steps_processed_total", run=unique_run)
    assert trimmed == n - length and processed == length  # every record accounted for: read or counted lost
    assert any("CANNOT KEEP UP" in line for line in logs)
    chaos("overload", published=n, stream_cap=cap, read=int(processed), trimmed_unread_counted=int(trimmed),
          unaccounted=int(n - processed - trimmed))


# ------------------------------------------------------------------ item 9: failover after retention; dead bus


def test_failover_after_retention_never_targets_a_deleted_checkpoint(embedded_bus, unique_run):
    from sentinel.client.bus import BusClient

    r = bus.connect(embedded_bus.url)
    register_checkpoints(r, unique_run, steps=(10, 20, 30, 40))
    a = make_daemon(r, unique_run, consumer="a", lease_ms=1000)
    publish_steps(r, unique_run, range(1, 41))
    pump(a, until=lambda: sample(a, "sentinel_steps_processed_total", run=unique_run) >= 40)
    assert sorted(a.watchers[unique_run].policy._checkpoints) == [10, 20, 30, 40]
    # retention on the trainer deletes 10 and 20; its bus client drops them from the bus
    c = BusClient(embedded_bus.url, unique_run, SECRET)
    c.retain_checkpoints([30, 40])
    assert c.flush(10)
    c.close()
    assert sorted(int(s) for s in r.hkeys(Keys(unique_run).checkpoints)) == [30, 40]
    # the leader dies without releasing its lease; the standby takes over from the persisted state
    a.watchers[unique_run]._save_state()
    time.sleep(1.2)
    b = make_daemon(r, unique_run, consumer="b", lease_ms=1000)
    publish_steps(r, unique_run, range(41, 46), nan_at=45)
    pump(b, until=lambda: r.xlen(Keys(unique_run).directives) > 0, timeout=20)
    (dv,) = directives(r, unique_run)
    assert dv.to_step in (30, 40), dv.to_step  # never the deleted 10 or 20
    chaos("failover after retention", checkpoints_deleted=2, rollback_to=dv.to_step, deleted_targets_offered=0)


def test_dead_embedded_bus_is_restarted_by_the_supervisors(embedded_bus, unique_run):
    from sentinel.client.bus import BusClient

    run_dir = embedded_bus.run_dir
    r = bus.connect(embedded_bus.url)
    k = Keys(unique_run)
    rounds = 5 if LONG else 2
    c = BusClient(embedded_bus.url, unique_run, SECRET, reconnect=lambda: ensure_embedded(run_dir), poll_interval_s=0.02)
    m = SentinelMetrics()
    fleet_daemon = Daemon(r, Options(rules=parse_rules(RULES), secret=SECRET, consumer="sup"), runs=[unique_run], metrics=m,
                          log=lambda _m: None)
    fleet = Fleet([Member(fleet_daemon, embedded_bus.url, run_dir)], m, log=lambda _m: None)
    step, gaps = 0, []
    try:
        for _ in range(rounds):
            for _ in range(20):
                step += 1
                c.publish_step(step_rec(unique_run, step))
            assert c.flush(20)
            time.sleep(1.2)  # appendfsync everysec: what is older than a second is on disk
            _kill_bus(run_dir)
            t0 = time.monotonic()
            for _ in range(20):  # the trainer keeps training while the bus is down: buffered, not lost
                step += 1
                c.publish_step(step_rec(unique_run, step))
            while True:  # the daemon's supervisor or the trainer's, whichever gets there first
                fleet.iterate()
                try:
                    if bus.connect(embedded_bus.url, check=False, retries=0).ping():
                        break
                except (bus.BusError, redis.RedisError):
                    pass
                assert time.monotonic() - t0 < 60, "nobody restarted the bus"
                time.sleep(0.05)
            gaps.append(time.monotonic() - t0)
            assert c.flush(30)
        got = [json.loads(f["json"])["step"] for _e, f in bus.connect(embedded_bus.url).xrange(k.steps)]
        assert sorted(set(got)) == list(range(1, step + 1)), "records lost across bus restarts"
        restarts = c.bus_restarts + (m.registry.get_sample_value("sentinel_bus_restarts_total", {"run": unique_run}) or 0)
        assert restarts >= rounds
        chaos("dead embedded bus", kills=rounds, records=step, lost=0, max_restart_seconds=round(max(gaps), 2))
    finally:
        c.close()


# ------------------------------------------------------------------ issue 10 item 1: a sentinel started late


def test_late_sentinel_knows_every_checkpoint_and_does_not_act_on_old_history(embedded_bus, unique_run):
    r = bus.connect(embedded_bus.url)
    k = Keys(unique_run)
    now = time.time()

    def t_of(step: int) -> float:  # 15 s a step: step 199 is 15 s old, the incident at 120 20 minutes old
        return now - (200 - step) * 15.0

    bus.publish(r, k.steps, TimelineRecord(kind="start", run=unique_run, from_step=0, timeline=0, time=t_of(0)), secret=SECRET)
    for s in range(1, 200):
        loss = float("nan") if s == 120 else None  # an incident 80 steps before the sentinel started
        bus.publish(r, k.steps, step_rec(unique_run, s, loss).model_copy(update={"time": t_of(s)}), secret=SECRET)
    r.set(k.heartbeat, json.dumps({"step": 199, "time": t_of(199), "sent": now, "pid": 1}), px=60_000)  # the trainer is alive
    ckpts = list(range(20, 200, 20))
    r.hset(k.checkpoints, mapping={str(s): CheckpointInfo(run=unique_run, step=s, path=f"/c/{s}", created=t_of(s), bytes=1,
                                                          manifest_sha256="0" * 64, world_size=1).to_json() for s in ckpts})
    d = make_daemon(r, unique_run)
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=unique_run) >= 199)
    w = d.watchers[unique_run]
    assert sorted(w.policy._checkpoints) == ckpts, "the backlog's start record made it forget checkpoints"
    assert directives(r, unique_run) == [] and w.policy.state == "healthy"  # no rollback/pause over history
    assert sample(d, "sentinel_actions_total", run=unique_run, action="page", outcome="sent") == 0
    # live damage is still acted on, with a real checkpoint as the target
    publish_steps(r, unique_run, range(200, 206), nan_at=205)
    pump(d, until=lambda: r.xlen(k.directives) > 0, timeout=20)
    (dv,) = directives(r, unique_run)
    assert dv.kind == "rollback" and dv.to_step in ckpts and dv.to_step <= 205 - 20
    chaos("late sentinel", checkpoints_on_bus=len(ckpts), known_after_backlog=len(w.policy._checkpoints),
          actions_on_history=0, live_rollback_to=dv.to_step)


def test_step_gate_state_survives_failover(embedded_bus, unique_run):
    """A replayed (duplicate) record after a failover is still refused: the gate's order is persisted."""
    r = bus.connect(embedded_bus.url)
    a = make_daemon(r, unique_run, consumer="a")
    publish_steps(r, unique_run, range(1, 11))
    pump(a, until=lambda: sample(a, "sentinel_steps_processed_total", run=unique_run) >= 10)
    a.watchers[unique_run].release()
    b = make_daemon(r, unique_run, consumer="b")
    bus.publish(r, Keys(unique_run).steps, step_rec(unique_run, 5, float("nan")), secret=SECRET)  # a captured, replayed record
    pump(b, min_iter=5, until=lambda: sample(b, "sentinel_records_rejected_total", run=unique_run, stream="steps",
                                             reason="out_of_order") == 1)
    assert directives(r, unique_run) == []


def test_hostile_run_registry_members_do_not_stop_discovery(embedded_bus, unique_run):
    """In all-runs mode the daemon discovers runs from a set anyone with bus access can SADD to: a
    name costs a watcher (a consumer group, a lease, metric series) only once its trainer signed a
    step record. Junk names, junk streams and a flood of them leave no key and no watcher behind."""
    r = bus.connect(embedded_bus.url)
    raw = bus.connect(embedded_bus.url, decode=False)
    raw.sadd(Keys.RUNS, b"\xff\xfe", b"has space", b"a:b", b"")
    raw.sadd(Keys.RUNS, *[f"junk-{i:05d}" for i in range(3000)])
    raw.xadd(Keys("junk-00001").steps, {b"json": step_rec("junk-00001", 1).to_json().encode()})  # unsigned
    bus.publish(r, Keys("junk-00002").steps, step_rec("junk-00002", 1), secret=b"guessed-secret")
    raw.set(Keys("junk-00003").steps, b"x")  # another Redis type
    bus.register_run(r, unique_run, {"run_dir": "/x"})
    keys_before = set(raw.keys("*"))
    logs: list[str] = []
    d = Daemon(r, Options(rules=parse_rules(RULES), secret=SECRET, consumer="disc"), metrics=SentinelMetrics(), log=logs.append)
    for _ in range(3):
        d.iterate(block_ms=10)
    assert list(d.watchers) == [], "a registered run with no signed record yet is not watched"
    assert set(raw.keys("*")) == keys_before, "discovery wrote nothing for names that are not live runs"
    publish_steps(r, unique_run, range(1, 6))  # its first records: watched within seconds (2 s, doubling, for a name)
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=unique_run) == 5, timeout=15)
    assert list(d.watchers) == [unique_run]
    assert sample(d, "sentinel_runs_unwatched") == 0
    chaos("hostile run registry", bad_members=4 + 3000, discovered=len(d.watchers))


def test_discovery_caps_the_runs_watched_and_retires_ended_ones(embedded_bus, unique_run):
    """--max-runs bounds the watchers (the rest are counted, not watched); a run with no record for
    ``idle_s`` and no heartbeat is released, and its next signed record brings it back."""
    r = bus.connect(embedded_bus.url)
    runs = [f"{unique_run}-{i}" for i in range(3)]
    for run in runs:
        bus.register_run(r, run, {"run_dir": "/x"})
        publish_steps(r, run, range(1, 3))
    logs: list[str] = []
    d = Daemon(r, Options(rules=parse_rules(RULES), secret=SECRET, consumer="cap", max_runs=2, idle_s=3.0),
               metrics=SentinelMetrics(), log=logs.append)
    d.iterate(block_ms=10)
    assert len(d.watchers) == 2 and sample(d, "sentinel_runs_unwatched") == 1
    assert any("--max-runs 2" in line for line in logs)
    time.sleep(3.5)  # no record for longer than idle_s, and no heartbeat: both retire
    d._last_discovery = 0.0
    d.iterate(block_ms=10)
    assert d.watchers == {}, logs[-3:]
    assert sum("no longer watched" in line for line in logs) == 2
    publish_steps(r, runs[0], range(3, 5))
    d._last_discovery = 0.0
    d._not_before.clear()
    pump(d, until=lambda: sample(d, "sentinel_steps_processed_total", run=runs[0]) >= 4)
    assert list(d.watchers) == [runs[0]]


def test_cli_views_survive_hostile_entries(embedded_bus, unique_run):
    """`status`, `incidents`, `pages` and `checkpoints` read what anyone on the bus wrote: no traceback."""
    from click.testing import CliRunner

    from sentinel.cli import main

    r = bus.connect(embedded_bus.url)
    raw = bus.connect(embedded_bus.url, decode=False)
    k = Keys(unique_run)
    bus.register_run(r, unique_run, {"run_dir": "/nonexistent"})
    publish_steps(r, unique_run, range(1, 4))
    for key in (k.steps, k.events, k.acks):
        raw.xadd(key, {b"json": b"\xff\xfe{"})
        raw.xadd(key, {b"\xff": b"x"})
        raw.xadd(key, {b"json": b'{"a":' * 50_000 + b"1" + b"}" * 50_000})
    raw.hset(k.checkpoints, b"7", b"\xff")
    raw.hset(k.incidents, b"\xfe", b'{"v": "abc"}')
    runner = CliRunner()
    outs = {}
    for cmd in (["status", unique_run, "--json"], ["incidents", unique_run], ["pages", unique_run],
                ["checkpoints", unique_run]):
        res = runner.invoke(main, [*cmd, "--redis-url", embedded_bus.url])
        assert res.exception is None or isinstance(res.exception, SystemExit), (cmd, res.output[-2000:])
        assert "Traceback" not in res.output, cmd
        outs[cmd[0]] = res.exit_code
    chaos("CLI views on hostile entries", commands=len(outs), exit_codes=outs, tracebacks=0)
