"""`sentinel verify-resume` against real runs: a good checkpoint passes, tampered ones are caught.

Each tampered checkpoint is a copy of a real one with one state component altered and its
manifest checksums re-written, so it still verifies as a checkpoint: only the resume semantics
can catch it, and verify-resume must name the component. Runs are shared (by name, under the
session's base temp dir) with test_replay.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sentinel.cli import main as cli
from sentinel.client.steplog import authoritative
from tests.helpers.cli import sentinel_proc, step_records
from tests.helpers.offline import PY, make_run
from tests.helpers.trainer import run_trainer
from trainer.checkpoint import CheckpointError, sha256_file, verify
from trainer.checkpoint_io import write_tensors
from trainer.piece_files import load_file

C = 10  # the checkpoint under test (the run has 10 and 20)


@pytest.fixture(scope="module")
def drop_run(tmp_path_factory) -> Path:
    """Dropout 0.1, so the RNG state matters."""
    return make_run(tmp_path_factory, "drop", "--set", "model.dropout=0.1")


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory, "ddp2", ranks=2, steps=12, every=5)


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def verify_json(*args, code: int = 0) -> dict:
    r = invoke("verify-resume", *args, "--json")
    assert r.exit_code == code, r.output
    return json.loads(r.stdout)


def verified(run: Path) -> dict:
    return json.loads((run / "checkpoints" / "verified.json").read_text())


# ------------------------------------------------------------------------------------ tampering


def _ckpt(run: Path, step: int = C) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _rewrite_manifest(ck: Path) -> None:
    m = json.loads((ck / "manifest.json").read_text())
    for name in m["files"]:
        m["files"][name] = sha256_file(ck / name)
    (ck / "manifest.json").write_text(json.dumps(m))
    try:
        verify(ck)  # checksums fine; the loader may still refuse a self-contradicting train state
    except CheckpointError as e:
        assert "train_state.json" in str(e), e


def tamper_cursor(ck: Path) -> None:
    ts = json.loads((ck / "train_state.json").read_text())
    ts["sampler"]["position"] += 1
    (ck / "train_state.json").write_text(json.dumps(ts))


def tamper_rng(ck: Path) -> None:
    st = load_file(ck / "rng-rank0.safetensors", mapped=False)
    st["torch"] = torch.Generator().manual_seed(12345).get_state()
    (ck / "rng-rank0.safetensors").unlink()
    write_tensors(ck / "rng-rank0.safetensors", st)


def tamper_optimizer(ck: Path) -> None:
    o = load_file(ck / "optim.safetensors", mapped=False)
    next(g for g in o["groups"] if g["key"] == "exp_avg")["data"].mul_(1.5)  # trainer/flat_state.py's format
    (ck / "optim.safetensors").unlink()
    write_tensors(ck / "optim.safetensors", o)


def tamper_scheduler(ck: Path) -> None:
    ts = json.loads((ck / "train_state.json").read_text())
    ts["step"] += 3
    (ck / "train_state.json").write_text(json.dumps(ts))


TAMPER = {
    "data_cursor": tamper_cursor,
    "rng": tamper_rng,
    "optimizer": tamper_optimizer,
    "scheduler": tamper_scheduler,
}


# ------------------------------------------------------------------------------------ tests


def test_good_checkpoint_is_equivalent(drop_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(drop_run, run)
    res = verify_json(run, "--from-step", C, "--steps", "4")
    assert res["equivalent"] is True and res["ok"] is True and res["first_divergence"] is None
    assert res["steps"] == 4 and res["reference"] == "log" and res["tolerance"] == "bitwise (==)"
    recs = authoritative(run / "steps.jsonl")
    for row in res["rows"]:
        rec = recs[row["step"]]
        assert row["mismatch"] == []
        assert (row["loss"], row["grad_norm"], row["param_digest"], row["batch_fingerprint"]) == \
            (rec.loss, rec.grad_norm, rec.param_digest, rec.batch_fingerprint)
    rt = res["round_trip"]
    assert rt["identical"] and set(rt["components"]) == {"model.safetensors", "optim.safetensors", "train_state.json", "rng-rank0.safetensors"}
    assert res["checks"]["params_match_log_at_checkpoint"] and res["checks"]["optimizer_step_count_ok"]
    assert verified(run)[str(C)]["verified"] == "resume_verified"


def test_human_output_and_step_cap(drop_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(drop_run, run)
    r = invoke("verify-resume", run, "--from-step", "step-00000010", "--steps", "50")
    assert r.exit_code == 0, r.output
    assert "equivalent" in r.stdout and "save->load->save" in r.stdout and "resume_verified" in r.stdout
    assert "verifying 10" in r.output  # capped at what the log has (steps 11..20)


def test_drill_makes_its_own_reference(drop_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(drop_run, run)
    res = verify_json(run, "--from-step", "20", "--steps", "3", "--drill")  # the log ends at 20
    assert res["equivalent"] and res["steps"] == 3 and res["reference"].startswith("in-memory uninterrupted run from checkpoint 10")
    assert res["checks"]["params_match_log_at_checkpoint"] is True


def test_resume_across_a_seq_len_change_is_equivalent(tmp_path_factory, tmp_path):
    """A run with data.seq_len_schedule (16, 32 from step 8, 64 from step 12): resuming checkpoint 10
    (trained at 32) and running across the change to 64 matches the log bitwise, and the state
    records the length its step trained at."""
    run = tmp_path / "run"
    shutil.copytree(make_run(tmp_path_factory, "seqlen", "--set", "model.dropout=0.1",
                             "--set", "data.seq_len_schedule=[[0,16],[8,32],[12,64]]"), run)
    state = json.loads((_ckpt(run) / "train_state.json").read_text())
    assert (state["seq_len"], state["train_seq_len"]) == (64, 32)
    res = verify_json(run, "--from-step", C, "--steps", "6")
    assert res["equivalent"] is True and res["steps"] == 6 and res["round_trip"]["identical"]
    recs = authoritative(run / "steps.jsonl")
    assert [len(recs[row["step"]].sample_ids) for row in res["rows"]] == [2, 2, 4, 4, 4, 4]  # 32, then 64 tokens


def test_the_initial_checkpoint_is_equivalent(tmp_path_factory, tmp_path):
    """Checkpoint 0 (the state a fresh start saves before step 1) resumes as that fresh start: it
    trained at no length yet, so the reloaded state must not claim one (it came back as
    model.seq_len, failed the save->load->save check and was marked ``failed``, which took it out
    of the rollback targets), and no seq_len_change is invented at step 1 of a schedule."""
    run = tmp_path / "run"
    shutil.copytree(make_run(tmp_path_factory, "seqlen", "--set", "model.dropout=0.1",
                             "--set", "data.seq_len_schedule=[[0,16],[8,32],[12,64]]"), run)
    assert json.loads((_ckpt(run, 0) / "train_state.json").read_text())["train_seq_len"] is None
    res = verify_json(run, "--from-step", "0", "--steps", "9")
    assert res["equivalent"] is True and res["round_trip"]["identical"], res["round_trip"]
    assert verified(run)["0"]["verified"] == "resume_verified"


@pytest.mark.parametrize("component", list(TAMPER))
def test_tampered_checkpoint_is_caught_and_named(component, drop_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(drop_run, run)
    TAMPER[component](_ckpt(run))
    _rewrite_manifest(_ckpt(run))
    res = verify_json(run, "--from-step", C, "--steps", "3", code=1)
    assert res["equivalent"] is False and res["ok"] is False
    d = res["first_divergence"]
    assert d["component"] == component, d
    # the first resumed step, or the checkpoint itself when the trainer refuses its saved state
    assert d["step"] == C + 1 or (d["step"] == C and "refuses to resume" in d["reason"]), d
    assert verified(run)[str(C)]["verified"] == "failed"
    # the human view names the suspect too, and exits 1
    r = invoke("verify-resume", run, "--from-step", C, "--steps", "2")
    assert r.exit_code == 1 and "NOT equivalent" in r.stdout and "suspect:" in r.stdout


def tamper_scheduler_block(ck: Path) -> None:
    """Only the checkpoint's scheduler record: the trainer derives the LR from the step counter and
    rewrites this block on save, so the resumed steps match and only the round trip can tell."""
    ts = json.loads((ck / "train_state.json").read_text())
    ts["scheduler"]["step"] += 3
    (ck / "train_state.json").write_text(json.dumps(ts))


def test_tampered_scheduler_record_is_not_equivalent_and_named(drop_run, tmp_path):
    """Issue 10 item 6: it used to print "equivalent" and exit 1. Never both."""
    run = tmp_path / "run"
    shutil.copytree(drop_run, run)
    tamper_scheduler_block(_ckpt(run))
    _rewrite_manifest(_ckpt(run))
    res = verify_json(run, "--from-step", C, "--steps", "2", code=1)
    assert res["equivalent"] is False and res["ok"] is False
    assert res["first_divergence"]["component"] == "scheduler", res["first_divergence"]
    d = res["first_divergence"]
    assert "scheduler" in d["fields"][0] or "scheduler step" in d["reason"], d  # named, whoever caught it
    r = invoke("verify-resume", run, "--from-step", C, "--steps", "2")
    assert r.exit_code == 1
    out = " ".join(r.stdout.split())
    assert "NOT equivalent" in out and "scheduler" in out
    assert "equivalent: the resumed run" not in out


def test_verify_table_fits_80_columns(drop_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(drop_run, run)
    r = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["verify-resume", str(run), "--from-step", str(C), "--steps", "2"])
    assert r.exit_code == 0, r.output
    assert max(len(ln) for ln in r.stdout.splitlines()) <= 80
    assert "…" not in r.stdout  # nothing cut off
    for col in ("step", "loss", "grad norm", "match"):
        assert col in r.stdout


# ------------------------------------------------------------------------------------ bad input


@pytest.fixture(scope="module")
def corrupt_run(drop_run, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("corrupt-v") / "run"
    shutil.copytree(drop_run, run)
    with open(_ckpt(run) / "optim.safetensors", "r+b") as f:
        f.seek(64)
        f.write(b"\xffbroken\xff")
    return run


BAD = {
    "missing run": (lambda d, c, t: [t / "nope", "--from-step", "10"], "run directory not found"),
    "not a run dir": (lambda d, c, t: [t, "--from-step", "10"], "is not a run directory"),
    "missing step": (lambda d, c, t: [d, "--from-step", "7"], "no checkpoint at step 7"),
    "no steps after": (lambda d, c, t: [d, "--from-step", "20"], "no steps after checkpoint 20"),
    "corrupt checkpoint": (lambda d, c, t: [c, "--from-step", "10"], "fails its checksum"),
    "bad checkpoint id": (lambda d, c, t: [d, "--from-step", "ten"], "expected a step number"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_verify_bad_input_is_one_line_exit_2(case, drop_run, corrupt_run, tmp_path):
    argv, msg = BAD[case]
    r = invoke("verify-resume", *argv(drop_run, corrupt_run, tmp_path))
    assert r.exit_code == 2, r.output
    assert isinstance(r.exception, SystemExit)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], r.output


def test_verify_bad_input_subprocess_has_no_traceback(corrupt_run):
    p = subprocess.run([PY, "-m", "sentinel", "verify-resume", str(corrupt_run), "--from-step", "10", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == ""
    assert "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0 and "checksum" in p.stderr


# ------------------------------------------------------------------------------------ 2 ranks


@pytest.mark.slow
def test_two_ranks_resume_is_equivalent(ddp_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ddp_run, run)
    p = subprocess.run([PY, "-m", "sentinel", "verify-resume", str(run), "--from-step", "5", "--steps", "4", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(p.stdout)
    assert res["world_size"] == 2 and res["equivalent"] and res["ok"] and res["steps"] == 4
    assert set(res["round_trip"]["components"]) == {"model.safetensors", "optim.safetensors", "train_state.json", "rng-rank0.safetensors", "rng-rank1.safetensors"}
    assert verified(run)["5"]["verified"] == "resume_verified"


@pytest.mark.slow
def test_two_ranks_tampered_cursor_is_caught(ddp_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ddp_run, run)
    tamper_cursor(_ckpt(run, 5))
    _rewrite_manifest(_ckpt(run, 5))
    r = invoke("verify-resume", run, "--from-step", "5", "--steps", "2", "--json")
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["first_divergence"]["component"] == "data_cursor"


# ------------------------------------------------------------------ on a copy of the shared 30-step run (base_run), and the two-rank run


@pytest.mark.slow
def test_a_train_state_that_breaks_its_schema_is_named_as_such(run_copy):
    import hashlib

    ck = run_copy / "checkpoints" / "step-00000020"
    ts = json.loads((ck / "train_state.json").read_text())
    del ts["run"]
    (ck / "train_state.json").write_text(json.dumps(ts))
    m = json.loads((ck / "manifest.json").read_text())
    m["files"]["train_state.json"] = hashlib.sha256((ck / "train_state.json").read_bytes()).hexdigest()
    (ck / "manifest.json").write_text(json.dumps(m))
    res = invoke("verify-resume", str(run_copy), "--from-step", "20", "--steps", "2", "--json")
    first = json.loads(res.stdout)["first_divergence"]
    assert res.exit_code == 1 and first["component"] == "train_state", first


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
