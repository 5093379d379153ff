"""`sentinel replay-batch` after a rollback: a step on two timelines (tiny preset, CPU, no mocks).

One run, built once per session under pytest's base temp dir:
* timeline 0 trains steps 1..20 with two samples of step 12's batch drilled to garbage, saving
  checkpoints 10, 15 and 20 (the newest 3 kept);
* a rollback to checkpoint 10 that skips those samples (``pending_rollback.json``, as ``sentinel
  rollback`` writes it) starts timeline 1, which trains 11..20 again and saves 15 and 20 over
  timeline 0's. Checkpoint 10 is the common ancestor; 15 and 20 belong to timeline 1 only.

So step 12 is on both timelines: the abandoned record is the damaged one (the garbage batch), the
surviving one is healthy. ``replay-batch --step 12`` must say so, and ``--timeline 0`` must replay
the batch that spiked, from a checkpoint of timeline 0's own lineage.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel.cli import main as cli
from sentinel.client.steplog import read
from sentinel.protocol import StepRecord
from tests.helpers.offline import PY, make_run

BAD_STEP = 12  # its batch carries the garbage samples on timeline 0
AFTER_FORK = 17  # replayed on timeline 0: checkpoint 15 (timeline 1's) is newer than 10 but not its state
ROLLBACK_TO = 10


def step_records(run: Path) -> dict[tuple[int, int], StepRecord]:
    """(timeline, step) -> the record that timeline logged for the step."""
    return {(r.timeline, r.step): r for r in read(run / "steps.jsonl") if isinstance(r, StepRecord)}


@pytest.fixture(scope="module")
def rolled_back(tmp_path_factory) -> tuple[Path, list[int]]:
    """(the run, the two garbage ids). Timeline 0 is built by ``make_run`` (cached by name) and copied,
    so the rollback (a second trainer start that consumes the plan) never touches the cached run."""
    from sentinel.rundir import write_pending_rollback
    from trainer.data import Sampler, TokenDataset, ensure_prepared

    data = ensure_prepared(tmp_path_factory.getbasetemp() / "offline-data")
    ds = TokenDataset.open(data)
    sampler = Sampler(ds.num_samples(64), 1337, ds.fingerprint)
    sampler.next_ids(4 * (BAD_STEP - 1))  # tiny: 4 samples a step
    bad = sampler.next_ids(4)[0][::2]
    args = ["--inject-fault", f"garbage@{bad[0]}", "--inject-fault", f"garbage@{bad[1]}"]
    base = make_run(tmp_path_factory, "branch-timeline0", *args, steps=20, every=5)
    run = tmp_path_factory.mktemp("branch") / "run"
    shutil.copytree(base, run)
    write_pending_rollback(run, to_step=ROLLBACK_TO, ranges=[(i, i + 1) for i in bad], id="test-rollback",
                           reason=f"test: garbage at step {BAD_STEP}")
    cmd = [PY, "-m", "trainer", "--preset", "tiny", "--run-dir", str(run), "--max-steps", "20", "--ckpt-every", "5",
           "--telemetry", "off", "--data", str(data), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    recs = step_records(run)
    assert {(t, s) for t, s in recs if s == BAD_STEP} == {(0, BAD_STEP), (1, BAD_STEP)}
    assert recs[0, BAD_STEP].loss > recs[1, BAD_STEP].loss + 0.5  # the abandoned record is the damaged one
    manifests = {s: json.loads((run / "checkpoints" / f"step-{s:08d}" / "manifest.json").read_text())["timeline"]
                 for s in (10, 15, 20)}
    assert manifests == {10: 0, 15: 1, 20: 1}
    return run, bad


def invoke(*args):
    return CliRunner().invoke(cli, ["replay-batch", *map(str, args)])


def replay_json(*args) -> dict:
    r = invoke(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def assert_one_line_error(r, contains: str) -> None:
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit)  # no uncaught exception
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and contains in lines[0], r.output


def test_default_replays_the_surviving_record_and_warns_about_the_abandoned_one(rolled_back):
    run, _ = rolled_back
    surviving = step_records(run)[1, BAD_STEP]
    res = replay_json(run, "--step", BAD_STEP, "--top", "2")
    assert res["timeline"] == 1 and res["timelines"] == [0, 1] and res["checkpoint"] == ROLLBACK_TO
    assert res["reproduced"] is True and res["recorded"]["loss"] == surviving.loss == res["replayed"]["loss"]
    warning = [w for w in res["warnings"] if "trained on timelines" in w]
    assert len(warning) == 1, res["warnings"]
    w = warning[0]
    assert f"step {BAD_STEP} was trained on timelines 0 and 1" in w and "surviving timeline 1" in w
    assert f"abandoned by a rollback to step {ROLLBACK_TO}" in w and "anomalous" in w and "pass --timeline 0" in w
    # the human output says it too (one line, on stderr), and names the timeline it replayed
    r = invoke(run, "--step", BAD_STEP, "--top", "0")
    assert r.exit_code == 0, r.output
    assert [ln for ln in r.stderr.splitlines() if "trained on timelines" in ln] == [w]
    assert f"replay of step {BAD_STEP} (timeline 1)" in r.stdout


def test_timeline_replays_the_abandoned_batch_and_names_the_culprits(rolled_back):
    run, bad = rolled_back
    abandoned = step_records(run)[0, BAD_STEP]
    res = replay_json(run, "--step", BAD_STEP, "--timeline", "0", "--top", "2")
    assert res["timeline"] == 0 and res["checkpoint"] == ROLLBACK_TO  # the common ancestor
    assert res["batch_fingerprint"] == abandoned.batch_fingerprint
    assert res["recorded"]["loss"] == abandoned.loss == res["replayed"]["loss"]  # bitwise on CPU
    assert res["replayed"]["grad_norm"] == abandoned.grad_norm
    assert res["reproduced"] is True and res["fast_forward"]["matched"] is True
    assert sorted(c["id"] for c in res["culprits"]) == sorted(bad)
    assert res["batch"]["is_cause"] is True
    assert any("replaying the abandoned timeline 0's record" in w for w in res["warnings"])


def test_abandoned_branch_never_restores_a_checkpoint_saved_after_the_fork(rolled_back):
    """Checkpoint 15 is timeline 1's (it skipped the garbage): newer than 10, but not timeline 0's
    state. Timeline 0's step 17 is replayed from 10 with timeline 0's own batches for 11..16."""
    run, _ = rolled_back
    abandoned = step_records(run)[0, AFTER_FORK]
    res = replay_json(run, "--step", AFTER_FORK, "--timeline", "0", "--top", "0")
    assert res["checkpoint"] == ROLLBACK_TO and res["fast_forward"]["steps"] == AFTER_FORK - ROLLBACK_TO - 1
    assert res["fast_forward"]["matched"] is True and res["fast_forward"]["checkpoint_matches_log"] is True
    assert res["reproduced"] is True and res["replayed"]["loss"] == abandoned.loss
    assert any("15 (timeline 1)" in w and "passed over" in w for w in res["warnings"])
    # the surviving branch keeps its own newest checkpoint
    assert replay_json(run, "--step", AFTER_FORK, "--top", "0")["checkpoint"] == 15


def test_bad_timeline_input_is_one_line_exit_2(rolled_back, tmp_path):
    run, _ = rolled_back
    assert_one_line_error(invoke(run, "--step", BAD_STEP, "--timeline", "7"),
                          "timeline 7 is not in the step log")
    assert_one_line_error(invoke(run, "--step", AFTER_FORK, "--timeline", "0", "--checkpoint", "15"),
                          "checkpoint 15 was saved on timeline 1, not on timeline 0's branch")
    # retention (here: by hand) took the common ancestor: no checkpoint of timeline 0's lineage is left
    gone = tmp_path / "no-ancestor"
    shutil.copytree(run, gone)
    shutil.rmtree(gone / "checkpoints" / "step-00000010")
    assert_one_line_error(invoke(gone, "--step", AFTER_FORK, "--timeline", "0"),
                          f"no valid checkpoint of timeline 0's branch at or before step {AFTER_FORK - 1}")
    # a step only an abandoned branch reached: the default says which --timeline replays it
    cut = tmp_path / "cut"
    shutil.copytree(run, cut, ignore=shutil.ignore_patterns("checkpoints"))
    lines = (cut / "steps.jsonl").read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if json.loads(ln).get("kind") != "step" or json.loads(ln)["step"] < 20
            or json.loads(ln)["timeline"] == 0]
    (cut / "steps.jsonl").write_text("".join(kept))
    assert_one_line_error(invoke(cut, "--step", 20), "it was trained on abandoned timeline(s) 0: pass --timeline 0")
