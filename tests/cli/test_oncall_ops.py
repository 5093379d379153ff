"""On-call operations on live runs (issue 10): the trainer obeys preemption while paused, hangs and
stragglers are visible, and incidents and pages survive the bus being down.

Everything here is real: ``python -m trainer`` / ``torchrun --nproc-per-node 2`` (gloo, CPU) on the
run's embedded valkey bus, signed directives, the real sentinel daemon and CLI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sentinel import bus
from sentinel.protocol import Directive, Keys
from tests.helpers.trainer import descendants, kill_all, read_steps, trainer_cmd, trainer_env, wait_for

_wait, _steps = wait_for, read_steps


def _last_step(run_dir: Path) -> int:
    return max((r["step"] for r in _steps(run_dir) if r.get("kind") == "step"), default=0)


def _ack(r, keys: Keys, d: Directive, proc, timeout: float = 60.0) -> dict:
    def find():
        for _, fields in r.xrange(keys.acks):
            a = json.loads(fields["json"])
            if a["directive_id"] == d.id:
                return a
        return None

    return _wait(find, timeout, f"ack of {d.kind}", proc)


def _start(tmp_path: Path, dataset: Path, name: str, *extra: str, nproc: int = 1) -> tuple[Path, subprocess.Popen]:
    run_dir = tmp_path / name
    proc = subprocess.Popen(
        trainer_cmd(run_dir, "--preset", "tiny", "--data", str(dataset), "--max-steps", "100000", "--ckpt-every", "0",
                    "--eval-every", "0", "--redis-url", "embedded", "--metrics-port", "0", *extra, nproc=nproc),
        env=trainer_env(dataset), stdout=open(tmp_path / f"{name}.log", "wb"), stderr=subprocess.STDOUT,
        start_new_session=True)
    return run_dir, proc


def _cleanup(run_dir: Path, proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        kill_all(proc)
    from sentinel.embedded import stop_embedded

    stop_embedded(run_dir)


# ================================================================== item 2: SIGTERM while paused
@pytest.mark.slow
@pytest.mark.parametrize("nproc,signame", [(1, "SIGTERM"), (2, "SIGTERM"), (1, "SIGINT")])
def test_paused_trainer_checkpoints_and_exits_on_signal(tmp_path, dataset, nproc, signame):
    """Preemption of a paused run (Kubernetes/Slurm send SIGTERM to the launcher, torchrun forwards it
    to every rank): the run checkpoints its current step and exits 0 within seconds, it is not killed
    after the grace period with its progress lost."""
    run_dir, proc = _start(tmp_path, dataset, f"pz{nproc}", nproc=nproc)
    try:
        _wait(lambda: _last_step(run_dir) >= 5 and (run_dir / "bus" / "secret").is_file(), 120, "first steps", proc)
        r = bus.connect(bus.resolve_url(run_dir))
        keys = Keys(run_dir.name)
        d = Directive(run=run_dir.name, kind="pause", reason="test").signed(bus.load_secret(run_dir))
        bus.publish(r, keys.directives, d)
        assert _ack(r, keys, d, proc)["status"] == "applied"
        # the heartbeat says paused: `sentinel status` and the hang rule tell it from a hang
        _wait(lambda: json.loads(r.get(keys.heartbeat) or "{}").get("paused") is True, 10, "paused heartbeat", proc)
        time.sleep(1.0)  # a step in flight when the pause landed may still be written
        paused_at = _last_step(run_dir)
        time.sleep(1.0)
        assert _last_step(run_dir) == paused_at, "steps kept coming while paused"
        workers = descendants(proc.pid)
        t0 = time.monotonic()
        os.kill(proc.pid, getattr(signal, signame))  # the launcher only, as a kubelet or slurmstepd does
        try:
            rc = proc.wait(60)  # generous bound: before the fix it never exits (paused forever)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a paused trainer ignored {signame} for 60 s") from None
        took = time.monotonic() - t0
        log = (tmp_path / f"pz{nproc}.log").read_text(errors="replace")
        ck = run_dir / "checkpoints" / f"step-{paused_at:08d}" / "manifest.json"
        assert ck.is_file(), f"no checkpoint of the paused step {paused_at}:\n{log[-3000:]}"
        assert f"stopping at step {paused_at} ({signame}, paused; checkpointing first)" in log, log[-3000:]
        assert not [p for p in workers if Path(f"/proc/{p}").exists()]
        if nproc == 1:
            assert rc == 0, log[-3000:]
        else:
            # torchrun itself always reports the signal it got (SignalException, rc != 0: its behaviour,
            # not ours); what matters is that every rank finished its checkpoint and exited on its own,
            # not SIGKILLed after torchrun's grace period, and with no error of ours
            assert "closing signal SIGKILL" not in log, log[-3000:]
            assert log.count("Traceback") == 1 and "SignalException" in log.split("Traceback")[1], log[-3000:]
        print(f"{nproc} rank(s): paused, {signame} -> checkpoint of step {paused_at} and exit rc {rc} in {took:.1f}s")
    finally:
        _cleanup(run_dir, proc)


def _sentinel(run_dir: Path, log: Path, *extra: str) -> subprocess.Popen:
    import sys

    env = trainer_env()
    env["COLUMNS"] = "200"
    return subprocess.Popen([sys.executable, "-m", "sentinel", "run", str(run_dir), "--metrics-port", "0", *extra],
                            env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)


def _events(r, keys: Keys) -> list[dict]:
    return [json.loads(f["json"]) for _, f in r.xrange(keys.events)]


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ================================================================== item 5: per-rank phases, straggler
@pytest.mark.slow
def test_straggler_drill_names_the_slow_rank_and_phase(tmp_path, dataset):
    """``--inject-fault slow@1:SECONDS`` on a real 2-rank run: every step record carries per-rank phase
    times in which rank 1 is busy in forward_backward while rank 0 waits in the all-reduce, and the
    sentinel's rank_straggler rule fires naming rank 1 and forward_backward (wall step times alone
    are equal on both ranks and could never show it)."""
    run_dir, proc = _start(tmp_path, dataset, "slow", "--inject-fault", "slow@1:0.25", nproc=2)
    sentinel = None
    try:
        _wait(lambda: _last_step(run_dir) >= 1 and (run_dir / "bus" / "secret").is_file(), 120, "first steps", proc)
        sentinel = _sentinel(run_dir, tmp_path / "sentinel.log")
        r = bus.connect(bus.resolve_url(run_dir))
        keys = Keys(run_dir.name)

        def fired():
            return [e for e in _events(r, keys) if e["kind"] == "rule_fired" and e["data"].get("rule") == "rank_straggler"]

        ev = _wait(fired, 120, "rank_straggler to fire", proc)[0]
        assert ev["data"]["rank"] == 1 and ev["data"]["phase"] == "forward_backward", ev
        assert "rank 1 straggles" in ev["message"] and "forward_backward" in ev["message"]
        page = _wait(lambda: [e for e in _events(r, keys) if e["kind"] == "page" and "rank_straggler" in e["message"]],
                     30, "the straggler page", sentinel)
        assert "rank 1" in page[0]["message"]
        recs = [x for x in _steps(run_dir) if x.get("kind") == "step" and x["step"] >= 3]
        assert recs and all(len(x["rank_phases"]) == 2 for x in recs)
        for x in recs:
            fast, slow = x["rank_phases"]
            # the drill's 0.25 s lands in rank 1's forward_backward and in rank 0's all-reduce wait
            assert slow["forward_backward"] > 0.2 and fast["allreduce_wait"] > 0.2, x["rank_phases"]
            assert slow["forward_backward"] > fast["forward_backward"] + 0.2
            assert set(fast) == {"data_wait", "forward_backward", "allreduce_wait", "optimizer"}
    finally:
        _stop(sentinel)
        _cleanup(run_dir, proc)


# ================================================================== items 4 + 8: hangs, pages, the run-dir mirror
def _rank_pid(proc: subprocess.Popen, rank: int) -> int:
    for pid in descendants(proc.pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    raise AssertionError(f"no worker process with RANK={rank}")


def _cli_json(*args: str) -> dict:
    import sys

    p = subprocess.run([sys.executable, "-m", "sentinel", *args, "--json"], env=trainer_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


@pytest.mark.slow
def test_hung_rank_opens_incident_shows_hung_and_pages_survive_the_bus(tmp_path, dataset):
    """The SIGSTOP drill on a live 2-rank run with the sentinel watching (no Alertmanager):
    - the daemon warns at startup that pages reach nobody;
    - the stale heartbeat opens an incident (rule heartbeat_stale) and pages, linked to it;
    - `sentinel status` shows the run hung with the age of its last step, never "live";
    - the incident and the page are mirrored to RUN_DIR/incidents.jsonl and pages.jsonl;
    - when the rank continues, steps flow and the incident closes by itself;
    - with the trainer and its bus gone, `sentinel pages` and `sentinel incidents` still answer from
      the run directory."""
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  heartbeat_stale:\n    stale_seconds: 5\n")
    run_dir, proc = _start(tmp_path, dataset, "hang", nproc=2)
    sentinel = None
    slog = tmp_path / "sentinel.log"
    try:
        _wait(lambda: _last_step(run_dir) >= 3 and (run_dir / "bus" / "secret").is_file(), 120, "first steps", proc)
        sentinel = _sentinel(run_dir, slog, "--rules", str(rules))
        _wait(lambda: "watching run" in slog.read_text(errors="replace"), 60, "the sentinel to start", sentinel)
        assert "WARNING no --alertmanager-url: pages reach NOBODY" in slog.read_text(errors="replace")
        r = bus.connect(bus.resolve_url(run_dir))
        keys = Keys(run_dir.name)
        victim = _rank_pid(proc, 1)
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.time()
        try:
            # (on a loaded machine other rules may page too, e.g. data_wait_high: look at the hang's page)
            page = _wait(lambda: [e for e in _events(r, keys) if e["kind"] == "page" and "heartbeat_stale" in e["message"]],
                         60, "the hang page", sentinel)[0]
            assert page["incident_id"] and page["data"]["rule"] == "heartbeat_stale", page
            iid = page["incident_id"]
            # the page goes out first, then the daemon stores the incident (same poll): wait for it
            inc = json.loads(_wait(lambda: r.hget(keys.incidents, iid), 30, "the hang incident on the bus", sentinel))
            assert inc["rule"] == "heartbeat_stale" and inc["state"] == "incident" and inc.get("closed_at") is None
            row = _cli_json("status", str(run_dir))["runs"][0]
            assert row["state"] == "hung" and iid in row["open_incident_ids"], row
            assert row["last_step_age_seconds"] >= 5 and row["heartbeat_age_seconds"] < 15, row
            # the mirror, written as it happened
            pages = [p for p in _jsonl(run_dir / "pages.jsonl") if p["rule"] == "heartbeat_stale"]
            assert [p["incident_id"] for p in pages] == [iid]
            assert set(pages[0]) == {"time", "run", "severity", "summary", "incident_id", "rule", "delivered_to"}
            assert "alertmanager" not in pages[0]["delivered_to"] and "run_dir" in pages[0]["delivered_to"]
            _wait(lambda: any(i["id"] == iid and i["state"] == "incident" for i in _jsonl(run_dir / "incidents.jsonl")),
                  30, "the hang incident in incidents.jsonl", sentinel)
            live = [p for p in _cli_json("pages", str(run_dir))["runs"][0]["pages"] if p["rule"] == "heartbeat_stale"]
            assert [p["incident_id"] for p in live] == [iid]
        finally:
            os.kill(victim, signal.SIGCONT)
        hung_for = time.time() - stopped_at
        n = _last_step(run_dir)
        _wait(lambda: _last_step(run_dir) > n + 3, 60, "steps after SIGCONT", proc)

        def closed():
            last = {i["id"]: i for i in _jsonl(run_dir / "incidents.jsonl")}  # the last line per id wins
            return last.get(iid, {}).get("closed_at") is not None and last[iid]

        assert _wait(closed, 60, "the hang incident to close", sentinel)["state"] == "recovered"
        _stop(sentinel)
        sentinel = None
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        _stop(sentinel)
        _cleanup(run_dir, proc)  # stops the run's embedded bus: from here on only the run dir answers
    offline = _cli_json("pages", str(run_dir))["runs"][0]
    assert offline["source"] == "files" and iid in [p["incident_id"] for p in offline["pages"]]
    incs = _cli_json("incidents", str(run_dir))["runs"][0]
    (hang,) = [i for i in incs["incidents"] if i["id"] == iid]
    assert incs["source"] == "files" and hang["state"] == "recovered" and hang["rule"] == "heartbeat_stale"
    print(f"SIGSTOP of rank 1 for {hung_for:.0f}s: incident {iid} opened, paged, closed after SIGCONT")


def _watcher(url: str, run: str, run_dir: Path, alertmanager_url: str | None = None):
    from sentinel.daemon import Options, RunWatcher
    from sentinel.metrics import SentinelMetrics
    from sentinel.rules import default_rules

    logs: list[str] = []
    m = SentinelMetrics()
    opts = Options(rules=default_rules(), secret=b"s" * 32, run_dirs={run: run_dir}, alertmanager_url=alertmanager_url)
    return RunWatcher(bus.connect(url), run, opts, m, logs.append), m, logs


@pytest.mark.slow
def test_page_delivered_to_a_real_alertmanager_is_recorded(tmp_path, embedded_bus, unique_run):
    """With --alertmanager-url, a page reaches a real prometheus-alertmanager (its v2 API lists the
    alert, labelled with the run, rule severity and incident) and the mirror says so."""
    import urllib.request

    from sentinel import rundir
    from sentinel.policy import Action
    from tests.helpers.services import free_port, require_binary, wait_port

    am_bin = require_binary("prometheus-alertmanager")
    port = free_port()
    cfg = tmp_path / "am.yml"
    cfg.write_text("route:\n  receiver: none\nreceivers:\n  - name: none\n")
    am = subprocess.Popen([am_bin, f"--config.file={cfg}", f"--storage.path={tmp_path / 'am'}",
                           f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=", "--log.level=warn"],
                          stdout=open(tmp_path / "am.log", "wb"), stderr=subprocess.STDOUT)
    try:
        wait_port(port, 30, am)

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as resp:
                    return resp.status == 200
            except OSError:
                return False

        _wait(ready, 30, "Alertmanager ready")
        w, _, logs = _watcher(embedded_bus.url, unique_run, embedded_bus.run_dir, f"http://127.0.0.1:{port}")
        w._execute([Action(kind="page", run=unique_run, incident_id=f"{unique_run}-hang", idempotency_key="k1",
                           reason="heartbeat_stale: no heartbeat for 301s")], None)
        (page,) = rundir.read_pages_log(embedded_bus.run_dir)
        assert page["delivered_to"] == ["log", "bus", "alertmanager", "run_dir"], logs
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v2/alerts", timeout=5) as resp:
            alerts = json.loads(resp.read())
        (a,) = [x for x in alerts if x["labels"].get("run") == unique_run][:1]
        assert a["labels"]["alertname"] == "SentinelPage" and a["labels"]["severity"] == "critical"
        assert a["labels"]["incident"] == f"{unique_run}-hang" and "no heartbeat" in a["annotations"]["summary"]
    finally:
        am.terminate()
        am.wait(10)


def test_page_mirror_on_a_full_disk_counts_and_goes_on(embedded_bus, unique_run):
    """pages.jsonl on a full disk (/dev/full: every write is ENOSPC): the page still goes out on the
    bus, the failure is counted in sentinel_mirror_write_failures_total and logged once, nothing
    raises; once the disk has room again the next page is mirrored and readable."""
    from sentinel import rundir
    from sentinel.policy import Action

    run_dir = embedded_bus.run_dir
    (run_dir / "pages.jsonl").symlink_to("/dev/full")
    w, m, logs = _watcher(embedded_bus.url, unique_run, run_dir)

    def page(n: int) -> Action:
        return Action(kind="page", run=unique_run, incident_id=None, reason=f"rank_straggler: rank 1 slow ({n})",
                      idempotency_key=f"k{n}")

    w._execute([page(1), page(2)], None)
    failures = m.registry.get_sample_value("sentinel_mirror_write_failures_total", {"run": unique_run, "file": "pages.jsonl"})
    assert failures == 2
    assert sum("No space left on device" in x for x in logs) == 1, logs  # logged once, counted every time
    assert [e["kind"] for e in _events(w.r, Keys(unique_run))] == ["page", "page"]  # the bus still got both
    (run_dir / "pages.jsonl").unlink()
    w._execute([page(3)], None)
    (p,) = rundir.read_pages_log(run_dir)
    assert p["summary"].endswith("(3)") and p["rule"] == "rank_straggler" and p["severity"] == "warning"
    assert p["delivered_to"] == ["log", "bus", "run_dir"] and p["incident_id"] is None


def test_jsonl_mirror_fences_a_torn_line(tmp_path):
    """A write cut short (here: a fragment left by a failed append) never merges with the next line."""
    from sentinel import rundir

    m = rundir.JsonlMirror(tmp_path / "pages.jsonl")
    (tmp_path / "pages.jsonl").write_text('{"time": 1.0, "summary": "cut sh')  # the torn tail of a full disk
    m._torn = True
    assert m.append({"time": 2.0, "summary": "whole"})
    assert [p["summary"] for p in rundir.read_pages_log(tmp_path)] == ["whole"]
    assert m.failures == 0


def test_pages_reader_rejects_hostile_lines(tmp_path):
    """Random JSON values, torn and non-UTF-8 lines in pages.jsonl: the reader keeps only real pages,
    normalised to the page fields, and never raises."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from sentinel import rundir

    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=20))
    values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=8), c, max_size=4)),
                          max_leaves=10)
    page_like = st.fixed_dictionaries({"time": st.one_of(st.floats(allow_nan=False, allow_infinity=False), values),
                                       "summary": st.one_of(st.text(max_size=30), values)},
                                      optional={k: values for k in ("run", "severity", "incident_id", "rule", "delivered_to")})

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.one_of(values, page_like), max_size=8), st.binary(max_size=20))
    def check(objs, junk):
        lines = [json.dumps(o).encode() for o in objs] + [junk.replace(b"\n", b"")]
        (tmp_path / "pages.jsonl").write_bytes(b"\n".join(lines))
        for p in rundir.read_pages_log(tmp_path):
            assert set(p) == set(rundir.PAGE_FIELDS)
            assert isinstance(p["time"], float) and isinstance(p["summary"], str)
            assert all(isinstance(x, str) for x in p["delivered_to"])

    check()


def test_status_never_says_live_for_a_stalled_run(embedded_bus, unique_run):
    """The trainer's bus thread keeps heartbeating ("sent" fresh) while the step loop is stuck: status
    says hung with the age of the last step. A paused run says paused; a fresh one live with its age."""
    from sentinel.protocol import StepRecord

    r = bus.connect(embedded_bus.url)
    k = Keys(unique_run)
    bus.register_run(r, unique_run, {"run_dir": "/nonexistent", "world_size": 2})
    now = time.time()
    for s in range(1, 11):
        bus.publish(r, k.steps, StepRecord(run=unique_run, step=s, loss=2.0, loss_max_rank=2.0, grad_norm=0.5, lr=1e-3,
                                           tokens=s, batch_fingerprint="x", time=now - 120 + s, step_seconds=0.5))

    def row(step_age: float, **hb) -> dict:
        r.set(k.heartbeat, json.dumps({"step": 10, "time": time.time() - step_age, "sent": time.time(), "pid": 1, **hb}))
        (x,) = [x for x in _cli_json("status", "--redis-url", embedded_bus.url)["runs"] if x["run"] == unique_run]
        return x

    hung = row(110)
    assert hung["state"] == "hung" and hung["last_step_age_seconds"] >= 110 and hung["heartbeat_age_seconds"] < 5
    assert row(110, paused=True)["state"] == "paused"
    assert row(1)["state"] == "live"
    # rank 0 itself frozen: no heartbeat key at all, but the sentinel has a hang incident open
    from sentinel.protocol import Incident

    r.delete(k.heartbeat)
    r.hset(k.incidents, "h", Incident(id="h", run=unique_run, state="incident", rule="heartbeat_stale", onset_step=10,
                                      detect_step=10).to_json())
    (frozen,) = [x for x in _cli_json("status", "--redis-url", embedded_bus.url)["runs"] if x["run"] == unique_run]
    assert frozen["state"] == "hung" and frozen["last_step_age_seconds"] > 100
    from sentinel.cli.status_cmd import state_text

    assert state_text(hung).startswith("HUNG: no step") and "live" not in state_text(hung)


# ================================================================== fast, pure checks of the same rules
def _rec(step: int, t: float, **kw):
    from sentinel.protocol import StepRecord

    return StepRecord(run="r", step=step, loss=2.0, loss_max_rank=2.0, grad_norm=0.5, lr=1e-3, tokens=step,
                      batch_fingerprint="x", time=t, **kw)


def test_straggler_rule_uses_busy_time_not_wall_time():
    """Equal wall times on every rank (synchronous DDP), rank 2 busy in data_wait while the others wait
    in the all-reduce: the rule fires naming rank 2 and data_wait. Old records with only
    rank_step_seconds still work; records without either stay silent."""
    from sentinel.rules import RuleEngine, default_rules

    fast = {"data_wait": 0.01, "forward_backward": 0.10, "allreduce_wait": 0.40, "optimizer": 0.02}
    slow = {"data_wait": 0.41, "forward_backward": 0.10, "allreduce_wait": 0.00, "optimizer": 0.02}
    e = RuleEngine(default_rules())
    found = [f for s in range(1, 13) for f in e.evaluate(_rec(s, 1000.0 + s, step_seconds=0.53, world_size=3,
                                                                 rank_phases=[fast, fast, slow]))
             if f.rule == "rank_straggler"]
    assert found and found[0].rank == 2 and found[0].phase == "data_wait" and found[0].step == 10
    assert "rank 2 straggles" in found[0].detail and "data_wait" in found[0].detail
    old = RuleEngine(default_rules())
    legacy = [f for s in range(1, 13) for f in old.evaluate(_rec(s, 1000.0 + s, rank_step_seconds=[0.5, 0.5, 0.9]))]
    assert [f.rank for f in legacy if f.rule == "rank_straggler"][:1] == [2]
    quiet = RuleEngine(default_rules())
    assert not [f for s in range(1, 13) for f in quiet.evaluate(_rec(s, 1000.0 + s, rank_phases=[fast, fast, fast]))
                if f.rule == "rank_straggler"]


def test_step_record_rank_phases_is_backward_compatible():
    from sentinel.protocol import StepRecord

    old = _rec(1, 1.0).model_dump(mode="json", exclude={"rank_phases"})
    assert StepRecord.from_json(json.dumps(old)).rank_phases is None
    new = _rec(1, 1.0, rank_phases=[{"data_wait": 0.1, "forward_backward": 0.2}])
    assert StepRecord.from_json(new.to_json()).rank_phases == [{"data_wait": 0.1, "forward_backward": 0.2}]


def test_hang_opens_its_own_incident_and_closes_when_steps_flow():
    """Policy: a stale heartbeat opens an incident (rule heartbeat_stale) that its page links to,
    beside the anomaly state machine; a record from before the hang (a replayed backlog) does not
    close it, a new step does (state recovered); the open hang survives a state round trip."""
    from sentinel.policy import RunPolicy
    from sentinel.rules import default_rules

    now = [1000.0]
    p = RunPolicy("r", default_rules(), clock=lambda: now[0])
    for s in range(1, 6):
        p.on_step(_rec(s, 1000.0 + s))
    now[0] = 1005.0 + 301
    acts = p.on_tick(now[0], 1005.0)
    (page,) = [a for a in acts if a.kind == "page"]
    (inc,) = [i for i in p.incidents if i.rule == "heartbeat_stale"]
    assert page.incident_id == inc.id and inc.state == "incident" and inc.closed_at is None and p.state == "healthy"
    q = RunPolicy("r", default_rules(), clock=lambda: now[0])
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    q.on_step(_rec(5, 1004.5))  # from before the hang
    assert next(i for i in q.incidents if i.id == inc.id).closed_at is None
    q.on_step(_rec(6, now[0] + 1))
    done = next(i for i in q.incidents if i.id == inc.id)
    assert done.state == "recovered" and done.closed_at is not None
    assert any(e.kind == "incident_closed" and e.incident_id == inc.id for e in q.drain_events())
