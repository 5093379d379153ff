"""``sentinel report``: one PNG of a run for the on-call engineer (issue 10 item 8).

The painting is a pure function of records (checked on a synthetic run with a spike, a rollback
and the steps it abandoned); the command runs on a real run directory, reads incidents from the
daemon's ``incidents.jsonl`` mirror, and says in one line what it cannot do.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel.cli import main
from sentinel.protocol import Incident, MarkerRecord, StepRecord, TimelineRecord
from sentinel.report import gather, render
from tests.helpers.cli import one_line_error

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step(s: int, loss: float, *, timeline: int = 0, lr: float | None = None, **kw) -> StepRecord:
    lr = lr if lr is not None else (1e-3 * s / 10 if s <= 10 else 1e-3 * (1 - (s - 10) / 100))
    return StepRecord(run="r", step=s, timeline=timeline, loss=loss, loss_max_rank=loss, grad_norm=0.5 + 0.01 * s, lr=lr,
                      tokens=s * 64, batch_fingerprint=f"f{s}", sample_ids=[4 * s + i for i in range(4)],
                      time=1000.0 + s, **kw)


def drill_records() -> list:
    """60 steps; an LR x100 at step 40 wrecks the weights (loss spikes from 41), the sentinel rolls
    back to checkpoint 30 at step 44 and training goes on; a guard skip at 20, val PPL every 10."""
    recs: list = [TimelineRecord(kind="start", run="r", from_step=0, timeline=0, time=1000.0),
                  MarkerRecord(run="r", step=10, marker="warmup_end", time=1010.0),
                  MarkerRecord(run="r", step=30, marker="decay_start", time=1030.0)]
    for s in range(1, 45):
        loss = 5.0 - 0.03 * s if s < 41 else 9.0 + s - 41
        kw = {"val_ppl": 40.0 - s / 2} if s % 10 == 0 else {}
        if s == 20:
            kw.update(skipped=True, skip_reason="loss_spike")
        recs.append(step(s, loss, lr=0.1 if s == 40 else None, **kw))
    recs.append(TimelineRecord(kind="rollback", run="r", from_step=30, timeline=1, time=1050.0, reason="loss_spike",
                               skip_ranges=[(160, 168)]))
    for s in range(31, 61):
        recs.append(step(s, 5.0 - 0.03 * s, timeline=1, **({"val_ppl": 40.0 - s / 2} if s % 10 == 0 else {})))
    return recs


def test_gather_puts_every_event_on_one_timeline():
    inc = Incident(id="r-t0-s41", run="r", state="healthy", rule="loss_spike", onset_step=41, detect_step=44,
                   rollback_to=30)
    data = gather("r", drill_records(), skiplist=[(160, 168)], incidents=[inc],
                  directives=[{"kind": "pause", "status": "applied", "step": 50}])
    live = [s for seg in data.segments if not seg.abandoned for s in seg.steps]
    gone = [s for seg in data.segments if seg.abandoned for s in seg.steps]
    assert live == list(range(1, 61)) and gone == list(range(31, 45))  # the undone spike stays visible
    assert data.rollbacks == [{"at": 44, "to": 30, "reason": "loss_spike"}]
    assert [(s, r) for s, _, r in data.guard_skips] == [(20, "loss_spike")]
    assert [s for s, _ in data.val] == [10, 20, 30, 40, 50, 60] and data.val[3][1] == 20.0  # the re-trained step 40
    assert data.incidents[0]["onset"] == 41 and data.incidents[0]["detect"] == 44
    assert data.skip_windows == [(40, 41, 8)]  # samples 160..167 were trained at steps 40 and 41
    assert data.resumes == [{"step": 50, "kind": "pause"}]
    assert data.phases == [("warmup", 1, 10), ("stable", 11, 30), ("decay", 31, 60)]


def test_phases_from_the_config_when_no_markers():
    recs = [r for r in drill_records() if not isinstance(r, MarkerRecord)]
    data = gather("r", recs, config={"max_steps": 50, "optim": {"warmup_steps": 10}})
    assert data.phases == [("warmup", 1, 10), ("decay", 11, 50), ("floor", 51, 60)]


def test_render_writes_a_readable_png(tmp_path):
    data = gather("r", drill_records(), skiplist=[(160, 168)], incidents=[
        Incident(id="r-t0-s41", run="r", state="healthy", rule="loss_spike", onset_step=41, detect_step=44)])
    out = render(data, tmp_path / "deep" / "r.png")
    assert out.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    h, w = matplotlib.image.imread(out).shape[:2]
    assert w >= 1200 and h >= 900  # legible on a laptop screen without zooming


# ------------------------------------------------------------------ the command, on a real run
@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    from tests.helpers.offline import make_run

    return make_run(tmp_path_factory, "report", steps=30, every=10)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_report_command_on_a_real_run(real_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    # no incidents mirror and no bus: still a picture, and it says where incidents came from
    res = cli("report", run, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["path"] == str(run / "reports" / "run.png") and out["incidents_source"] == "none"
    assert out["steps"] == 30 and Path(out["path"]).read_bytes()[:8] == PNG_MAGIC
    assert [p[0] for p in out["phases"]][:1] == ["warmup"]
    # the daemon's mirror: one Incident per line, the last line per id wins, torn lines ignored
    inc = Incident(id="run-t0-s21", run="run", state="verifying", rule="loss_spike", onset_step=21, detect_step=23,
                   opened_at=time.time())
    done = inc.model_copy(update={"state": "healthy", "closed_at": time.time()})
    (run / "incidents.jsonl").write_text(inc.to_json() + "\n" + done.to_json() + "\n" + '{"id": "to')
    res = cli("report", run, "--incident", inc.id, "--out", tmp_path / "inc.png")
    assert res.exit_code == 0, res.output
    assert f"report: {tmp_path / 'inc.png'}" in res.stdout and "from incidents.jsonl" in res.stdout
    assert (tmp_path / "inc.png").read_bytes()[:8] == PNG_MAGIC
    # `sentinel incidents` prints the picture's path
    res = CliRunner(env={"COLUMNS": "80"}).invoke(main, ["incidents", str(run)])
    assert res.exit_code == 0, res.output
    assert inc.id in res.stdout and "report: " in res.stdout and (run / "reports" / "run.png").is_file()
    assert max(len(ln) for ln in res.stdout.splitlines()) <= 80


def test_report_bad_input_is_one_line(real_run, tmp_path):
    one_line_error(cli("report", tmp_path / "nope"), "run directory not found")
    one_line_error(cli("report", real_run, "--incident", "x-t0-s1"), "incident x-t0-s1 not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "steps.jsonl").write_text("")
    one_line_error(cli("report", empty), "no step records yet")


def test_gather_reads_the_log_once_and_settles_abandoned_steps_as_the_whole_log_would(tmp_path):
    """``gather`` streams the records (a long run's log held whole was 2.1 GB for 300,000 steps) and
    decides which steps a rollback superseded after the pass. On random logs with rollbacks,
    resumes, guard skips and a step logged twice, every step's abandoned flag and the guard skips
    must be what ``authoritative_steps`` over the whole log says."""
    import random

    from sentinel.protocol import authoritative_steps
    from tests.helpers.steplog import random_log

    rng = random.Random(21)
    for i in range(200):
        recs = random_log(rng, tmp_path / f"r{i}.jsonl")
        steps = [k for k, r in enumerate(recs) if isinstance(r, StepRecord)]
        if steps and rng.random() < 0.5:  # a line written twice
            k = rng.choice(steps)
            recs.insert(k + 1, recs[k].model_copy(update={"loss": recs[k].loss + 1.0}))
        final = authoritative_steps(recs)
        data = gather("r", iter(recs))
        got = [(seg.timeline, seg.abandoned, s, x) for seg in data.segments for s, x in zip(seg.steps, seg.loss)]
        want = [(r.timeline, final.get(r.step) is not r, r.step, r.loss) for r in recs if isinstance(r, StepRecord)]
        assert got == want
        assert data.guard_skips == [(s, r.loss, "skipped") for s, r in final.items() if r.skipped]


def test_an_incident_id_never_takes_a_report_outside_the_run_dir(tmp_path):
    from sentinel.cli.report_cmd import default_path

    for iid in ("../../../../pwned", "..", "/etc/x", "a/b"):
        p = default_path(tmp_path / "run", iid)
        assert p.parent == tmp_path / "run" / "reports" and "/" not in p.name and p.name.startswith("incident-"), p
