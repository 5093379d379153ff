"""The on-call views as scripts and tired people use them: `status --exit-status` (HUNG, stale or paused
runs exit 1), the offline views of a run that has stopped (no warning that its own bus is down,
every time), and `skip-list` grouped by incident with `--limit`.

Real Debian redis-server for the live states; run directories written here for the offline ones.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel import bus
from sentinel.cli import main
from sentinel.protocol import Keys, StepRecord, TimelineRecord
from tests.helpers.services import free_port


def cli(*args: str, env: dict | None = None):
    return CliRunner(env={"COLUMNS": "160", **(env or {})}).invoke(main, list(args), catch_exceptions=False)


def _step(run: str, step: int, t: float) -> StepRecord:
    return StepRecord(run=run, step=step, loss=2.0, loss_max_rank=2.0, grad_norm=0.5, lr=1e-3, tokens=step * 512,
                      batch_fingerprint="x", sample_ids=[step], time=t, step_seconds=0.1)


# ------------------------------------------------------------------ status --exit-status
@pytest.mark.parametrize("state, heartbeat, code", [
    ("live", lambda now: {"step": 20, "time": now - 1, "sent": now}, 0),
    ("paused", lambda now: {"step": 20, "time": now - 1, "sent": now, "paused": True}, 1),
    ("stale", lambda now: {"step": 20, "time": now - 120, "sent": now - 120}, 1),
    ("hung", lambda now: {"step": 20, "time": now - 600, "sent": now}, 1),
])  # fmt: skip
def test_status_exit_status_is_nonzero_for_hung_stale_or_paused(redis_server, unique_run, state, heartbeat, code):
    r = bus.connect(redis_server.url)
    k = Keys(unique_run)
    bus.register_run(r, unique_run, {"world_size": 1})
    now = time.time()
    for s in range(1, 21):
        bus.publish(r, k.steps, _step(unique_run, s, now - 700 + s))
    r.set(k.heartbeat, json.dumps({**heartbeat(now), "pid": 1}), px=60_000)
    args = ("status", unique_run, "--redis-url", redis_server.url)
    plain = cli(*args, "--json")
    assert plain.exit_code == 0 and json.loads(plain.stdout)["runs"][0]["state"] == state  # without the flag: 0
    res = cli(*args, "--exit-status")
    assert res.exit_code == code, (res.stdout, res.stderr)
    if code:
        assert res.stderr.strip() == f"needs attention: {unique_run} ({state})"
        assert state in res.stdout.lower()  # the table is still printed
    # with --watch, it returns at the first refresh that shows such a run
    if state == "hung":
        t0 = time.monotonic()
        watched = cli(*args, "--exit-status", "--watch", "--json", "--interval", "0.2")
        assert watched.exit_code == 1 and time.monotonic() - t0 < 10
        assert json.loads(watched.stdout.splitlines()[0])["runs"][0]["state"] == "hung"


# ------------------------------------------------------------------ a stopped run's views are quiet
@pytest.fixture
def stopped_run(tmp_path) -> Path:
    """A run dir whose embedded bus is gone (nothing listens on its URL) and whose trainer has stopped."""
    d = tmp_path / "stopped"
    (d / "bus").mkdir(parents=True)
    (d / "config.yaml").write_text("run_id: stopped\nmax_steps: 20\n")
    (d / "bus" / "url").write_text(f"redis://127.0.0.1:{free_port()}/0\n")
    t = time.time() - 3600
    lines = [TimelineRecord(kind="start", run="stopped", from_step=0, timeline=0, time=t).to_json()]
    lines += [_step("stopped", s, t + s).to_json() for s in range(1, 11)]
    (d / "steps.jsonl").write_text("\n".join(lines) + "\n")
    os.utime(d / "steps.jsonl", (t, t))
    (d / "trainer.lock").write_text('{"pid": 1}')
    return d


VIEWS = [("status", "--json"), ("incidents", "--json"), ("pages", "--json"), ("checkpoints", "--json")]


def test_views_of_a_stopped_run_do_not_warn_that_its_bus_is_down(stopped_run, monkeypatch):
    monkeypatch.delenv("SENTINEL_REDIS_URL", raising=False)
    for view, flag in VIEWS:
        res = cli(view, str(stopped_run), flag)
        assert res.exit_code == 0, (view, res.output)
        out = json.loads(res.stdout)
        row = out["runs"][0] if "runs" in out else out
        assert row.get("note") is None, (view, row.get("note"))
        assert "bus is down" not in res.stderr
    human = cli("incidents", str(stopped_run))
    assert "the run has stopped" in human.stdout and "bus is down" not in human.stdout + human.stderr


def test_a_live_trainer_or_an_explicit_bus_still_gets_the_note(stopped_run, monkeypatch):
    monkeypatch.delenv("SENTINEL_REDIS_URL", raising=False)
    # a trainer on this machine holds the lock: its bus being down is news
    with open(stopped_run / "trainer.lock", "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        row = json.loads(cli("status", str(stopped_run), "--json").stdout)["runs"][0]
        assert "embedded bus is down" in row["note"]
        assert "embedded bus is down" in cli("checkpoints", str(stopped_run)).stderr
    # steps.jsonl written in the last minute (a trainer on another node): news too
    os.utime(stopped_run / "steps.jsonl")
    assert "embedded bus is down" in json.loads(cli("status", str(stopped_run), "--json").stdout)["runs"][0]["note"]
    # an explicit bus that is down is always said, stopped run or not
    os.utime(stopped_run / "steps.jsonl", (time.time() - 3600,) * 2)
    dead = f"redis://127.0.0.1:{free_port()}/0"
    row = json.loads(cli("status", str(stopped_run), "--json", "--redis-url", dead).stdout)["runs"][0]
    assert "unreachable" in row["note"]


# ------------------------------------------------------------------ skip-list groups
def test_skip_list_groups_one_sample_ranges_by_incident_and_takes_a_limit(stopped_run):
    """151 one-sample ranges of one rollback (and 3 operator adds) are 2 rows, not 300 lines."""
    d = stopped_run
    culprits = [(1000 + 7 * i, 1001 + 7 * i) for i in range(151)]
    with open(d / "steps.jsonl", "a") as f:
        f.write(TimelineRecord(kind="rollback", run="stopped", from_step=8, timeline=1, time=time.time() - 3000,
                               directive_id="d-rb", reason="divergence", skip_ranges=culprits).to_json() + "\n")
    (d / "directives.jsonl").write_text(json.dumps({"id": "d-rb", "kind": "rollback", "status": "applied", "step": 8,
                                                    "incident_id": "stopped-t0-s9"}) + "\n")
    for rng in ("50:60", "70:80", "90:95"):
        assert cli("skip-list", str(d), "add", rng, "--reason", "bad shard", "--json").exit_code == 0
    (d / "skiplist.json").write_text(json.dumps([[50, 60], [70, 80], [90, 95], *[list(c) for c in culprits]]))
    out = json.loads(cli("skip-list", str(d), "--json").stdout)
    assert len(out["ranges"]) == 154  # --json keeps every range
    assert [(g["incident_id"], len(g["ranges"]), g["samples"]) for g in out["groups"]] == [
        (None, 3, 25), ("stopped-t0-s9", 151, 151)]
    human = cli("skip-list", str(d)).stdout
    assert len(human.splitlines()) < 15, human
    assert "incident stopped-t0-s9: rollback to step 8" in human and "1000:1001 1007:1008 1014:1015 +148 more" in human
    limited = cli("skip-list", str(d), "--limit", "1").stdout
    assert "stopped-t0-s9" not in limited and "1 more group(s) (--limit 0 for all" in limited
    assert "stopped-t0-s9" in cli("skip-list", str(d), "--limit", "0").stdout
