"""``sentinel pause / resume / stop`` on a live run: a real trainer on its embedded bus, no mocks.

The trainer answers every directive with an Ack; the commands wait for it, and say in one line when
the bus is down or nobody answers. ``resume`` also hands an escalated run back to automation.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from click.testing import CliRunner

from sentinel import bus
from sentinel.cli import main
from sentinel.protocol import Directive, Incident, Keys
from tests.helpers.trainer import BASE_ARGS, REPO, kill_all, last_step, trainer_cmd, trainer_env


def cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def cli_json(*args: str) -> dict:
    res = cli(*args, "--json")
    assert res.exit_code == 0, (res.exit_code, res.output)
    return json.loads(res.stdout)


def one_line_error(res, rc: int, contains: str) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in res.output, res.output
    assert res.exit_code == rc and len(lines) == 1 and lines[0].startswith("error: "), (res.exit_code, res.stderr)
    assert contains in lines[0], lines[0]
    return lines[0]


def _wait(cond, timeout: float, what: str, proc=None):
    deadline = time.time() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, f"the trainer exited while waiting for {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@pytest.fixture
def live_run(tmp_path, dataset):
    run_dir = tmp_path / "ctl"
    log = open(tmp_path / "trainer.log", "w")
    proc = subprocess.Popen(
        trainer_cmd(run_dir, *BASE_ARGS[:2], "--telemetry", "on", "--redis-url", "embedded", "--data", str(dataset),
                    "--max-steps", "100000", "--ckpt-every", "1000", "--eval-every", "0", "--metrics-port", "0"),
        env=trainer_env(dataset), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: (run_dir / "bus" / "url").is_file() and last_step(run_dir / "steps.jsonl") >= 3, 180,
              "the trainer's first steps", proc)
        r = bus.connect(bus.resolve_url(run_dir))
        _wait(lambda: r.get(Keys("ctl").heartbeat) is not None, 60, "the heartbeat", proc)
        yield run_dir, proc, r
    finally:
        if proc.poll() is None:
            kill_all(proc)
        log.close()
        from sentinel.embedded import stop_embedded

        stop_embedded(run_dir)


def test_pause_resume_stop_a_live_run(live_run):
    run_dir, proc, r = live_run
    k = Keys("ctl")
    out = cli_json("pause", run_dir, "--reason", "node check", "--timeout", "60")
    assert out["status"] == "applied" and out["kind"] == "pause"
    n = last_step(run_dir / "steps.jsonl")
    time.sleep(2.0)
    assert last_step(run_dir / "steps.jsonl") == n, "steps kept coming while paused"
    assert r.get(k.heartbeat) is not None  # paused, not dead

    # the sentinel escalated while the run was paused: resume hands it back to automation too
    now = time.time()
    esc = Incident(id="ctl-t0-s2", run="ctl", state="escalated", rule="loss_spike", onset_step=2, detect_step=3,
                   opened_at=now)
    waiting = Incident(id="ctl-t0-s3", run="ctl", state="awaiting_approval", rule="loss_spike", onset_step=3,
                       detect_step=3, opened_at=now + 1)
    r.hset(k.incidents, mapping={esc.id: esc.to_json(), waiting.id: waiting.to_json()})
    res = cli("resume", run_dir, "--reason", "node is fine")
    assert res.exit_code == 0, res.output
    text = " ".join(res.stdout.split())
    assert "resumed" in text and esc.id in text and "still awaits approval" in text and waiting.id in text
    (eid, fields), = r.xrange(k.approvals)
    appr = Directive.from_json(fields[bus.FIELD])
    assert appr.incident_id == esc.id and appr.kind == "resume" and appr.verify(bus.load_secret(run_dir)) is None
    _wait(lambda: last_step(run_dir / "steps.jsonl") > n + 2, 120, "steps after the resume", proc)

    out = cli_json("stop", run_dir, "--reason", "end of drill")
    assert out["status"] == "applied"
    assert proc.wait(timeout=120) == 0
    final = last_step(run_dir / "steps.jsonl")
    assert (run_dir / "checkpoints" / f"step-{final:08d}" / "manifest.json").is_file()  # stop = checkpoint, then exit
    applied = [json.loads(x) for x in (run_dir / "directives.jsonl").read_text().splitlines()]
    assert [a["kind"] for a in applied if a["issuer"].startswith("cli:")] == ["pause", "resume", "stop"]
    audit = [json.loads(x) for x in (run_dir / "audit.jsonl").read_text().splitlines()]
    done = [(a["action"], a["outcome"]) for a in audit if a.get("phase") == "outcome"]
    assert done == [("pause", "applied"), ("resume", "applied"), ("stop", "applied")]
    assert audit[0]["reason"] == "node check" and audit[0]["who"].startswith("cli:")

    # nobody acks: the trainer is gone but a heartbeat lingers (a hung trainer looks like this)
    r.set(k.heartbeat, json.dumps({"step": final, "time": time.time()}), px=30_000)
    one_line_error(cli("pause", run_dir, "--timeout", "1"), 1, "no ack from the trainer of ctl within 1s")
    r.delete(k.heartbeat)
    one_line_error(cli("resume", run_dir), 1, "no trainer attached to run ctl")


def test_control_commands_bus_down_is_one_line(tmp_path):
    run_dir = tmp_path / "gone"
    (run_dir / "bus").mkdir(parents=True)
    (run_dir / "steps.jsonl").write_text("")
    (run_dir / "bus" / "url").write_text("redis://127.0.0.1:1/0\n")
    for kind in ("pause", "resume", "stop"):
        one_line_error(cli(kind, run_dir), 2, "embedded bus is down")
    one_line_error(cli("pause", run_dir, "--redis-url", "redis://127.0.0.1:1"), 2, "cannot reach Redis")
    one_line_error(cli("stop", "nosuchrun"), 2, "no control bus was given")
