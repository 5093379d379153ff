"""The third CLI audit (2026-11-28: every command against a real demo run, with hostile and edge
inputs): each finding, replayed.

Before: `verify-resume` compared a resume from checkpoint C with a log whose later steps a
rollback (or a skip directive) had trained under a grown skip list, so it called a good
checkpoint `failed` (the very checkpoint the sentinel rolled back to) and `rollback
--before-step` then passed over it; on a multi-rank run its notes ("the log has only N steps")
never reached the terminal. `backtest RUN_DIR` judged the run's directives.jsonl,
incidents.jsonl and trainer.log as traces of their own (exit 2). An empty value ("") for a run,
a trace, a file or an id was read as "." or as "not given": `backtest ""` judged the current
directory, `incidents --id ""` listed every incident, `backtest --rules ""` took the built-in
rules, `report --incident ""` drew the whole run.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.helpers.cli import base_run, cli, run_copy, sentinel_proc, step_records  # noqa: F401  (fixtures)
from tests.helpers.offline import PY, make_run
from tests.helpers.trainer import dataset, run_trainer  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(300)


def test_verify_resume_stops_where_a_rollback_grew_the_skip_list(run_copy, dataset):
    """A rollback to checkpoint 10 that skips one sample of step 14: the log's steps 14 on trained
    without it, so a plain resume from 10 matches steps 11-13 only. Before: `NOT equivalent ...
    data_cursor`, exit 1, checkpoint 10 marked failed."""
    skip = sorted(step_records(run_copy)[14].sample_ids)[0]
    p = sentinel_proc("rollback", str(run_copy), "--to-step", "10", "--skip", f"{skip}:{skip + 1}", "--yes", "--json")
    assert p.returncode == 0, p.stderr
    run_trainer(run_copy, data_dir=dataset, check=True)  # takes the pending rollback, trains 11-30 again
    # in a process of its own with the trainer's environment: on CPU a bitwise resume needs the run's intra-op
    # thread count (the trainer ran with OMP_NUM_THREADS=1; this pytest process has one thread per core)
    res = sentinel_proc("verify-resume", str(run_copy), "--from-step", "10", "--steps", "8", "--json", timeout=300)
    assert res.returncode == 0, (res.returncode, res.stdout[-1500:], res.stderr)
    out = json.loads(res.stdout)
    assert out["ok"] and out["steps"] == 3 and [r["step"] for r in out["rows"]] == [11, 12, 13]
    assert any("from step 14 on, the log did not train samples" in n for n in out["notes"]), out["notes"]
    assert "from step 14 on" in res.stderr
    verified = json.loads((run_copy / "checkpoints" / "verified.json").read_text())
    assert verified["10"]["verified"] == "resume_verified", verified


@pytest.mark.slow
def test_verify_resume_on_two_ranks_shows_the_workers_notes(tmp_path_factory, tmp_path):
    """The workers' stderr goes to their log file: their notes must be echoed, as replay-batch's
    warnings are. Before: 4 steps asked, 2 verified, nothing said."""
    # test_verify_resume's two-rank run (built once per session); verify-resume writes into a copy
    run = shutil.copytree(make_run(tmp_path_factory, "ddp2", ranks=2, steps=12, every=5), tmp_path / "ddp2")
    p = subprocess.run([PY, "-m", "sentinel", "verify-resume", str(run), "--from-step", "10", "--steps", "4"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "note: the log has only 2 step(s) after checkpoint 10; verifying 2" in p.stderr, p.stderr


def test_backtest_of_a_run_directory_judges_its_step_log(run_copy):
    (run_copy / "directives.jsonl").write_text('{"id": "x", "kind": "pause"}\n')
    (run_copy / "incidents.jsonl").write_text('{"id": "run-t0-s5", "rule": "loss_spike"}\n')
    res = cli("backtest", str(run_copy), "--json")
    assert res.exit_code == 0, (res.exit_code, res.stderr)
    out = json.loads(res.stdout)
    assert "traces" not in out and out["records"] == 30, list(out)
    assert out["source"]["run_settings"] == ["checkpoint every 10 steps (config.yaml)"]
    res = cli("backtest", str(run_copy), str(run_copy), "--json")
    assert res.exit_code == 0, res.stderr
    assert [t["trace"] for t in json.loads(res.stdout)["traces"]] == [str(run_copy / "steps.jsonl")] * 2


@pytest.mark.parametrize("args", [
    ["backtest", ""],
    ["backtest", "--rules", "", "x.jsonl"],
    ["incidents", "--id", "", "runs/x"],
    ["report", "runs/x", "--incident", ""],
    ["report", "runs/x", "--out", ""],
    ["status", ""],
    ["replay-batch", "", "--step", "3"],
    ["approve", ""],
    ["rules", "check", ""],
])
def test_an_empty_value_is_refused_not_read_as_dot_or_unset(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.log").write_text("step:1 train_loss:3.0\nstep:2 train_loss:2.9\n")  # what `backtest ""` judged
    res = cli(*args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "an empty value names nothing" in lines[0], (res.exit_code, res.output)
    assert lines[0].startswith("error: ") and res.stdout == ""
