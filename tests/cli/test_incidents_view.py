"""``sentinel incidents`` read from a run directory with the bus down: directive outcomes matched one
to one, the evidence for a closed incident's outcome, ``--open`` with nothing open, an incident id
given where a run is expected, and times labelled UTC.

Fast: the run directory's files (incidents.jsonl, directives.jsonl) are written here directly; no
trainer, no bus. One test drives the pure policy to show it records why and when it closed.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel.cli import main
from sentinel.policy import RunPolicy
from sentinel.protocol import CheckpointInfo, Incident, StepRecord, TimelineRecord
from sentinel.rules import default_rules

RUN = "demo1"
IID = f"{RUN}-t0-s101"
T0 = 1_795_563_789.0  # 2026-11-24 23:43:09 UTC (18:43:09 in New York)


@pytest.fixture(autouse=True)
def _no_bus(monkeypatch):
    """The file source: no bus URL from the environment, whatever the developer's shell has."""
    monkeypatch.delenv("SENTINEL_REDIS_URL", raising=False)


@pytest.fixture(autouse=True)
def _local_zone_not_utc():
    """A local zone other than UTC, so that a local time shown as if it were UTC is caught."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"
    time.tzset()
    yield
    if old is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = old
    time.tzset()


def _action(kind: str, n: int, t: float, **kw) -> dict:
    return {"kind": kind, "run": RUN, "incident_id": IID, "reason": f"{kind} {n}", "dry_run": False,
            "idempotency_key": f"{RUN}:{IID}:{kind}:{n}", "time": t, **kw}


def _incident(**kw) -> Incident:
    base = dict(id=IID, run=RUN, state="healthy", rule="divergence", onset_step=101, detect_step=112, opened_at=T0,
                closed_at=T0 + 40, rollback_to=80,
                evidence=[{"step": s, "loss": 6.0, "detail": "loss high"} for s in (101, 102, 112)],
                actions=[_action("rollback", 1, T0 + 1, to_step=80), _action("skip-samples", 1, T0 + 2, ranges=[[8, 16]]),
                         _action("skip-samples", 2, T0 + 3, ranges=[[16, 24]])])
    base.update(kw)
    return Incident(**base)


def _directive(did: str, kind: str, status: str, t: float) -> dict:
    return {"id": did, "kind": kind, "status": status, "step": 81, "timeline": 1, "time": t, "incident_id": IID}


def make_run(tmp_path: Path, incidents: list[Incident], directives: list[dict] | None = None) -> Path:
    """A run directory as the bus-less views read it: config, the incidents mirror, the trainer's log."""
    d = tmp_path / RUN
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(f"run_id: {RUN}\n")
    (d / "incidents.jsonl").write_text("".join(json.dumps(i.model_dump(mode="json")) + "\n" for i in incidents))
    (d / "directives.jsonl").write_text("".join(json.dumps(x) + "\n" for x in directives or []))
    return d


def cli(*args: str):
    """The command at 100 columns; the report picture is not drawn (``--json`` never draws it, and the
    human view only adds its path)."""
    return CliRunner(env={"COLUMNS": "100"}).invoke(main, list(args), catch_exceptions=False)


def human(*args: str) -> str:
    res = cli(*args)
    assert res.exit_code == 0, (res.output, res.stderr)
    return " ".join(res.stdout.replace("│", " ").split())  # words, not the panel's borders and line breaks


def as_json(*args: str) -> dict:
    res = cli(*args, "--json")
    assert res.exit_code == 0, (res.output, res.stderr)
    (run,) = json.loads(res.stdout)["runs"]
    return run


@pytest.fixture(autouse=True)
def _no_report(monkeypatch):
    """The incidents are the subject here, not the run's picture (slow to draw, no steps to draw)."""
    from sentinel.cli import incidents_cmd

    monkeypatch.setattr(incidents_cmd, "_attach_report", lambda ref, run, incident_id: None)


# ------------------------------------------------------------------ 1. outcomes matched one to one
def test_two_skip_samples_of_one_incident_get_their_own_directives(tmp_path):
    """Without a bus, actions are matched to directives.jsonl by incident and kind: each entry
    answers for one action, in order, so the second skip-samples shows the second directive's
    answer (rejected), not the first's (acked). A directive logged twice (a redelivery) is one."""
    log = [_directive("d-roll", "rollback", "applied", T0 + 2), _directive("d-s1", "skip-samples", "applied", T0 + 3),
           _directive("d-s1", "skip-samples", "duplicate", T0 + 3.5),
           _directive("d-s2", "skip-samples", "rejected", T0 + 4)]
    d = make_run(tmp_path, [_incident()], log)
    acts = as_json("incidents", str(d))["incidents"][0]["actions"]
    got = [(a["kind"], a["directive_id"], a["outcome"]) for a in acts]
    assert got == [("rollback", "d-roll", "acked"), ("skip-samples", "d-s1", "acked"),
                   ("skip-samples", "d-s2", "rejected")]
    assert "rejected" in human("incidents", str(d))


def test_an_action_that_names_its_directive_keeps_it_from_the_matching_by_kind(tmp_path):
    """An action that carries its directive id owns that log entry even when listed after one that
    is matched by incident and kind: the earlier one gets the next entry, or none."""
    acts = [_action("skip-samples", 1, T0 + 2), _action("skip-samples", 2, T0 + 3, directive_id="d-s1")]
    d = make_run(tmp_path, [_incident(actions=acts)], [_directive("d-s1", "skip-samples", "applied", T0 + 3),
                                                      _directive("d-s2", "skip-samples", "failed", T0 + 4)])
    got = [(a["directive_id"], a["outcome"]) for a in as_json("incidents", str(d))["incidents"][0]["actions"]]
    assert got == [("d-s2", "failed"), ("d-s1", "acked")]


# ------------------------------------------------------------------ 2. evidence for the outcome
def _rec(step: int, loss: float, timeline: int = 0) -> StepRecord:
    return StepRecord(run=RUN, step=step, timeline=timeline, loss=loss, loss_max_rank=loss, grad_norm=0.0, lr=1e-3,
                      tokens=step * 1000, batch_fingerprint=f"fp{step}", time=1000.0 + step,
                      sample_ids=list(range(step * 4, step * 4 + 4)))


def test_the_policy_records_the_close_step_and_reason_on_the_incident():
    """The reason RunPolicy._close gives was only an event (bus-only): it is on the incident now,
    with the step, so the mirror (a dump of the Incident) carries it; old mirrors still load."""
    rng = random.Random(0)
    x = lambda: 3.0 * (1 + rng.gauss(0, 0.01))  # noqa: E731
    p = RunPolicy(RUN, default_rules(), clock=lambda: 10_000.0)
    for s in range(1, 300):
        p.on_step(_rec(s, x()))
        if s % 50 == 0:
            p.on_checkpoint(CheckpointInfo(run=RUN, step=s, path=f"/c/{s}", created=1000.0 + s, bytes=1,
                                           manifest_sha256="x", world_size=1))
    s, acts = 299, []
    while not any(a.kind == "rollback" for a in acts):
        s += 1
        assert s < 330, "no rollback"
        acts = p.on_step(_rec(s, 5.0))
    p.on_timeline(TimelineRecord(kind="rollback", run=RUN, from_step=200, timeline=1, time=2000.0))
    step = 200
    while p.state != "healthy":
        step += 1
        assert step < 400, "never closed"
        p.on_step(_rec(step, x(), timeline=1))
    inc = p.incidents[0]
    assert inc.state == "healthy" and inc.closed_step == step and "within band" in inc.close_reason
    back = Incident.from_json(json.dumps(inc.model_dump(mode="json")))
    assert (back.closed_step, back.close_reason) == (step, inc.close_reason)
    old = Incident.from_json({k: v for k, v in inc.model_dump(mode="json").items() if k not in ("closed_step", "close_reason")})
    assert old.closed_step is None and old.close_reason is None
    assert "closed_step" not in json.loads(old.to_json())  # to_json leaves the unset fields out, as before


def test_a_closed_incident_says_when_and_why_and_when_it_was_first_flagged(tmp_path):
    why = "recovered: loss 3.081 within band of baseline 3.079 at step 130"
    d = make_run(tmp_path, [_incident(closed_step=130, close_reason=why)])
    text = human("incidents", str(d))
    assert "first flagged 101, declared 112" in text
    assert "at step 130" in text and why in text
    inc = as_json("incidents", str(d))["incidents"][0]
    assert inc["closed_step"] == 130 and inc["close_reason"] == why and inc["first_flagged_step"] == 101
    assert "130" in inc["outcome"] and why in inc["outcome"]


def test_an_old_mirror_line_without_the_close_fields_still_reads(tmp_path):
    d = make_run(tmp_path, [])
    line = {k: v for k, v in _incident().model_dump(mode="json").items() if k not in ("closed_step", "close_reason")}
    (d / "incidents.jsonl").write_text(json.dumps(line) + "\n")
    inc = as_json("incidents", str(d))["incidents"][0]
    assert inc["id"] == IID and inc["closed_step"] is None and inc["outcome"] == "closed (healthy)"


# ------------------------------------------------------------------ 3. --open with nothing open
def test_open_without_a_bus_and_nothing_open_says_so(tmp_path):
    d = make_run(tmp_path, [_incident()], [_directive("d-roll", "rollback", "applied", T0 + 2)])
    text = human("incidents", str(d), "--open")
    assert f"{RUN}: no open incidents" in text
    assert "applied directives" not in text  # not the history table instead of the answer
    run = as_json("incidents", str(d), "--open")
    assert run["incidents"] == [] and run["only_open"] is True and run["source"] == "files"


# ------------------------------------------------------------------ 4. an incident id as RUN
def test_an_incident_id_given_as_a_second_run_points_at_id(tmp_path):
    d = make_run(tmp_path, [_incident()])
    res = cli("incidents", str(d), IID)
    assert res.exit_code != 0
    err = " ".join(res.stderr.split())
    assert f"to show one incident: sentinel incidents {d} --id {IID}" in err
    assert IID in human("incidents", str(d), "--id", IID)  # and that command works
    res = cli("incidents", str(tmp_path / "nope-run"))  # not an incident id: the error is as before
    assert res.exit_code != 0 and "--id" not in res.stderr


# ------------------------------------------------------------------ 5. UTC
def test_times_are_shown_in_utc_and_say_so(tmp_path):
    d = make_run(tmp_path, [_incident()], [_directive("d-roll", "rollback", "applied", T0 + 2)])
    text = human("incidents", str(d))
    assert "opened 2026-11-24 23:43:09 UTC" in text  # in New York it was 18:43
    assert "time (UTC)" in text and "23:43:10" in text  # the action table's clock (the rollback at T0 + 1)
    empty = make_run(tmp_path / "b", [], [_directive("d-roll", "rollback", "applied", T0 + 2)])
    text = human("incidents", str(empty))  # no incidents: the run dir's history table
    assert "no incidents" in text and "time (UTC)" in text and "2026-11-24 23:43:11" in text


def test_a_long_run_shows_its_newest_incidents_and_says_how_many_are_older(tmp_path):
    """A long run closes thousands of incidents (each recovered spike is one): `incidents` shows
    the newest 20 and says how many older ones it left out; --limit 0 shows all, --id any one."""
    incs = [_incident(id=f"{RUN}-t0-s{100 * k}", state="recovered", onset_step=100 * k, detect_step=100 * k,
                      opened_at=T0 + k, closed_at=T0 + k + 1, rollback_to=None, actions=[]) for k in range(1, 26)]
    d = make_run(tmp_path, incs)
    run = as_json("incidents", str(d))
    assert [i["onset_step"] for i in run["incidents"]] == [100 * k for k in range(6, 26)]
    assert run["older_not_shown"] == 5
    assert "5 older incident(s) not shown" in human("incidents", str(d))
    assert len(as_json("incidents", str(d), "--limit", "0")["incidents"]) == 25
    assert [i["onset_step"] for i in as_json("incidents", str(d), "--id", f"{RUN}-t0-s100")["incidents"]] == [100]


def test_a_rolled_back_incident_says_to_which_step_not_state_healthy(tmp_path):
    """The policy's word for a rolled-back incident that recovered is `healthy`; the view says what
    happened: "rolled back to 80, recovered". A rollback the trainer refused is no rollback."""
    d = make_run(tmp_path / "a", [_incident()], [_directive("d-roll", "rollback", "applied", T0 + 2)])
    assert as_json("incidents", str(d))["incidents"][0]["state_text"] == "rolled back to 80, recovered"
    text = human("incidents", str(d))
    assert "state rolled back to 80, recovered" in text and "state healthy" not in text
    d = make_run(tmp_path / "b", [_incident()], [_directive("d-roll", "rollback", "rejected", T0 + 2)])
    assert as_json("incidents", str(d))["incidents"][0]["state_text"] == "healthy"
    d = make_run(tmp_path / "c", [_incident(closed_at=None, state="verifying")],
                 [_directive("d-roll", "rollback", "applied", T0 + 2)])
    assert as_json("incidents", str(d))["incidents"][0]["state_text"] == "rolled back to 80; verifying"
