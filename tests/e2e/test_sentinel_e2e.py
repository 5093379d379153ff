"""End to end with real parts: real trainer processes, real Redis servers, the real sentinel.

* ``test_drill_*``: a 2-rank ``torchrun`` trainer gets an ``lr`` x100 drill on one sample of step
  60 of 120 (``sentinel.drill.run_drill``). With the sentinel (on the embedded valkey bus, and on
  Debian's redis-server) the run is rolled back past the onset, the sample is skipped, and the
  final validation loss ends within 2% of a clean run of the same spec; without the sentinel the
  same run ends clearly worse.
* ``test_sentinel_killed_mid_incident_*``: ``sentinel run`` as a subprocess is SIGKILLed the moment
  its rollback directive appears in Redis (its writes frozen with ``CLIENT PAUSE WRITE`` first, so it
  dies before it saves its state / XACKs its batch), then restarted as the same consumer, or a
  different one once the short lease has expired (XAUTOCLAIM path): exactly one rollback.
* ``test_forged_directives_are_rejected``: forged, unsigned, tampered, expired, misaddressed and
  malformed directives XADDed to a live trainer's stream are acked ``rejected``, not applied, and
  counted in ``training_directives_rejected_total``; a genuine signed ``stop`` then works.
* ``test_trainer_survives_a_30s_redis_outage``: Debian redis-server SIGSTOPped for 30 s under a live
  trainer: training keeps stepping, nothing is dropped, and records published after Redis returns
  (and those buffered during the outage) arrive in the stream; directives work again.
* ``test_damage_before_the_first_periodic_checkpoint_*``: a NaN sample at step 5 with checkpoints every
  20: the live sentinel rolls back to the initial state (step 0) the trainer saved at start.
* ``test_malformed_rules_exit_2``: ``sentinel run --rules bad.yaml``: exit 2, one line, no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sentinel import bus
from sentinel.drill import DrillSpec, batch_ids_at, incidents_of, read_steps, run_drill, trainer_command
from sentinel.protocol import Ack, Directive, Event, Keys, StepRecord
from tests.helpers.e2e import ROOT, Procs, clean_env

SLOW = [pytest.mark.slow, pytest.mark.timeout(300)]

# The drill: `sentinel demo`'s, shortened: 2 ranks, 120 steps, an lr x100 fault on one sample of
# step 60, checkpoints every 10 steps, validation every 40 (the final one at step 120).
DRILL_STEPS, DRILL_AT, EVAL_EVERY = 120, 60, 40
ROLLBACK_MARGIN = 20  # DEMO_RULES policy.rollback_margin_steps
RECOVERED_TOL = 0.02  # with the sentinel: within 2% of the clean run
DAMAGED_MIN = 0.05  # without it: more than 5% worse than the clean run

KILL_RULES = """\
version: 1
policy:
  rollback_margin_steps: 20
  skip_margin_steps: 3
  verify_window_steps: 60
rules:
  nonfinite:
    persist_steps: 1
  val_divergence:
    enabled: false
"""


# ------------------------------------------------------------------ helpers


def fault_sample(data_dir: Path, step: int, ranks: int = 1, preset: str = "tiny", seed: int = 1337) -> int:
    from trainer.config import PRESETS

    p = PRESETS[preset]
    gb = p["data"]["micro_batch_size"] * p["data"].get("grad_accum", 1) * ranks
    return min(batch_ids_at(data_dir, seq_len=p["model"]["seq_len"], seed=seed, global_batch=gb, step=step))


def start_trainer(procs: Procs, run_dir: Path, data_dir: Path, url: str, *, steps: int, fault: str | None = None,
                  ckpt_every: int = 10, env: dict[str, str] | None = None) -> subprocess.Popen:
    spec = DrillSpec(run_dir=run_dir, steps=steps, ranks=1, ckpt_every=ckpt_every, eval_every=0, data_dir=data_dir)
    return procs.start(trainer_command(spec, fault, url), run_dir / "trainer.log", env or clean_env())


def start_sentinel(procs: Procs, run_dir: Path, rules: Path, consumer: str, *, lease_ms: int, tag: str) -> tuple[subprocess.Popen, Path]:
    log = run_dir / f"sentinel-{tag}.log"
    cmd = [sys.executable, "-m", "sentinel", "run", str(run_dir), "--rules", str(rules), "--consumer", consumer,
           "--lease-ms", str(lease_ms), "--metrics-port", "0"]  # fmt: skip
    return procs.start(cmd, log, clean_env(COLUMNS="200")), log


def wait_for(cond, timeout: float, what: str, interval: float = 0.05, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: process exited with {proc.returncode}; {tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; {tail(log)}")
        time.sleep(interval)


def tail(path: Path | None, n: int = 15) -> str:
    if path is None:
        return ""
    with contextlib.suppress(OSError):
        return f"{path.name}: " + " | ".join(path.read_text(errors="replace").strip().splitlines()[-n:])
    return ""


def scrape(url: str) -> dict[str, float]:
    """``{name{labels}: value}`` of a /metrics endpoint (labels sorted, as ``k="v"`` pairs)."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def metric(samples: dict[str, float], name: str, **labels) -> float | None:
    for key, v in samples.items():
        n, _, rest = key.partition("{")
        if n == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            return v
    return None


def rank0_metrics_url(run_dir: Path) -> str | None:
    p = run_dir / "metrics_targets.json"
    with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
        groups = json.loads(p.read_text())
        g = next(g for g in groups if g["labels"]["rank"] == "0")
        return f"http://{g['targets'][0]}/metrics"
    return None


def stream_records(r, run: str) -> list:
    out = []
    for eid, fields in r.xrange(Keys(run).steps):
        out.append(bus.decode(bus.Entry(Keys(run).steps, eid, fields)))
    return out


def acks_by_id(r, run: str) -> dict[str, Ack]:
    return {a.directive_id: a for a in (Ack.from_json(f["json"]) for _e, f in r.xrange(Keys(run).acks))}


def steps_in_log(run_dir: Path) -> int:
    try:
        with open(run_dir / "steps.jsonl", "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n") and b'"kind":"step"' in line)
    except FileNotFoundError:
        return 0


# ------------------------------------------------------------------ 1. the drill: detect, roll back, skip, recover


@pytest.fixture(scope="module")
def baselines(tmp_path_factory, data_dir):
    """The same drill spec without a fault (clean) and with the fault but no sentinel (unguarded)."""
    root = tmp_path_factory.mktemp("drill-baselines")
    out = {}
    for name, fault, in (("clean", None), ("unguarded", "lr")):
        res = run_drill(DrillSpec(run_dir=root / name, steps=DRILL_STEPS, drill_step=DRILL_AT, fault=fault, sentinel=False,
                                  eval_every=EVAL_EVERY, data_dir=data_dir), timeout=240)  # fmt: skip
        assert res.returncode == 0, tail(root / name / "trainer.log")
        assert res.final_val_loss is not None and not res.rollbacks
        out[name] = res
    return out


@pytest.mark.parametrize("bus_kind", ["embedded", "debian"])
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_drill_sentinel_rolls_back_skips_and_recovers(bus_kind, baselines, data_dir, tmp_path, unique_run, request, monkeypatch):
    monkeypatch.delenv("SENTINEL_SECRET", raising=False)  # exercise the RUN_DIR/bus/secret path
    monkeypatch.delenv("SENTINEL_REDIS_URL", raising=False)
    url = None
    if bus_kind == "debian":
        url = request.getfixturevalue("redis_server").url
    run_dir = tmp_path / unique_run
    spec = DrillSpec(run_dir=run_dir, steps=DRILL_STEPS, drill_step=DRILL_AT, fault="lr", sentinel=True, data_dir=data_dir,
                     eval_every=EVAL_EVERY, redis_url=url)  # fmt: skip
    try:
        res = run_drill(spec, timeout=240)
        bus_url = bus.resolve_url(run_dir, url)
        r = bus.connect(bus_url)
        incidents = incidents_of(run_dir, bus_url)
        run = run_dir.resolve().name
        dirs = [Directive.from_json(f["json"]) for _e, f in r.xrange(Keys(run).directives)]
        acks = acks_by_id(r, run)
    finally:
        if url is None:
            from sentinel.embedded import stop_embedded

            stop_embedded(run_dir)
    log = "\n".join(res.sentinel_log)
    assert res.returncode == 0, tail(run_dir / "trainer.log")
    (fid,) = res.fault_ids

    # one incident, recorded in Redis, that opened at the damage and was verified healthy again
    assert len(incidents) == 1, incidents
    inc = incidents[0]
    assert DRILL_AT <= inc["onset_step"] <= DRILL_AT + 5, inc
    assert inc["state"] == "healthy", f"incident not verified healthy: {inc['state']}\n{log}"

    # exactly one rollback, to a checkpoint at least the margin before the onset, skipping the faulty sample
    (rb,) = res.rollbacks
    assert rb.from_step <= inc["onset_step"] - ROLLBACK_MARGIN and rb.from_step == inc["rollback_to"]
    assert any(lo <= fid < hi for lo, hi in rb.skip_ranges), (fid, rb.skip_ranges)
    assert json.loads((run_dir / "skiplist.json").read_text()) and any(
        lo <= fid < hi for lo, hi in json.loads((run_dir / "skiplist.json").read_text()))
    # the signed directive that caused it, acked "applied"
    (d,) = [x for x in dirs if x.kind == "rollback"]
    assert d.id == rb.directive_id and d.verify(bus.load_secret(run_dir)) is None
    assert acks[d.id].status == "applied", acks[d.id]
    _later_skips_applied(d, dirs, acks)
    skipped_now = json.loads((run_dir / "skiplist.json").read_text())
    for x in dirs:  # every range the incident sent is on the trainer's skip list
        if x.kind == "skip-samples" and x.id in acks:
            assert all(any(a <= lo and hi <= b for a, b in skipped_now) for lo, hi in x.ranges), (x.ranges, skipped_now)
    print(f"\n[{bus_kind}] directives: " + ", ".join(x.kind for x in dirs))
    # after the restore the faulty sample never trained again (the authoritative records after it)
    assert all(fid not in rec.sample_ids for s, rec in res.steps.items() if s > rb.from_step)
    assert sorted(res.steps) == list(range(1, DRILL_STEPS + 1))
    _backtest_orders_what_live_did(run_dir, inc, rb)

    clean = baselines["clean"].final_val_loss
    unguarded = baselines["unguarded"].final_val_loss
    got = res.final_val_loss
    print(f"\n[{bus_kind}] final val loss: clean {clean:.4f}, sentinel {got:.4f} ({got / clean - 1:+.2%}), "
          f"no sentinel {unguarded:.4f} ({unguarded / clean - 1:+.2%}); rollback to {rb.from_step} "
          f"(onset {inc['onset_step']}, detected {inc['detect_step']}); drill wall {res.wall_seconds:.1f}s")
    assert abs(got - clean) <= RECOVERED_TOL * clean, (got, clean)
    assert unguarded > (1 + DAMAGED_MIN) * clean, (unguarded, clean)
    # a clear margin between the guarded and unguarded outcomes
    assert unguarded - got > 2 * abs(got - clean)


def _backtest_orders_what_live_did(run_dir: Path, inc: dict, rb) -> None:
    """Backtest = live, on the run's own log: ``sentinel backtest RUN_DIR/steps.jsonl`` takes the
    rules the daemon wrote it applied and the run's checkpoint cadence, and orders the very rollback
    the live sentinel did: at the detection step, to the same checkpoint, skipping the same samples."""
    from click.testing import CliRunner

    from sentinel.cli.backtest_cmd import backtest as backtest_cmd
    from sentinel.rules import parse_rules
    from sentinel.rundir import APPLIED_RULES

    assert parse_rules((run_dir / APPLIED_RULES).read_text()) == parse_rules((run_dir / "sentinel-rules.yaml").read_text())
    r = CliRunner().invoke(backtest_cmd, [str(run_dir / "steps.jsonl"), "--json"])
    assert r.exit_code == 0, r.output[-2000:]
    out = json.loads(r.stdout)
    rollbacks = [a for a in out["actions"] if a["kind"] == "rollback"]
    assert [(a["step"], a["to_step"]) for a in rollbacks] == [(inc["detect_step"], rb.from_step)], (rollbacks, inc)
    assert sorted(map(tuple, rollbacks[0]["ranges"])) == sorted(map(tuple, rb.skip_ranges))
    assert len(out["source"]["run_settings"]) == 2, out["source"]


def _later_skips_applied(rollback: Directive, dirs: list[Directive], acks: dict) -> None:
    """Besides its one rollback, an incident may send skip-samples directives: the samples of
    steps the trainer still trained on the damaged branch before it applied the rollback. Each
    belongs to that incident and names samples; the trainer applied each one it read (a sentinel
    restarted mid-incident may catch up on those records after a short run has ended: that one
    stays in the stream for a resumed run, unacked)."""
    later = [x for x in dirs if x.id != rollback.id]
    assert all(x.kind == "skip-samples" and x.incident_id == rollback.incident_id and x.ranges for x in later), dirs
    assert all(acks[x.id].status in ("applied", "duplicate") for x in later if x.id in acks), [acks.get(x.id) for x in later]


# ------------------------------------------------------------------ 2a. sentinel killed mid-incident


def _kill_on_directive(r, run: str, victim: subprocess.Popen, timeout: float) -> dict:
    """Block on the directive stream; the moment the first directive lands freeze every writer
    (CLIENT PAUSE WRITE) so the sentinel cannot save state or XACK, SIGKILL it, then unpause."""
    k = Keys(run)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        resp = r.xread({k.directives: "0-0"}, count=1, block=200)
        if resp:
            break
        if victim.poll() is not None:
            raise AssertionError(f"sentinel exited early with {victim.returncode}")
    else:
        raise AssertionError("no directive from the sentinel")
    t0 = time.monotonic()
    r.execute_command("CLIENT", "PAUSE", "5000", "WRITE")
    try:
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait(10)
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
    pend = r.xpending(k.steps, "sentinel")
    return {"kill_s": time.monotonic() - t0, "pending": pend["pending"], "consumers": pend.get("consumers")}


@pytest.mark.parametrize("restart_as", ["same-consumer", "other-consumer"])
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_sentinel_killed_mid_incident_no_duplicate_rollback(restart_as, data_dir, tmp_path, unique_run, procs):
    from sentinel.embedded import ensure_embedded, stop_embedded

    run_dir = tmp_path / unique_run
    run = unique_run
    url = ensure_embedded(run_dir)
    r = bus.connect(url)
    k = Keys(run)
    rules = run_dir / "rules.yaml"
    rules.write_text(KILL_RULES)
    lease = 1500
    try:
        s1, log1 = start_sentinel(procs, run_dir, rules, "sentinel-a", lease_ms=lease, tag="1")
        wait_for(lambda: r.get(k.leader) == "sentinel-a", 30, "the first sentinel to take the lease", proc=s1, log=log1)
        fid = fault_sample(data_dir, 40)
        tr = start_trainer(procs, run_dir, data_dir, url, steps=120, fault=f"nan@{fid}")
        info = _kill_on_directive(r, run, s1, timeout=90)
        other = "sentinel-a" if restart_as == "same-consumer" else "sentinel-b"
        t_kill = time.monotonic()
        s2, log2 = start_sentinel(procs, run_dir, rules, other, lease_ms=lease, tag="2")
        wait_for(lambda: r.get(k.leader) == other, 30, "the restarted sentinel to take the lease", proc=s2, log=log2)
        takeover_s = time.monotonic() - t_kill
        port = int(wait_for(lambda: re.search(r"http://127\.0\.0\.1:(\d+)/metrics", log2.read_text()), 10,
                            "the metrics port").group(1))  # fmt: skip
        assert tr.wait(120) == 0, tail(run_dir / "trainer.log")
        # the restarted sentinel catches up with the last record and closes the incident
        last_id = r.xrevrange(k.steps, count=1)[0][0]

        def caught_up():
            st = json.loads(r.get(k.policy) or "{}")
            return st.get("last_id") == last_id and st["policy"]["state"] == "healthy"

        wait_for(caught_up, 30, "the restarted sentinel to process every record", proc=s2, log=log2)
        m = scrape(f"http://127.0.0.1:{port}/metrics")
        s2.send_signal(signal.SIGTERM)
        assert s2.wait(20) == 0, tail(log2)
        dirs = [Directive.from_json(f["json"]) for _e, f in r.xrange(k.directives)]
        incidents = [json.loads(v) for v in r.hgetall(k.incidents).values()]
        acks = acks_by_id(r, run)
        pending_after = r.xpending(k.steps, "sentinel")["pending"]
        leader_after = r.get(k.leader)
    finally:
        procs.kill_all()
        stop_embedded(run_dir)

    _steps, timeline = read_steps(run_dir)
    rollbacks = [t for t in timeline if t.kind == "rollback"]
    print(f"\n[{restart_as}] killed {info['kill_s'] * 1000:.1f} ms after the directive with {info['pending']} entries "
          f"unacked {info['consumers']}; new leader after {takeover_s:.2f}s; restarted sentinel: "
          f"rollback sent {metric(m, 'sentinel_actions_total', action='rollback', outcome='sent')}, "
          f"duplicate {metric(m, 'sentinel_actions_total', action='rollback', outcome='duplicate')}")
    assert len([d for d in dirs if d.kind == "rollback"]) == 1, dirs
    assert len(rollbacks) == 1, timeline
    (d,) = [x for x in dirs if x.kind == "rollback"]
    _later_skips_applied(d, dirs, acks)
    assert rollbacks[0].directive_id == d.id and acks[d.id].status == "applied"
    assert any(lo <= fid < hi for lo, hi in rollbacks[0].skip_ranges)
    # the restarted sentinel re-derived or resumed the incident and saw it through, without re-sending
    assert (metric(m, "sentinel_actions_total", action="rollback", outcome="sent") or 0) == 0
    assert len(incidents) == 1 and incidents[0]["state"] == "healthy", incidents
    assert metric(m, "sentinel_steps_processed_total", run=run) > 0
    assert pending_after == 0 and leader_after is None  # everything acked, lease released on warm stop
    if info["pending"]:  # died mid-batch: the restart must have re-processed those entries (re-sent nothing)
        assert (metric(m, "sentinel_actions_total", action="rollback", outcome="duplicate") or 0) <= 1
    if restart_as == "other-consumer":
        # the dead leader was a process of this machine: its successor sees it gone and takes the lease at
        # once instead of waiting it out (daemon_lease; a leader on another host is waited out)
        assert takeover_s < lease / 1000 + 5, f"took {takeover_s:.2f}s to take over from a dead leader on this host"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_damage_before_the_first_periodic_checkpoint_rolls_back_to_the_initial_state(data_dir, tmp_path, unique_run, procs):
    """A NaN sample at step 5, checkpoints every 20: the only checkpoint before the onset is the
    initial state the trainer saved at start. The live sentinel rolls back to it (no pause, no
    page), the sample is skipped, and the run finishes."""
    from sentinel.embedded import ensure_embedded, stop_embedded

    run_dir = tmp_path / unique_run
    url = ensure_embedded(run_dir)
    r = bus.connect(url)
    k = Keys(unique_run)
    rules = run_dir / "rules.yaml"
    rules.write_text(KILL_RULES)
    try:
        s1, log1 = start_sentinel(procs, run_dir, rules, "sentinel-a", lease_ms=5000, tag="1")
        wait_for(lambda: r.get(k.leader) == "sentinel-a", 30, "the sentinel to take the lease", proc=s1, log=log1)
        fid = fault_sample(data_dir, 5)
        tr = start_trainer(procs, run_dir, data_dir, url, steps=120, fault=f"nan@{fid}", ckpt_every=20)
        assert tr.wait(150) == 0, tail(run_dir / "trainer.log")
        dirs = [Directive.from_json(f["json"]) for _e, f in r.xrange(k.directives)]
        acks = acks_by_id(r, unique_run)
        s1.send_signal(signal.SIGTERM)
        assert s1.wait(20) == 0, tail(log1)
    finally:
        procs.kill_all()
        stop_embedded(run_dir)
    assert [d.kind for d in dirs][0] == "rollback", dirs
    (d,) = [x for x in dirs if x.kind == "rollback"]
    _later_skips_applied(d, dirs, acks)
    assert d.to_step == 0 and acks[d.id].status == "applied", (d, acks)
    _steps, timeline = read_steps(run_dir)
    rollbacks = [t for t in timeline if t.kind == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].from_step == 0 and any(lo <= fid < hi for lo, hi in rollbacks[0].skip_ranges)
    assert max(_steps) == 120, sorted(_steps)[-3:]


# ------------------------------------------------------------------ 2b. forged directives


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_forged_directives_are_rejected(data_dir, tmp_path, unique_run, procs):
    from sentinel.embedded import ensure_embedded, stop_embedded

    run_dir = tmp_path / unique_run
    run, k = unique_run, Keys(unique_run)
    url = ensure_embedded(run_dir)
    r = bus.connect(url)
    secret = bus.load_secret(run_dir)
    try:
        tr = start_trainer(procs, run_dir, data_dir, url, steps=100_000, ckpt_every=0)
        log = run_dir / "trainer.log"
        wait_for(lambda: r.xlen(k.steps) >= 5 and rank0_metrics_url(run_dir), 60, "the trainer's first steps", proc=tr, log=log)
        murl = rank0_metrics_url(run_dir)
        forged = {
            "bad signature": Directive(run=run, kind="rollback", to_step=0, ranges=[(0, 10**6)], reason="forged").signed(b"attacker"),
            "unsigned": Directive(run=run, kind="rollback", to_step=0, reason="unsigned"),
            "tampered": Directive(run=run, kind="skip-samples", ranges=[(0, 10)]).signed(secret).model_copy(update={"ranges": [(0, 10**6)]}),
            "expired": Directive(run=run, kind="pause", expires_at=time.time() - 1).signed(secret),
            "other run": Directive(run=run + "-x", kind="stop").signed(secret),
        }
        for d in forged.values():
            bus.publish(r, k.directives, d)
        junk_id = r.xadd(k.directives, {"json": '{"kind": "rollback", "run": 1}'})
        steps_at_forgery = steps_in_log(run_dir)

        def all_acked():
            a = acks_by_id(r, run)
            return all(d.id in a for d in forged.values()) and f"stream:{junk_id}" in a and a

        acks = wait_for(all_acked, 60, "acks for every forged directive", proc=tr, log=log)
        for why, d in forged.items():
            assert acks[d.id].status == "rejected", (why, acks[d.id])
        assert acks[f"stream:{junk_id}"].status == "rejected" and acks[f"stream:{junk_id}"].kind == "unknown"
        assert "signature" in acks[forged["bad signature"].id].detail and acks[forged["unsigned"].id].detail == "unsigned"
        assert acks[forged["tampered"].id].detail == "bad signature" and acks[forged["expired"].id].detail == "expired"
        # still training (the expired pause was not applied), and the counter moved
        wait_for(lambda: steps_in_log(run_dir) > steps_at_forgery + 20, 60, "more steps after the forgeries", proc=tr, log=log)
        n = len(forged) + 1
        def rejected_by_reason() -> dict[str, float]:
            return {k.split('reason="')[1].split('"')[0]: v for k, v in scrape(murl).items()
                    if k.startswith("training_directives_rejected_total{") and f'run="{run}"' in k}

        rejected = wait_for(lambda: sum(rejected_by_reason().values()) >= n and rejected_by_reason(), 20,
                            "training_directives_rejected_total to count them")  # fmt: skip
        assert sum(rejected.values()) == n and rejected["malformed"] >= 1 and rejected["unsigned"] == 1, rejected
        rejected_events = [e for e in (Event.from_json(f["json"]) for _e, f in r.xrange(k.events)) if e.kind == "directive_rejected"]
        assert len(rejected_events) == n

        # the genuine article still works: a signed stop ends the run cleanly
        stop = Directive(run=run, kind="stop", reason="test over").signed(secret)
        bus.publish(r, k.directives, stop)
        assert tr.wait(60) == 0, tail(log)
        assert acks_by_id(r, run)[stop.id].status == "applied"
    finally:
        procs.kill_all()
        stop_embedded(run_dir)
    _steps, timeline = read_steps(run_dir)
    assert [t.kind for t in timeline] == ["start"], timeline  # no rollback happened
    applied = [json.loads(x) for x in (run_dir / "directives.jsonl").read_text().splitlines()]
    assert [(a["id"], a["kind"]) for a in applied] == [(stop.id, "stop")]
    assert json.loads((run_dir / "skiplist.json").read_text()) == []


# ------------------------------------------------------------------ 2c. Redis down for 30 s


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trainer_survives_a_30s_redis_outage(redis_server, data_dir, tmp_path, unique_run, procs):
    OUTAGE_S = 30.0
    run_dir = tmp_path / unique_run
    run_dir.mkdir()
    run, k = unique_run, Keys(unique_run)
    secret = "outage-test-secret-" + unique_run
    r = bus.connect(redis_server.url)
    tr = start_trainer(procs, run_dir, data_dir, redis_server.url, steps=1_000_000, ckpt_every=200,
                       env=clean_env(SENTINEL_SECRET=secret))  # fmt: skip
    log = run_dir / "trainer.log"
    wait_for(lambda: r.xlen(k.steps) >= 20 and rank0_metrics_url(run_dir), 60, "the trainer's first steps", proc=tr, log=log)
    murl = rank0_metrics_url(run_dir)
    assert metric(scrape(murl), "training_telemetry_dropped_total", run=run) == 0

    pid = redis_server.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        n0 = steps_in_log(run_dir)
        progress = [n0]
        while time.monotonic() - t0 < OUTAGE_S:
            time.sleep(5.0)
            progress.append(steps_in_log(run_dir))
            assert tr.poll() is None, tail(log)
    finally:
        os.kill(pid, signal.SIGCONT)
    n1 = progress[-1]
    gains = [b - a for a, b in zip(progress, progress[1:])]
    print(f"\nsteps during the {OUTAGE_S:.0f}s outage: {n1 - n0} (per 5 s: {gains})")
    assert all(g > 0 for g in gains), f"training stalled during the outage: {gains}"

    # records buffered during the outage, and new ones, reach the stream once Redis is back
    def caught_up():
        recs = [x for x in stream_records(r, run) if isinstance(x, StepRecord)]
        return recs and max(x.step for x in recs) >= n1 + 20

    wait_for(caught_up, 60, "step records published after Redis returned", proc=tr, log=log, interval=0.2)
    dropped = metric(scrape(murl), "training_telemetry_dropped_total", run=run)
    stop = Directive(run=run, kind="stop", reason="outage test over").signed(secret.encode())
    bus.publish(r, k.directives, stop)  # the directive path works again too
    assert tr.wait(60) == 0, tail(log)
    assert acks_by_id(r, run)[stop.id].status == "applied"

    steps, _timeline = read_steps(run_dir)
    in_stream = {x.step for x in stream_records(r, run) if isinstance(x, StepRecord)}
    missing = set(steps) - in_stream
    print(f"steps: {len(steps)} in steps.jsonl, {len(in_stream)} distinct in the stream, dropped {dropped}")
    assert dropped == 0, "a 30 s outage fits in the client's buffer: nothing may be dropped"
    assert len(missing) <= dropped, f"{len(missing)} step records never reached Redis but only {dropped} counted as dropped"
    assert set(range(n0, n1 + 1)) <= in_stream  # the outage's own steps were delivered afterwards


# ------------------------------------------------------------------ 2d. malformed rules


BAD_RULES = {
    "range.yaml": ("version: 1\nrules:\n  loss_spike:\n    threshold: -3\n", "rules.loss_spike.threshold"),
    "typo.yaml": ("version: 1\npolicy:\n  rollback_margn_steps: 10\n", "policy.rollback_margn_steps"),
    "syntax.yaml": ("version: 1\nrules:\n  nonfinite: [persist_steps: 2\n", "line "),
}


@pytest.mark.parametrize("name", sorted(BAD_RULES))
def test_malformed_rules_exit_2(name, tmp_path):
    text, field = BAD_RULES[name]
    path = tmp_path / name
    path.write_text(text)
    res = subprocess.run([sys.executable, "-m", "sentinel", "run", "--rules", str(path), "--redis-url", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, timeout=60, env=clean_env(), cwd=ROOT)  # fmt: skip
    assert res.returncode == 2, res
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and not res.stdout.strip(), res.stderr
    assert lines[0].startswith("error: ") and str(path) in lines[0] and field in lines[0], lines[0]
    assert "Traceback" not in res.stderr
