"""`sentinel replay-batch` against real training runs (tiny preset, CPU): no mocks.

Runs are made once per session under pytest's base temp dir (shared with test_verify_resume.py):
* ``drop``    - 20 steps, dropout 0.1, checkpoints at 10 and 20 (the reference run);
* ``garbage`` - the same run with two samples of step 14's batch drilled to garbage tokens;
* ``ddp2``    - 2 ranks (torchrun), 12 steps, checkpoints at 5, 10, 12 (slow tests only).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel.cli import main as cli
from sentinel.client.steplog import authoritative
from tests.helpers.offline import PY, make_run

GARBAGE_STEP = 14


# ------------------------------------------------------------------------------------ fixtures


def records(run: Path) -> dict:
    return authoritative(run / "steps.jsonl")


@pytest.fixture(scope="module")
def drop_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory, "drop", "--set", "model.dropout=0.1")


@pytest.fixture(scope="module")
def garbage_run(tmp_path_factory, drop_run) -> tuple[Path, list[int]]:
    """Two of the four samples of the reference run's step 14, drilled to garbage."""
    ids = records(drop_run)[GARBAGE_STEP].sample_ids
    bad = [ids[0], ids[2]]
    faults = [a for i in bad for a in ("--inject-fault", f"garbage@{i}")]
    run = make_run(tmp_path_factory, "garbage", "--set", "model.dropout=0.1", *faults)
    return run, bad


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory, "ddp2", ranks=2, steps=12, every=5)


def invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def replay_json(*args: str) -> dict:
    r = invoke("replay-batch", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# ------------------------------------------------------------------------------------ replay


def test_replay_normal_step_is_bitwise(drop_run):
    rec = records(drop_run)[14]
    res = replay_json(drop_run, "--step", "14", "--top", "3")
    assert res["checkpoint"] == 10
    assert res["reproduced"] is True
    assert res["device"] == "cpu" and res["tolerance"] == "bitwise (==)"
    # bitwise: the floats themselves are equal, no tolerance
    assert res["replayed"]["loss"] == rec.loss == res["recorded"]["loss"]
    assert res["replayed"]["grad_norm"] == rec.grad_norm
    assert res["fast_forward"] == {"steps": 3, "matched": True, "first_mismatch": None, "checkpoint_matches_log": True}
    # a normal step has no culprits (issue 10 item 6): it says so instead of blaming the top samples
    assert res["batch"]["normal"] is True and res["culprits"] == []
    assert "batch is normal, no culprits" in res["verdict"]
    lo, hi = res["batch"]["band"]
    assert lo < rec.loss <= hi
    r = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["replay-batch", str(drop_run), "--step", "14"])
    assert r.exit_code == 0 and "batch is normal, no culprits" in " ".join(r.stdout.split())
    assert "culprits (by" not in r.stdout and max(len(ln) for ln in r.stdout.splitlines()) <= 80


def test_replay_from_an_explicit_checkpoint_right_before_the_step(drop_run):
    rec = records(drop_run)[11]
    res = replay_json(drop_run, "--step", "11", "--checkpoint", "step-00000010", "--top", "0")
    assert res["reproduced"] and res["fast_forward"]["steps"] == 0
    assert (res["replayed"]["loss"], res["replayed"]["grad_norm"]) == (rec.loss, rec.grad_norm)
    assert res["culprits"] == []


def test_replay_garbage_drill_names_the_drilled_samples(garbage_run, drop_run):
    run, bad = garbage_run
    rec = records(run)[GARBAGE_STEP]
    assert rec.loss > records(drop_run)[GARBAGE_STEP].loss + 0.5  # the drill really hurt this step
    res = replay_json(run, "--step", str(GARBAGE_STEP), "--top", "2")
    assert res["reproduced"] is True
    assert res["replayed"]["loss"] == rec.loss and res["replayed"]["grad_norm"] == rec.grad_norm
    assert sorted(c["id"] for c in res["culprits"]) == sorted(bad)
    assert all(c["loss"] > 5.0 for c in res["culprits"])
    c = res["culprits"][0]
    assert set(c) >= {"id", "loss", "grad_norm", "shard", "offset", "text"}
    assert c["shard"].endswith(".bin") and c["offset"] >= 0 and 0 < len(c["text"]) <= 81 and "\n" not in c["text"]
    # abnormal, and still abnormal on the pre-onset weights: the batch is the cause
    b = res["batch"]
    assert b["normal"] is False and b["onset"] == GARBAGE_STEP and b["is_cause"] is True
    assert b["pre_onset_checkpoint"] == 10 and b["pre_onset_loss"] > b["pre_onset_band"][1]
    r = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["replay-batch", str(run), "--step", str(GARBAGE_STEP), "--top", "2"])
    assert r.exit_code == 0 and max(len(ln) for ln in r.stdout.splitlines()) <= 80
    assert all(str(i) in r.stdout for i in bad)


SEQLEN_STEP = 16


@pytest.fixture(scope="module")
def seqlen_garbage_run(tmp_path_factory) -> tuple[Path, list[int]]:
    """A run with a seq_len schedule (16, then 32 from step 8, 64 from step 12) and two of step 16's
    ids drilled to garbage. Its ids come from the plain sampler: tiny's 4 sequences per step are
    1 id (of 64 tokens) per step up to step 8, 2 up to step 12, then 4; the schedule moves nothing."""
    from trainer.data import Sampler, TokenDataset, ensure_prepared

    ds = TokenDataset.open(ensure_prepared(tmp_path_factory.getbasetemp() / "offline-data"))
    sampler = Sampler(ds.num_samples(64), 1337, ds.fingerprint)
    sampler.next_ids(8 * 1 + 4 * 2 + 3 * 4)
    bad = sampler.next_ids(4)[0][1::2]
    faults = [a for i in bad for a in ("--inject-fault", f"garbage@{i}")]
    return make_run(tmp_path_factory, "seqlen-garbage", "--set", "data.seq_len_schedule=[[0,16],[8,32],[12,64]]", *faults), bad


def test_replay_across_a_seq_len_change_is_bitwise_and_names_the_samples(seqlen_garbage_run):
    """replay-batch restores step 10 (at 32 tokens), fast-forwards across the change to 64 at step 12,
    reproduces step 16 bitwise and ranks culprits per sample id (one model.seq_len window each)."""
    run, bad = seqlen_garbage_run
    rec = records(run)[SEQLEN_STEP]
    assert len(rec.sample_ids) == 4 and set(bad) <= set(rec.sample_ids)
    res = replay_json(run, "--step", str(SEQLEN_STEP), "--top", "2")
    assert res["checkpoint"] == 10 and res["reproduced"] is True
    assert res["fast_forward"]["steps"] == 5 and res["fast_forward"]["matched"] is True
    assert res["replayed"]["loss"] == rec.loss and res["replayed"]["grad_norm"] == rec.grad_norm
    assert sorted(c["id"] for c in res["culprits"]) == sorted(bad)
    assert res["batch"]["is_cause"] is True


LR_STEP = 12  # the drill multiplies this step's LR by 100: its update wrecks the weights, step 13's loss spikes


@pytest.fixture(scope="module")
def lr_run(tmp_path_factory, drop_run) -> Path:
    sid = records(drop_run)[LR_STEP].sample_ids[0]
    return make_run(tmp_path_factory, "lr", "--set", "model.dropout=0.1", "--inject-fault", f"lr@{sid}:100")


def test_replay_lr_spike_says_the_batch_is_not_the_cause(lr_run):
    recs = records(lr_run)
    spike = LR_STEP + 1
    assert recs[spike].loss > recs[LR_STEP].loss + 1.0 or recs[spike].skipped  # the drill really hurt
    res = replay_json(lr_run, "--step", str(spike), "--top", "3")
    assert res["reproduced"] is True
    b = res["batch"]
    assert b["normal"] is False and b["onset"] == spike
    assert b["pre_onset_checkpoint"] == 10 and b["is_cause"] is False
    assert b["pre_onset_loss"] <= b["pre_onset_band"][1]
    assert res["culprits"] == []  # innocent samples are not blamed
    assert "batch is not the cause" in res["verdict"] and "pre-onset weights" in res["verdict"]
    assert res["lr_note"] and f"step {LR_STEP}" in res["lr_note"]
    # and --skip-culprits has nothing to skip
    r = invoke("replay-batch", lr_run, "--step", str(spike), "--skip-culprits", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["skip"]["ids"] == []
    assert not (lr_run / "skiplist.json").exists() or json.loads((lr_run / "skiplist.json").read_text()) == []


def test_replay_skip_culprits_updates_the_skip_list(garbage_run, tmp_path):
    src, bad = garbage_run
    run = tmp_path / "garbage-copy"
    shutil.copytree(src, run)
    r = invoke("replay-batch", run, "--step", GARBAGE_STEP, "--top", "2", "--skip-culprits")
    assert r.exit_code == 0, r.output
    assert "reproduced" in r.stdout and "culprits" in r.stdout
    assert "skip list" in r.stdout
    ranges = json.loads((run / "skiplist.json").read_text())
    covered = {i for lo, hi in ranges for i in range(lo, hi)}
    assert set(bad) <= covered and len(covered) == 2


def test_replay_end_to_end_subprocess(drop_run):
    p = subprocess.run([PY, "-m", "sentinel", "replay-batch", str(drop_run), "--step", "20", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)  # nothing but the JSON on stdout
    rec = records(drop_run)[20]
    assert res["reproduced"] and res["replayed"]["loss"] == rec.loss and res["step"] == 20


# ------------------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def corrupt_run(drop_run, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("corrupt") / "run"
    shutil.copytree(drop_run, run)
    shutil.rmtree(run / "checkpoints" / "step-00000000")  # the initial state: a valid fallback otherwise
    with open(run / "checkpoints" / "step-00000010" / "model.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage\x00")
    return run


BAD_REPLAY = {
    "missing run": (lambda d, c, t: [t / "nope", "--step", "3"], "run directory not found"),
    "missing step": (lambda d, c, t: [d, "--step", "999"], "step 999 is not in the step log"),
    "no checkpoint": (lambda d, c, t: [c, "--step", "5"], "no valid checkpoint at or before step 4"),
    "corrupt checkpoint": (lambda d, c, t: [c, "--step", "14", "--checkpoint", "10"], "fails its checksum"),
    "only corrupt checkpoints": (lambda d, c, t: [c, "--step", "14"], "no valid checkpoint at or before step 13"),
}


@pytest.mark.parametrize("case", list(BAD_REPLAY))
def test_replay_bad_input_is_one_line_exit_2(case, drop_run, corrupt_run, tmp_path):
    argv, msg = BAD_REPLAY[case]
    r = invoke("replay-batch", *argv(drop_run, corrupt_run, tmp_path))
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit)  # no uncaught exception
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], r.output


def test_replay_bad_input_subprocess_has_no_traceback(corrupt_run):
    p = subprocess.run([PY, "-m", "sentinel", "replay-batch", str(corrupt_run), "--step", "14", "--checkpoint", "10"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "checksum" in p.stderr


# ------------------------------------------------------------------------------------ 2 ranks


@pytest.mark.slow
def test_replay_two_ranks_reproduces_loss_and_grad_norm(ddp_run):
    rec = records(ddp_run)[8]
    assert rec.world_size == 2 and len(rec.rank_losses) == 2
    res = replay_json(ddp_run, "--step", "8", "--top", "8")
    assert res["world_size"] == 2 and res["checkpoint"] == 5
    assert res["reproduced"] is True
    assert res["replayed"]["loss"] == rec.loss and res["replayed"]["grad_norm"] == rec.grad_norm
    assert res["replayed"]["rank_losses"] == rec.rank_losses
    # a normal step (issue 10 item 6): no culprits on any rank, the verdict says why
    assert res["batch"]["normal"] is True and res["culprits"] == []
    assert "batch is normal, no culprits" in res["verdict"]


@pytest.mark.slow
def test_replay_two_ranks_bad_input_is_one_line(ddp_run):
    r = invoke("replay-batch", ddp_run, "--step", "3")
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    assert r.output.strip().splitlines() == [r.output.strip()] and "no valid checkpoint at or before step 2" in r.output


# ------------------------------------------------------------------ on a copy of the shared 30-step run (base_run)


@pytest.mark.slow
def test_one_torn_line_does_not_stop_replay_and_verify(run_copy):
    log = run_copy / "steps.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    i = next(k for k, ln in enumerate(lines) if b'"step":25,' in ln)
    lines[i] = lines[i][:60] + b"\n"  # torn in the middle of the file
    log.write_bytes(b"".join(lines))
    res = invoke("replay-batch", str(run_copy), "--step", "15", "--json")
    assert res.exit_code == 0 and "skipped 1 unreadable line" in res.stderr, (res.stdout[-500:], res.stderr)
    assert json.loads(res.stdout)["step"] == 15
    res = invoke("verify-resume", str(run_copy), "--from-step", "10", "--steps", "2", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["equivalent"] is True, res.stdout[-800:]


@pytest.mark.slow
def test_a_skip_list_that_cannot_be_written_does_not_cost_the_replays_verdict(run_copy, monkeypatch):
    """A read-only run dir (the audit mounted one): before, the replay's verdict and culprits were
    lost behind `error: Read-only file system: .../.skiplist.json.tmp-15192`."""
    import errno

    import sentinel.offline.replay as replay_mod

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system", str(run_copy / ".skiplist.json.tmp-1"))

    import sentinel.cli.replay_cmd as replay_cmd

    real = replay_cmd._in_process

    def with_a_culprit(*a, **k):  # the shared run is healthy: its steps have none (a normal batch)
        res = real(*a, **k)
        res["culprits"] = [{"id": 123, "loss": 9.0, "grad_norm": None, "score": 9.0, "source": None, "shard": 0,
                            "offset": 0, "text": "x"}]
        return res

    monkeypatch.setattr(replay_cmd, "_in_process", with_a_culprit)
    monkeypatch.setattr(replay_mod, "add_to_skiplist", read_only)
    res = invoke("replay-batch", str(run_copy), "--step", "15", "--skip-culprits", "--json")
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.stdout[-1500:], res.stderr)
    out = json.loads(res.stdout)
    assert out["culprits"] and out["skip"]["status"] == "failed"
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: could not add the culprits to the skip list: Read-only file system"], res.stderr
