"""The on-call commands: status, checkpoints, skip-list, rollback, incidents, approve.

Real runs (the trainer in subprocesses, on CPU) and real Redis/valkey; no mocks. The commands
themselves must stay torch-free: checked in a fresh interpreter.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from sentinel import bus
from sentinel.cli import main
from sentinel.protocol import Ack, CheckpointInfo, Directive, Incident, Keys, StepRecord, TimelineRecord
from tests.helpers.cli import SENTINEL, cli, cli_json, sentinel_proc, step_records
from tests.helpers.trainer import (
    BASE_ARGS,
    REPO,
    assert_one_line_error,
    kill_all,
    records,
    run_trainer,
    trainer_cmd,
    trainer_env,
)


# ------------------------------------------------------------------ architecture
def test_commands_do_not_import_torch(base_run):
    code = f"""
import sys
from click.testing import CliRunner
from sentinel.cli import main
d = {str(base_run)!r}
for args in (["status", d], ["checkpoints", d], ["skip-list", d], ["incidents", d],
             ["rollback", d, "--to-step", "20", "--dry-run"], ["status", d, "--json"]):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, (args, r.output)
bad = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "trainer")))
print("BAD", bad)
"""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "BAD []" in p.stdout, p.stdout


# ------------------------------------------------------------------ status
def test_status_offline_from_run_dir(run_copy):
    out = cli_json("status", str(run_copy))
    (row,) = out["runs"]
    assert row["run"] == "run" and row["source"] == "files" and row["state"] == "finished"  # its max_steps: 30
    assert row["step"] == 30 and isinstance(row["loss"], float) and row["val_ppl"] is not None
    assert row["grad_norm"] > 0 and row["open_incidents"] == 0 and row["checkpoint_age_seconds"] is not None
    human = cli("status", str(run_copy))
    assert human.exit_code == 0 and "run" in human.stdout and "30" in human.stdout


def test_status_offline_counts_mirrored_incidents_and_shows_the_last_rollback(run_copy):
    """With the bus gone, status reads what the daemon mirrored: an open incident in incidents.jsonl
    is counted (it said 0 while `incidents` said "rollback in progress"), and the rollback that the
    later skip directives follow is in the last-action cell, not hidden behind them. A run short of
    its max_steps is not "finished"; the guard-skip count says over how many steps it is."""
    recs = [r for r in step_records(run_copy).values() if r.step > 20]
    with open(run_copy / "steps.jsonl", "a") as f:
        f.write(TimelineRecord(kind="rollback", run="run", from_step=20, timeline=1, time=time.time()).to_json() + "\n")
        for r in recs[:5]:  # steps 21-25 again on the new timeline: short of max_steps 30
            f.write(r.model_copy(update={"timeline": 1}).to_json() + "\n")
    inc = Incident(id="run-t0-s22", run="run", state="rollback", rule="divergence", onset_step=22, detect_step=25,
                   rollback_to=20)
    (run_copy / "incidents.jsonl").write_text(inc.to_json() + "\n")
    (row,) = cli_json("status", str(run_copy))["runs"]
    assert row["open_incidents"] == 1 and row["incidents_total"] == 1 and row["open_incident_ids"] == ["run-t0-s22"]
    assert row["state"] != "finished" and row["step"] == 25, row
    human = CliRunner().invoke(main, ["status", str(run_copy)], env={"COLUMNS": "80"}, catch_exceptions=False)
    assert "1 open / 1" in human.stdout and "rollback to step 20" in human.stdout, human.stdout
    assert f"of last {row['window']}" in human.stdout


def _step(run: str, step: int, loss: float, **kw) -> StepRecord:
    return StepRecord(run=run, step=step, loss=loss, loss_max_rank=loss, grad_norm=0.5, lr=1e-3, tokens=step * 512,
                      batch_fingerprint="x", sample_ids=[step], time=time.time() - 60 + step * 0.1,
                      tokens_per_second=12_345.0, mfu=0.31, **kw)


def test_status_live_on_the_bus(embedded_bus, unique_run):
    r = bus.connect(embedded_bus.url)
    k = Keys(unique_run)
    bus.register_run(r, unique_run, {"run_dir": "/nonexistent/elsewhere", "world_size": 2})
    bus.publish(r, k.steps, TimelineRecord(kind="start", run=unique_run, from_step=0, timeline=0, time=time.time()))
    for s in range(1, 41):
        bus.publish(r, k.steps, _step(unique_run, s, 2.0 + 0.001 * s, skipped=(s == 7), skip_reason="loss_spike" if s == 7 else None,
                                      val_ppl=7.5 if s == 20 else None))
    bus.publish(r, k.steps, _step(unique_run, 41, 3.5))  # > 1.2x the recent median
    r.set(k.heartbeat, json.dumps({"step": 41, "time": time.time(), "sent": time.time(), "pid": 1}), px=30_000)
    r.hset(k.checkpoints, "40", CheckpointInfo(run=unique_run, step=40, path="/x", created=time.time() - 3 * 3600, bytes=10,
                                               manifest_sha256="0", world_size=2).to_json())
    r.hset(k.incidents, "i1", Incident(id=f"{unique_run}-t0-s41", run=unique_run, state="incident", rule="loss_spike",
                                       onset_step=41, detect_step=41).to_json())
    bus.publish(r, k.acks, Ack(run=unique_run, directive_id="d1", kind="skip-samples", status="applied", step=30))

    out = cli_json("status", "--redis-url", embedded_bus.url)
    (row,) = [x for x in out["runs"] if x["run"] == unique_run]
    assert row["state"] == "live" and row["source"] == "bus" and row["step"] == 41
    assert row["loss"] == 3.5 and row["loss_out_of_band"] is True
    assert row["checkpoint_stale"] is True and row["checkpoint_age_seconds"] > 3 * 3600 - 60
    assert row["open_incidents"] == 1 and row["guard_skips"] == 1 and row["val_ppl"] == 7.5
    assert row["tokens_per_second"] == 12_345.0 and row["mfu"] == 0.31
    assert row["last_action"]["kind"] == "skip-samples" and row["last_action"]["status"] == "applied"
    # by run id, and the human view
    assert cli_json("status", unique_run, "--redis-url", embedded_bus.url)["runs"][0]["run"] == unique_run
    human = cli("status", "--redis-url", embedded_bus.url)
    assert human.exit_code == 0 and "1 open" in human.stdout and unique_run in human.stdout


def test_status_watch_exits_cleanly_on_ctrl_c(run_copy):
    env = trainer_env()
    p = subprocess.Popen([*SENTINEL, "status", str(run_copy), "--watch", "--interval", "0.3"], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2.5)
    p.send_signal(signal.SIGINT)
    try:
        out, err = p.communicate(timeout=20)
    finally:
        p.kill()
    assert p.returncode == 0, err
    assert "Traceback" not in err and "step" in out


# ------------------------------------------------------------------ checkpoints
def test_checkpoints_verification_states(run_copy):
    ck = run_copy / "checkpoints"
    model = ck / "step-00000020" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    (ck / "step-00000010" / "manifest.json").unlink()
    (ck / "verified.json").write_text(json.dumps({"30": {"verified": "resume_verified", "time": time.time()}}))

    out = cli_json("checkpoints", str(run_copy))
    st = {c["step"]: c["verified"] for c in out["checkpoints"]}
    assert st == {30: "resume_verified", 20: "corrupt", 10: "incomplete", 0: "checksum_ok"}  # 0: the initial state
    by = {c["step"]: c for c in out["checkpoints"]}
    assert "checksum" in by[20]["problem"] and by[30]["bytes"] > 0 and by[30]["age_seconds"] >= 0
    human = cli("checkpoints", str(run_copy))
    assert "corrupt" in human.stdout and "resume_verified" in human.stdout and "incomplete" in human.stdout
    # a corrupt checkpoint is never a rollback target
    bad = cli("rollback", str(run_copy), "--to-step", "20", "--yes")
    assert bad.exit_code == 2 and "corrupt" in bad.stderr
    assert not (run_copy / "pending_rollback.json").exists()
    # --before-step passes over the bad ones (20 corrupt, 10 incomplete): back to the initial state
    assert cli_json("rollback", str(run_copy), "--before-step", "22", "--dry-run")["plan"]["target"]["step"] == 0
    plan = cli_json("rollback", str(run_copy), "--before-step", "32", "--dry-run")["plan"]
    assert plan["target"]["step"] == 30 and plan["target"]["verified"] == "resume_verified"


# ------------------------------------------------------------------ skip list
def test_skip_list_show_add_remove_offline(run_copy):
    d = str(run_copy)
    assert cli_json("skip-list", d)["ranges"] == []
    out = cli_json("skip-list", d, "add", "100:200", "300:310", "--reason", "bad shard")
    assert out["mode"] == "offline" and out["samples"] == 110 and out["ranges"] == [[100, 200], [300, 310]]
    assert json.loads((run_copy / "skiplist.json").read_text()) == [[100, 200], [300, 310]]
    out = cli_json("skip-list", d, "remove", "150:160")
    assert out["ranges"] == [[100, 150], [160, 200], [300, 310]] and out["samples"] == 100
    shown = cli_json("skip-list", d, "show")
    assert shown["samples"] == 100 and shown["source"] == "file"
    audit = [json.loads(x) for x in (run_copy / "audit.jsonl").read_text().splitlines()]
    assert [a["action"] for a in audit] == ["skip-samples", "skip-remove"] and all(a["who"].startswith("cli:") for a in audit)
    assert audit[0]["reason"] == "bad shard"
    human = cli("skip-list", d)
    assert human.exit_code == 0 and "300" in human.stdout and "100" in human.stdout
    # errors: nothing to remove, a malformed range, no range
    assert "none of" in cli("skip-list", d, "remove", "5000:5001").stderr
    assert "bad sample range" in cli("skip-list", d, "add", "9:3").stderr
    assert cli("skip-list", d, "add").exit_code == 2


@pytest.mark.slow
def test_a_removal_sticks_through_the_checkpoint_that_saved_the_range(run_copy, dataset):
    """`skip-list remove` on a stopped run: the checkpoint the trainer resumes from saved the range,
    and used to add it back at the start (the command said so, and exited 0). Now the trainer
    subtracts it at its next start and forgets the removal once a checkpoint without it is saved;
    an add after a remove wins."""
    from sentinel.protocol import SKIP_REMOVED

    d = str(run_copy)
    # samples the run trains between steps 30 and 40 (ids are drawn in order: tiny, 1 rank)
    cli_json("skip-list", d, "add", "100000:100010", "200000:200010")
    run_trainer(run_copy, "--max-steps", "40", data_dir=dataset, check=True)  # checkpoint 40 saves both ranges
    out = cli_json("skip-list", d, "remove", "100000:100010", "200000:200010")
    assert out["ranges"] == [] and out["still_skipped_by"] == []
    assert json.loads((run_copy / SKIP_REMOVED).read_text()) == [[100000, 100010], [200000, 200010]]
    cli_json("skip-list", d, "add", "200000:200010")  # put back: the removal of this one is forgotten
    assert json.loads((run_copy / SKIP_REMOVED).read_text()) == [[100000, 100010]]
    p = run_trainer(run_copy, "--max-steps", "50", data_dir=dataset, check=True)  # resumes from checkpoint 40
    assert "are trained on again" in p.stdout + p.stderr
    assert json.loads((run_copy / "skiplist.json").read_text()) == [[200000, 200010]]
    assert not (run_copy / SKIP_REMOVED).exists(), "checkpoint 50 holds the list without it: the removal sticks"
    ts = json.loads((run_copy / "checkpoints" / "step-00000050" / "train_state.json").read_text())
    assert ts["skiplist"] == [[200000, 200010]]
    # a malformed removal file stops the start in one line, as a malformed plan does
    # and logs nothing: no `resume` record for a start that did not happen
    (run_copy / SKIP_REMOVED).write_text('[["a", 1]]')
    log_before = (run_copy / "steps.jsonl").read_bytes()
    p = run_trainer(run_copy, "--max-steps", "55", data_dir=dataset)
    assert p.returncode != 0 and f"{SKIP_REMOVED} is malformed" in p.stdout + p.stderr and "Traceback" not in p.stderr
    assert (run_copy / "steps.jsonl").read_bytes() == log_before


def test_skip_list_says_why_each_range_is_there(run_copy):
    """"Why is sample 684 skipped?": each range names where it came from. A rollback (its timeline
    record in steps.jsonl, and the incident from the directive log), a skip-samples directive (the
    trainer logs its ranges), the config's --skip, an operator's offline add; a range nobody
    explains says so ("-"). The table and --json carry the same."""
    from sentinel.protocol import TimelineRecord

    d = run_copy
    with open(d / "steps.jsonl", "a") as f:
        f.write(TimelineRecord(kind="rollback", run="run", from_step=20, timeline=1, time=time.time(), directive_id="d-rb",
                               reason="divergence", skip_ranges=[(684, 685), (700, 702)]).to_json() + "\n")
    with open(d / "directives.jsonl", "a") as f:
        f.write(json.dumps({"id": "d-rb", "kind": "rollback", "status": "applied", "step": 20, "incident_id": "run-t0-s25"}) + "\n")
        f.write(json.dumps({"id": "d-sk", "kind": "skip-samples", "status": "applied", "step": 21, "incident_id": "run-t0-s25",
                            "reason": "samples of step 27", "ranges": [[1799, 1800]]}) + "\n")
        f.write(json.dumps({"id": "d-no", "kind": "skip-samples", "status": "rejected", "step": 21, "ranges": [[5, 6]]}) + "\n")
    assert cli_json("skip-list", str(d), "add", "9000:9010", "--reason", "bad shard")["mode"] == "offline"
    (d / "skiplist.json").write_text(json.dumps([[5, 6], [684, 685], [700, 702], [1799, 1800], [9000, 9010]]))
    out = cli_json("skip-list", str(d))
    sources = [o and (o["source"], o["step"], o["incident_id"]) for o in out["origins"]]
    assert sources == [None, ("rollback", 20, "run-t0-s25"), ("rollback", 20, "run-t0-s25"),
                       ("skip-samples", 21, "run-t0-s25"), ("operator", None, None)], sources
    assert out["origins"][4]["reason"] == "bad shard" and out["origins"][4]["who"].startswith("cli:")
    human = CliRunner().invoke(main, ["skip-list", str(d)], env={"COLUMNS": "160"}, catch_exceptions=False).stdout
    # grouped by incident: its rollback and its skip-samples directive are one row
    assert "incident run-t0-s25: rollback to step 20; skip-samples, applied at step 21" in " ".join(human.split())
    assert "added by cli:" in human
    groups = [(g["why"].split(":")[0], len(g["ranges"])) for g in out["groups"]]
    assert groups == [("-", 1), ("incident run-t0-s25", 3), ("added by cli", 1)], groups


def test_skip_list_live_run_only_grows(embedded_bus):
    run_dir = embedded_bus.run_dir  # run id: the dir's name
    r = bus.connect(embedded_bus.url)
    r.set(Keys("run").heartbeat, json.dumps({"step": 5, "time": time.time(), "sent": time.time(), "pid": 1}), px=30_000)
    res = cli("skip-list", str(run_dir), "remove", "1:2")
    assert res.exit_code == 2 and "only grows" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    # add: a signed directive to the (absent) trainer; nobody acks it -> a clear timeout, exit 1
    res = cli("skip-list", str(run_dir), "add", "7:9", "--timeout", "1")
    assert res.exit_code == 1 and "no ack" in res.stderr
    (entry,) = r.xrange(Keys("run").directives)
    d = Directive.from_json(entry[1]["json"])
    assert d.kind == "skip-samples" and d.ranges == [(7, 9)] and d.verify(bus.load_secret(run_dir)) is None
    assert d.expires_at is not None and d.expires_at < time.time() + 30


# ------------------------------------------------------------------ rollback, offline
def test_rollback_offline_then_trainer_start_resumes_with_skips(run_copy, dataset):
    before = step_records(run_copy)
    skip_ids = sorted(sorted(before[11].sample_ids)[:3] + sorted(before[12].sample_ids)[:2])
    args = [a for i in skip_ids for a in ("--skip", f"{i}:{i + 1}")]
    p = sentinel_proc("rollback", str(run_copy), "--to-step", "10", *args, "--yes", "--reason", "drill", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["status"] == "prepared" and out["plan"]["mode"] == "offline"
    assert out["plan"]["steps_lost"] == 20 and out["plan"]["skip_samples"] == 5
    assert out["plan"]["skip_samples_seen_in_lost_steps"] >= 5
    pending = json.loads((run_copy / "pending_rollback.json").read_text())
    assert pending["to_step"] == 10 and pending["id"] == out["directive_id"] and pending["reason"] == "drill"
    assert sorted(tuple(r) for r in pending["ranges"]) == [(i, i + 1) for i in skip_ids]
    skl = json.loads((run_copy / "skiplist.json").read_text())
    assert all(any(lo <= i < hi for lo, hi in skl) for i in skip_ids)
    audit = [json.loads(x) for x in (run_copy / "audit.jsonl").read_text().splitlines()]
    assert audit[-1]["action"] == "rollback" and audit[-1]["mode"] == "offline" and audit[-1]["reason"] == "drill"
    # the status and checkpoints views show it
    assert cli_json("status", str(run_copy))["runs"][0]["pending_rollback"]["to_step"] == 10
    inc = cli_json("incidents", str(run_copy))["runs"][0]
    assert inc["source"] == "files" and inc["audit"][-1]["to_step"] == 10

    run_trainer(run_copy, data_dir=dataset, check=True)  # the saved config; nothing else
    recs = records(run_copy)
    marks = [i for i, r in enumerate(recs) if isinstance(r, TimelineRecord)]
    last = recs[marks[-1]]
    assert last.kind == "rollback" and last.from_step == 10 and last.directive_id == out["directive_id"]
    assert sorted(tuple(r) for r in last.skip_ranges) == [(i, i + 1) for i in skip_ids]
    after = [r for r in recs[marks[-1] + 1:] if isinstance(r, StepRecord)]
    assert [r.step for r in after] == list(range(11, 31))
    trained = {i for r in after for i in r.sample_ids}
    assert not trained & set(skip_ids)
    assert not (run_copy / "pending_rollback.json").exists()


# ------------------------------------------------------------------ rollback, live 2-rank run
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rollback_live_two_rank_run(tmp_path, dataset):
    from sentinel.embedded import stop_embedded

    run_dir = tmp_path / "live"
    log = open(tmp_path / "trainer.log", "w")
    proc = subprocess.Popen(
        trainer_cmd(run_dir, *BASE_ARGS[:2], "--telemetry", "on", "--redis-url", "embedded", "--data", str(dataset),
                    "--max-steps", "5000", "--ckpt-every", "10", "--keep-last", "1000", "--eval-every", "0", nproc=2),
        env=trainer_env(dataset), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        target = run_dir / "checkpoints" / "step-00000020" / "manifest.json"
        while not (target.is_file() and (run_dir / "bus" / "url").is_file() and len(step_records(run_dir)) >= 24):
            assert proc.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            assert time.time() < deadline, "the trainer never reached step 24"
            time.sleep(0.2)
        r = bus.connect(bus.resolve_url(run_dir))
        while r.get(Keys("live").heartbeat) is None:
            assert time.time() < deadline
            time.sleep(0.1)
        old = step_records(run_dir)
        skip_ids = sorted(set(old[21].sample_ids) | set(old[22].sample_ids))
        args = [a for i in skip_ids for a in ("--skip", f"{i}:{i + 1}")]
        p = sentinel_proc("rollback", str(run_dir), "--to-step", "20", *args, "--yes", "--reason", "live drill",
                          "--timeout", "60", "--json")
        assert p.returncode == 0, p.stderr + p.stdout
        out = json.loads(p.stdout)
        assert out["plan"]["mode"] == "live" and out["status"] == "applied"
        assert out["resumed_step"] == 20 and out["timeline"] >= 1
        # let it train past the rolled-back steps, then stop it cleanly with a signed directive
        while True:
            recs = records(run_dir)
            idx = max(i for i, x in enumerate(recs) if isinstance(x, TimelineRecord))
            if sum(1 for x in recs[idx + 1:] if isinstance(x, StepRecord)) >= 10:
                break
            assert proc.poll() is None and time.time() < deadline + 60
            time.sleep(0.2)
        stop = Directive(run="live", kind="stop", issuer="test").signed(bus.load_secret(run_dir))
        bus.publish(r, Keys("live").directives, stop)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            kill_all(proc)
        log.close()
        stop_embedded(run_dir)
    recs = records(run_dir)
    rb = [(i, x) for i, x in enumerate(recs) if isinstance(x, TimelineRecord) and x.kind == "rollback"]
    assert len(rb) == 1, rb
    i, mark = rb[0]
    assert mark.from_step == 20 and mark.directive_id == out["directive_id"] and mark.timeline == out["timeline"]
    assert sorted(tuple(x) for x in mark.skip_ranges) == [(j, j + 1) for j in skip_ids]
    after = [x for x in recs[i + 1:] if isinstance(x, StepRecord)]
    assert after[0].step == 21 and after[0].timeline == out["timeline"]
    assert not {j for x in after for j in x.sample_ids} & set(skip_ids)
    assert after[0].sample_ids != old[21].sample_ids
    applied = [json.loads(x) for x in (run_dir / "directives.jsonl").read_text().splitlines()]
    assert any(a["id"] == out["directive_id"] and a["status"] == "applied" and a["issuer"].startswith("cli:") for a in applied)
    # the trainer logs what the directive put on the skip list: skip-list show names the rollback for each
    assert [sorted(map(tuple, a["ranges"])) for a in applied if a["id"] == out["directive_id"]] == [[(j, j + 1) for j in skip_ids]]
    assert {o["source"] for o in cli_json("skip-list", str(run_dir))["origins"]} == {"rollback"}
    audit = [json.loads(x) for x in (run_dir / "audit.jsonl").read_text().splitlines()]
    assert [a.get("phase") for a in audit] == ["issued", "outcome"] and audit[-1]["outcome"] == "applied"
    assert audit[0]["reason"] == "live drill" and audit[0]["who"].startswith("cli:")


def test_rollback_live_audit_records_on_the_bus(embedded_bus):
    """The incident record and manual_rollback events of a live rollback (the trainer answered by hand)."""
    import threading

    run_dir = embedded_bus.run_dir
    ck = run_dir / "checkpoints" / "step-00000010"
    ck.mkdir(parents=True)
    from sentinel.protocol import checkpoint_required_files
    from sentinel.rundir import sha256_file

    for name in checkpoint_required_files(world_size=1, sharded=False):  # every file a resumable step needs
        (ck / name).write_text(json.dumps({"step": 10}) if name == "train_state.json" else "weights")
    files = {f.name: sha256_file(f) for f in ck.iterdir()}
    (ck / "manifest.json").write_text(json.dumps({"format": 1, "step": 10, "files": files,
                                                 "bytes": sum(f.stat().st_size for f in ck.iterdir()),
                                                 "world_size": 1, "created": time.time()}))
    r = bus.connect(embedded_bus.url)
    k = Keys("run")
    r.set(k.heartbeat, json.dumps({"step": 15, "time": time.time(), "sent": time.time(), "pid": 1}), px=30_000)
    secret = bus.load_secret(run_dir)

    def fake_trainer():  # verify and ack like the trainer's bus client + _apply
        deadline = time.time() + 20
        while time.time() < deadline:
            for _, fields in r.xrange(k.directives):
                d = Directive.from_json(fields["json"])
                if d.verify(secret) is None:
                    bus.publish(r, k.acks, Ack(run="run", directive_id=d.id, kind=d.kind, status="applied", step=d.to_step,
                                               timeline=3, detail=f"resumed at step {d.to_step}, timeline 3"), secret=secret)
                    return
            time.sleep(0.05)

    t = threading.Thread(target=fake_trainer, daemon=True)
    t.start()
    res = cli("rollback", str(run_dir), "--checkpoint", "step-00000010", "--skip", "5:9", "--yes", "--reason", "why not")
    t.join(5)
    assert res.exit_code == 0, res.stderr
    assert "resumed at step 10, timeline 3" in res.stdout
    evs = [json.loads(f["json"]) for _, f in r.xrange(k.events)]
    manual = [e for e in evs if e["kind"] == "manual_rollback"]
    assert [e["data"]["phase"] for e in manual] == ["issued", "applied"]
    assert manual[0]["data"]["issuer"].startswith("cli:") and manual[0]["data"]["reason"] == "why not"
    (inc,) = [Incident.from_json(v) for v in r.hgetall(k.incidents).values()]
    assert inc.rule == "manual" and inc.rollback_to == 10 and inc.closed_at is not None
    assert inc.actions[0]["outcome"] == "applied" and inc.skip_ranges == [(5, 9)]
    shown = cli_json("incidents", str(run_dir))["runs"][0]["incidents"]
    assert shown[0]["id"] == inc.id and [e["kind"] for e in shown[0]["timeline"]] == ["manual_rollback", "manual_rollback"]


# ------------------------------------------------------------------ approve
def test_approve_writes_a_verifiable_approval(embedded_bus):
    run_dir = embedded_bus.run_dir
    r = bus.connect(embedded_bus.url)
    bus.register_run(r, "run", {"run_dir": str(run_dir)})
    k = Keys("run")
    waiting = Incident(id="run-t0-s101", run="run", state="awaiting_approval", rule="loss_spike", onset_step=101,
                       detect_step=104, evidence=[{"step": 101, "loss": 9.0, "detail": "spike"}])
    healthy = Incident(id="run-t0-s50", run="run", state="healthy", rule="loss_spike", onset_step=50, detect_step=52,
                       closed_at=time.time())
    r.hset(k.incidents, mapping={waiting.id: waiting.to_json(), healthy.id: healthy.to_json()})

    out = cli_json("approve", waiting.id, "--run", str(run_dir))
    assert out["run"] == "run" and out["incident_id"] == waiting.id
    (entry,) = r.xrange(k.approvals)
    d = Directive.from_json(entry[1]["json"])
    assert d.kind == "resume" and d.incident_id == waiting.id and d.run == "run" and d.issuer.startswith("cli:")
    assert d.verify(bus.load_secret(run_dir)) is None
    # found without --run (searching every run on the bus); secret from the run dir in the run's info
    out = cli_json("approve", waiting.id, "--redis-url", embedded_bus.url)
    assert out["run"] == "run" and r.xlen(k.approvals) == 2
    # nothing to approve / unknown incident: one line, no approval written
    res = cli("approve", healthy.id, "--run", str(run_dir))
    assert res.exit_code == 2 and "nothing to approve" in res.stderr
    res = cli("approve", "run-t9-s9", "--redis-url", embedded_bus.url)
    assert res.exit_code == 2 and "not found" in res.stderr
    assert r.xlen(k.approvals) == 2
    # the incidents view shows the evidence
    human = cli("incidents", str(run_dir))
    assert waiting.id in human.stdout and "spike" in human.stdout and "awaiting_approval" in human.stdout


# ------------------------------------------------------------------ bad input: one line, no traceback
def test_bad_input_is_one_line_everywhere(run_copy, redis_server, tmp_path):
    d = str(run_copy)
    shutil.rmtree(run_copy / "checkpoints" / "step-00000000")  # the initial state: before 10, nothing is left
    missing = str(tmp_path / "no-such-run")
    dead = "redis://127.0.0.1:1"
    cases = [
        # a missing run directory
        (("status", missing), "not found"),
        (("checkpoints", missing), "not found"),
        (("skip-list", missing), "not found"),
        (("incidents", missing), "not found"),
        (("rollback", missing, "--to-step", "10", "--yes"), "not found"),
        (("approve", "x-t0-s1", "--run", missing), "not found"),
        # a run id the bus does not know
        (("status", "nosuchrun", "--redis-url", redis_server.url), "not known"),
        (("checkpoints", "nosuchrun", "--redis-url", redis_server.url), "not known"),
        (("rollback", "nosuchrun", "--to-step", "1", "--redis-url", redis_server.url), "not known"),
        # a missing step / checkpoint / incident
        (("rollback", d, "--to-step", "15", "--yes"), "no checkpoint at step 15"),
        (("rollback", d, "--checkpoint", "step-00000990", "--yes"), "no checkpoint at step 990"),
        (("rollback", d, "--before-step", "5", "--yes"), "no usable checkpoint"),  # step 0 removed above
        (("approve", "nope", "--redis-url", redis_server.url), "not found"),
        # Redis unreachable
        (("status", "--redis-url", dead), "cannot reach Redis"),
        (("skip-list", d, "--redis-url", dead), "cannot reach Redis"),
        (("incidents", "--redis-url", dead), "cannot reach Redis"),
        (("rollback", d, "--to-step", "10", "--yes", "--redis-url", dead), "cannot reach Redis"),
        (("approve", "x-t0-s1", "--redis-url", dead), "cannot reach Redis"),
    ]
    for i, (args, want) in enumerate(cases):
        if i % 5 == 0:  # end to end through the console script for some
            assert_one_line_error(sentinel_proc(*args, timeout=60), contains=want)
            continue
        res = cli(*args)
        assert "Traceback" not in res.output, (args, res.output)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], (args, res.stderr)
    assert not (run_copy / "pending_rollback.json").exists()
    # the views of a run directory go on from its files when even an explicit bus is down (with a note);
    # an onset far past the log is a typo
    for view in ("status", "checkpoints", "pages", "incidents"):
        res = cli(view, d, "--redis-url", dead)
        assert res.exit_code == 0 and "cannot reach Redis" in res.output + res.stderr, (view, res.output, res.stderr)
    res = cli("rollback", d, "--before-step", "99999999999999999999", "--dry-run")
    assert res.exit_code == 2 and "past the run's last step" in res.stderr


# ------------------------------------------------------------------ range syntax and rules files (issue 10 item 9)
def test_sample_ranges_are_half_open_everywhere():
    """--inject-fault, --skip, skip-list and rollback --skip all read LO:HI as [LO, HI)."""
    import warnings

    from sentinel.rundir import parse_range
    from trainer.config import ConfigError, Fault

    lo, hi = parse_range("5:8")
    for spec in ("garbage@5:8", "nan@5:8", "lr@5:8:100"):
        f = Fault.parse(spec)
        assert (f.lo, f.hi) == (lo, hi) == (5, 8), spec
        assert [i for i in range(20) if f.hits([i])] == [5, 6, 7]
    assert (Fault.parse("garbage@5").lo, Fault.parse("garbage@5").hi) == parse_range("5") == (5, 6)
    lr = Fault.parse("lr@151:100")  # the documented id + factor form keeps its meaning
    assert (lr.lo, lr.hi, lr.factor) == (151, 152, 100.0)
    with warnings.catch_warnings(record=True) as w:  # the old inclusive form: same ids, and it says so
        warnings.simplefilter("always")
        old = Fault.parse("garbage@5-7")
    assert (old.lo, old.hi) == (5, 8)
    assert any(issubclass(x.category, FutureWarning) and "garbage@5:8" in str(x.message) for x in w)
    for bad in ("garbage@8:8", "garbage@9:8", "garbage@5:8:2", "lr@x"):
        with pytest.raises(ConfigError):
            Fault.parse(bad)
    with pytest.raises(ValueError, match="for ids 5..7 inclusive write 5:8"):  # skip-list / --skip never took LO-HI
        parse_range("5-7")
    readme = (REPO / "README.md").read_text()
    assert "half-open" in readme and "LO:HI" in readme


def test_trainer_help_documents_the_range_convention():
    p = subprocess.run([sys.executable, "-m", "trainer", "--help"], cwd=REPO, env=trainer_env(), capture_output=True,
                       text=True, timeout=120)
    help_text = " ".join(p.stdout.split())
    assert p.returncode == 0 and "KIND@LO[:HI]" in help_text and "HI exclusive" in help_text


def test_rules_check_refuses_an_empty_file(tmp_path):
    for name, text in (("empty.yaml", ""), ("blank.yaml", "\n\n"), ("comments.yaml", "# nothing yet\n"), ("map.yaml", "{}\n")):
        f = tmp_path / name
        f.write_text(text)
        for args in (("rules", "check", str(f)), ("run", "--rules", str(f), str(tmp_path)),
                     ("backtest", "--rules", str(f), str(f))):
            res = cli(*args)  # the daemon and the backtest refuse it too: never silently the defaults
            lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
            assert res.exit_code == 2 and len(lines) == 1 and "rules file is empty" in lines[0], (name, args, res.output)
    good = cli("rules", "check", str(REPO / "sentinel" / "default_rules.yaml"))
    assert good.exit_code == 0


def test_rollback_before_onset_never_picks_a_checkpoint_that_holds_the_damage(run_copy):
    """Issue 10 item 6. Checkpoints at 10, 20, 30. A bad batch at onset 21 damages update 21; a bad
    update at 20 (an LR spike) first shows in the loss of step 21: checkpoint 20 holds that damage.
    So --before-step 21 must pick 10, and --before-step 22 (checkpoint 20 gave a normal step 21) 20."""
    assert cli_json("rollback", str(run_copy), "--before-step", "21", "--dry-run")["plan"]["target"]["step"] == 10
    assert cli_json("rollback", str(run_copy), "--before-step", "20", "--dry-run")["plan"]["target"]["step"] == 10
    assert cli_json("rollback", str(run_copy), "--before-step", "22", "--dry-run")["plan"]["target"]["step"] == 20
    help_text = " ".join(cli("rollback", "--help").stdout.split())
    assert "ONSET-2" in help_text and "after N updates" in help_text
    # before the first periodic save only the initial state (step 0) holds no damage
    assert cli_json("rollback", str(run_copy), "--before-step", "11", "--dry-run")["plan"]["target"]["step"] == 0
    shutil.rmtree(run_copy / "checkpoints" / "step-00000000")
    res = cli("rollback", str(run_copy), "--before-step", "11", "--dry-run")
    assert res.exit_code == 2 and "no usable checkpoint at or before step 9" in res.stderr


# ------------------------------------------------------------------ incident actions: only what was sent (issue 10 item 6)
def _action(run: str, inc: str, kind: str, n: int, t: float, **kw) -> dict:
    return {"kind": kind, "run": run, "incident_id": inc, "reason": f"{kind} because", "ranges": [], "to_step": None,
            "idempotency_key": f"{run}:{inc}:{kind}:{n}", "time": t, "dry_run": False, **kw}


def narrow(*args: str):
    """The command as a person sees it in an 80-column terminal."""
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, list(args), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    too_wide = [ln for ln in res.stdout.splitlines() if len(ln) > 80]
    assert not too_wide, too_wide
    return res.stdout


def test_incident_actions_show_only_what_was_sent_with_outcomes(embedded_bus):
    run_dir = embedded_bus.run_dir
    r = bus.connect(embedded_bus.url)
    bus.register_run(r, "run", {"run_dir": str(run_dir)})
    k = Keys("run")
    now = time.time()
    iid = "run-t0-s151"
    acts = [
        _action("run", iid, "rollback", 1, now - 30, to_step=140, ranges=[[10, 20]]),  # sent, acked
        _action("run", iid, "rollback", 2, now - 20, to_step=130),  # decided, never sent (rate limit)
        _action("run", iid, "skip-samples", 1, now - 900, ranges=[[5, 6]]),  # sent, nobody answered: timed out
        _action("run", iid, "pause", 1, now - 10),  # sent, rejected
        _action("run", iid, "page", 1, now - 5),  # paged
    ]
    inc = Incident(id=iid, run="run", state="verifying", rule="loss_spike", onset_step=151, detect_step=154,
                   opened_at=now - 40, actions=acts)
    dry = Incident(id="run-t0-s300", run="run", state="healthy", rule="loss_spike", onset_step=300, detect_step=302,
                   opened_at=now - 3, closed_at=now - 2,
                   actions=[_action("run", "run-t0-s300", "rollback", 1, now - 2, to_step=290, dry_run=True)])
    r.hset(k.incidents, mapping={inc.id: inc.to_json(), dry.id: dry.to_json()})
    r.hset(k.applied, mapping={f"run:{iid}:rollback:1": "d-roll", f"run:{iid}:skip-samples:1": "d-skip",
                               f"run:{iid}:pause:1": "d-pause", f"run:{iid}:page:1": "page"})
    bus.publish(r, k.acks, Ack(run="run", directive_id="d-roll", kind="rollback", status="applied", step=140, timeline=1))
    bus.publish(r, k.acks, Ack(run="run", directive_id="d-pause", kind="pause", status="rejected", step=150,
                               detail="expired"))

    out = cli_json("incidents", str(run_dir))
    (run,) = out["runs"]
    got = {(a["kind"], a.get("to_step")): (a["sent"], a["outcome"]) for a in run["incidents"][0]["actions"]}
    assert got == {("rollback", 140): (True, "acked"), ("rollback", 130): (False, "not sent"),
                   ("skip-samples", None): (True, "timed out"), ("pause", None): (True, "rejected"),
                   ("page", None): (True, "paged")}
    assert run["incidents"][1]["actions"][0]["outcome"] == "would send (dry run)"
    assert run["incidents"][1]["actions"][0]["sent"] is False

    text = narrow("incidents", str(run_dir))
    assert "rollback to 140" in text and "acked" in text and "timed out" in text and "rejected" in text
    assert "rollback to 130" not in text  # never sent: not in the action table
    assert "1 more decided but not sent" in " ".join(text.split())
    assert "would-be actions (dry run: nothing was sent)" in text and "would send (dry run)" in text
    assert iid in text and "onset step 151" in text  # the heading is not cut at 80 columns

    # the bus goes away: the run dir's mirror still tells the story (last line per id wins)
    stale = inc.model_copy(update={"state": "rollback"})
    with open(run_dir / "incidents.jsonl", "w") as f:
        f.write(stale.to_json() + "\n" + inc.to_json() + "\n" + "{torn\n")
    (run_dir / "directives.jsonl").write_text(json.dumps({"id": "d-roll", "kind": "rollback", "status": "applied",
                                                          "step": 140, "incident_id": iid, "time": now - 29}) + "\n")
    from sentinel.embedded import stop_embedded

    stop_embedded(run_dir)
    off = cli_json("incidents", str(run_dir))
    (run,) = off["runs"]
    assert run["source"] == "files" and [i["id"] for i in run["incidents"]] == [iid]
    assert run["incidents"][0]["state"] == "verifying"
    first = run["incidents"][0]["actions"][0]
    assert (first["sent"], first["outcome"]) == (True, "acked")
    text = narrow("incidents", str(run_dir))
    assert iid in text and "rollback to 140" in text and "acked" in text


# ------------------------------------------------------------------ 80 columns (issue 10 item 8)
def test_views_are_readable_at_80_columns(run_copy):
    d = str(run_copy)
    model = run_copy / "checkpoints" / "step-00000020" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model.write_bytes(bytes(data))
    assert cli("skip-list", d, "add", "1000:1010").exit_code == 0

    status = narrow("status", d)
    assert "…" not in status  # nothing truncated: one card per run instead of a 12-column row
    for want in ("run", "step", "30", "loss", "val PPL", "grad norm", "ckpt age", "incidents", "guard skips"):
        assert want in status, (want, status)
    ckpts = narrow("checkpoints", d)
    assert "…" not in ckpts and "corrupt" in ckpts and "checksum" in " ".join(ckpts.split())
    for s in ("10", "20", "30"):
        assert s in ckpts
    skips = narrow("skip-list", d)
    assert "…" not in skips and "1000:1010" in skips and "10" in skips
    wide = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["status", d]).stdout
    assert "tokens/s" in wide and wide.count("\n") < status.count("\n")  # the one-row table when there is room


@pytest.mark.parametrize("args", [
    ["backtest", "--checkpoint-every", "-1", "x.jsonl"],
    ["status", "--interval", "abc"],
    ["nosuch"],
    ["backtest"],
    ["backtest", "--bogus", "x.jsonl"],
    ["pages", "--limit", "-1"],  # 0 shows all (as incidents --limit)
    ["rollback", "runs/x", "--to-step", "ten"],
    # a NaN, infinite or absurd wait once made a directive that never expired (and a wait that never ended)
    ["pause", "r", "--timeout", "nan"],
    ["stop", "r", "--timeout", "1e300"],
    ["resume", "r", "--timeout", "inf"],
    ["rollback", "runs/x", "--to-step", "1", "--timeout", "nan"],
    ["skip-list", "runs/x", "add", "1:2", "--timeout", "inf"],
    ["status", "--watch", "--interval", "nan"],
    ["approve", "x-t0-s1", "--wait", "inf"],
    ["demo", "--factor", "nan"],
    # a reason that cannot be serialised (undecodable argv bytes) once broke every restart of the run;
    # one with escape sequences was echoed raw to the next operator's terminal
    ["pause", "r", "--reason", "\udcff\udcfe"],
    ["rollback", "runs/x", "--to-step", "1", "--reason", "a\x1b]0;pwn\x07b"],
    ["skip-list", "runs/x", "add", "1:2", "--reason", "x" * 5000],
    ["run", "--lease-ms", "0"],
    ["run", "--metrics-port", "70000"],
    # the consumer name goes into the log, the lease and the directives' issuer: it was printed raw
    ["run", "--consumer", "a\x1b[2Jb"],
    ["run", "--consumer", "a\nb"],
    ["run", "--consumer", "x" * 5000],
])
def test_a_bad_flag_is_one_line_too(args):
    """Click's usage errors (a bad value, an unknown option or command, a missing argument) are one
    `error:` line naming where to look, like every other error; not usage + hint + error."""
    from sentinel.cli import main as cli

    r = CliRunner().invoke(cli, args)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "--help`)" in lines[0], r.output
    assert "Traceback" not in r.output and "Usage:" not in r.output


def test_bad_urls_and_ids_are_one_line_not_a_traceback(tmp_path, monkeypatch):
    """A malformed bus URL (any command, and `sentinel run`), a bus that is down for `sentinel run`,
    an Alertmanager URL that is not http(s), and checkpoint ids of thousands of digits (Python
    refuses to parse 4300+): each one line, exit 2."""
    from sentinel.cli import main as cli

    monkeypatch.setenv("SENTINEL_SECRET", "x" * 32)
    huge = "9" * 5000
    cases = [
        (["status", "--redis-url", "redis://[::1"], "invalid bus URL redis://[::1"),
        (["status", "--redis-url", "redis://:hunter2@[::1"], "invalid bus URL"),
        (["pause", "r", "--redis-url", "redis://127.0.0.1:99999"], "Port out of range"),
        (["run", "--redis-url", "redis://[::1"], "invalid bus URL"),
        (["run", "--redis-url", "redis://127.0.0.1:1"], "cannot reach Redis"),
        (["run", "--redis-url", "redis://127.0.0.1:1", "--alertmanager-url", "ftp://x"], "--alertmanager-url 'ftp://x'"),
        (["replay-batch", str(tmp_path), "--step", "3", "--checkpoint", huge], "--checkpoint '9999"),
        (["verify-resume", str(tmp_path), "--from-step", huge], "--from-step '9999"),
    ]
    for args, want in cases:
        r = CliRunner().invoke(cli, args)
        lines = [ln for ln in r.output.splitlines() if ln.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and want in lines[0], (args, r.output[-500:])
        assert "hunter2" not in r.output and len(lines[0]) < 300
    from sentinel.cli.common import SentinelError
    from sentinel.cli.rollback_cmd import _parse_checkpoint_id
    for bad in (f"step-{huge}", huge, "x" * 100_000):
        with pytest.raises(SentinelError, match="bad checkpoint id") as e:
            _parse_checkpoint_id(bad)
        assert len(str(e.value)) < 200
    assert _parse_checkpoint_id("step-00000020") == 20 and _parse_checkpoint_id("30") == 30


def test_a_directive_that_would_never_expire_is_refused():
    """A signed directive whose expiry is NaN (compares false with the clock: never expired),
    infinite, or days after its issue is refused by every reader (the trainer obeyed such
    directives at its next start, 20 minutes later), before its expiry is compared."""
    import time as _time

    from sentinel.protocol import Directive

    key, now = b"k" * 32, _time.time()
    ok = Directive(run="r", kind="pause", issued_at=now, expires_at=now + 65).signed(key)
    assert ok.verify(key) is None and Directive(run="r", kind="pause").signed(key).verify(key) is None
    for exp, why in ((float("nan"), "bad expiry"), (float("inf"), "bad expiry"), (1e300, "expiry too far ahead"),
                     (now + 2 * 86_400, "expiry too far ahead")):
        d = Directive(run="r", kind="pause", issued_at=now, expires_at=exp).signed(key)
        assert d.verify(key, now=now) == why, exp
    assert Directive(run="r", kind="pause", issued_at=float("nan"), expires_at=now + 5).signed(key).verify(key) == "bad expiry"
