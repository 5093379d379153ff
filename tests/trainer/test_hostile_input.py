"""Hostile input to ``python -m trainer``: one line on stderr, a non-zero exit, no traceback, no hang,
and never a lost checkpoint or step record.

Flag checks run ``trainer.__main__.main`` in process (they stop before the trainer is built, so
they are fast and must leave no run dir behind); everything that needs a run dir runs the real
trainer in a subprocess, on a copy of a tiny cached run where it can (4 steps, checkpoints 0, 2, 4;
or the 12-step one, checkpoints every 4). A data dir's own errors are read in process from
``TokenDataset.open``, and one of them end to end.

Among them, what a start must survive: a FIFO at ``directives.cursor`` (it hung the start for good)
or a link to /dev/zero there (read until the memory ran out); a ``directives.jsonl`` line cut mid
UTF-8 character, or ``[1, 2]``, ``{"id": [1]}``; a ``trainer.lock`` symlink (the trainer overwrote
the file it points to, outside the run); ``--set model.n_layer=1e11`` (ended by the kernel's OOM
killer with no message) and huge ``d_model`` / ``vocab_size`` / ``guard.window``; a guard history
of NaN under a recomputed checksum; a run dir whose checkpoints are gone; a data dir or shard that
is no regular file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest

from tests.helpers.trainer import assert_one_line_error, copy_run, records, run_trainer

BASE = ("--max-steps", "4", "--ckpt-every", "2")


# ------------------------------------------------------------------ flags (in process)
def _main(capsys, *argv) -> tuple[int, str]:
    """``python -m trainer ARGV`` in process: (exit code, stderr)."""
    from trainer.__main__ import main

    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err


def _one_line(rc: int, err: str, contains: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert rc == 2, (rc, err)
    assert contains in lines[0], lines[0]
    return lines[0]


BAD_FLAGS = {
    "seed-past-int64": (["--seed", "99999999999999999999"], "seed"),
    "seed-negative": (["--seed", "-1"], "seed"),
    "set-unclosed-yaml": (["--set", "model={a: [1"], "--set model: not a valid YAML value"),
    "set-control-chars": (["--set", "seed=\x01\x02"], "--set seed: not a valid YAML value"),
    "set-surrogates": (["--set", "run_id=\udcff\udcfe"], "not valid UTF-8"),
    "set-into-a-number": (["--set", "model=5", "--set", "model.n_layer=2"], "model is not a section"),
    "lr-inf": (["--lr", "inf"], "optim.lr"),
    "lr-1e300": (["--lr", "1e300"], "optim.lr"),
    "lr-nan": (["--lr", "nan"], "optim.lr"),
    "eps-inf": (["--set", "optim.eps=.inf"], "optim.eps"),
    "weight-decay-inf": (["--set", "optim.weight_decay=1e999"], "optim.weight_decay"),
    "loss-z-inf": (["--set", "guard.loss_z=.inf"], "guard.loss_z"),
    "peak-flops-inf": (["--peak-flops", "inf"], "peak_flops"),
    "fault-factor-inf": (["--inject-fault", "lr@5:1e999"], "--inject-fault"),
    "skip-reversed": (["--skip", "5:3"], "--skip '5:3': an empty or reversed range; need 0 <= LO < HI"),
    "skip-empty": (["--skip", "5:5"], "--skip '5:5': an empty or reversed range"),
    "set-skip-reversed": (["--set", "data.skip=[[10,5]]"], "data.skip"),
    "redis-url-bad-ipv6": (["--redis-url", "redis://[::1"], "invalid bus URL"),
    "redis-url-scheme": (["--redis-url", "http://x"], "unsupported bus URL scheme"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flags_are_one_line_and_create_nothing(tmp_path, capsys, case):
    argv, contains = BAD_FLAGS[case]
    run = tmp_path / "run"
    rc, err = _main(capsys, "--run-dir", str(run), "--telemetry", "off", *argv)
    _one_line(rc, err, contains)
    assert not run.exists(), "a refused start must not leave a run dir (trainer.lock, steps.jsonl) behind"


def test_set_uses_the_safe_yaml_loader(tmp_path, capsys):
    marker = tmp_path / "pwned"
    rc, err = _main(capsys, "--run-dir", str(tmp_path / "run"), "--set", f'seed=!!python/object/apply:os.system ["touch {marker}"]')
    _one_line(rc, err, "--set seed: not a valid YAML value")
    assert not marker.exists()


def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, err = _main(capsys, "--run-dir", str(tmp_path / "run"), "--telemetry", "off", "--device", "cuda")
    _one_line(rc, err, "CUDA is not available")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["empty", "blank", "not-utf8", "too-long", "a-file"])
def test_unusable_run_dirs_are_refused_before_anything_is_created(tmp_path, capsys, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)  # "" would be the current directory
    (tmp_path / "file").write_text("x")
    run_dir, contains = {
        "empty": ("", "--run-dir is empty"),
        "blank": ("  ", "--run-dir is empty"),
        "not-utf8": (os.fsdecode(b"r\xff\xfe"), "not valid UTF-8"),
        "too-long": ("a" * 5000, "File name too long"),
        "a-file": ("file", "not a directory"),
    }[kind]
    rc, err = _main(capsys, "--run-dir", run_dir, "--telemetry", "off")
    _one_line(rc, err, contains)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"], "nothing may be created in the current directory"


# ------------------------------------------------------------------ state files (in process)
def test_step_log_escapes_lone_surrogates_instead_of_failing(tmp_path):
    from sentinel.client.steplog import StepLog, read
    from sentinel.protocol import TimelineRecord

    log = StepLog(tmp_path / "steps.jsonl", log=lambda m: None)
    log.write(TimelineRecord(kind="rollback", run="r\udcff", from_step=2, timeline=1, time=1.0, reason="\udcff\udcfe"))
    assert log.close() == 0
    (rec,) = list(read(tmp_path / "steps.jsonl"))
    assert rec.reason == "\\udcff\\udcfe" and rec.run == "r\\udcff"


def test_step_log_that_is_not_a_regular_file_is_refused(tmp_path):
    """A steps.jsonl symlinked to /dev/null would swallow every record (a FIFO would block the open)."""
    from sentinel.client.steplog import StepLog

    (tmp_path / "steps.jsonl").symlink_to("/dev/null")
    with pytest.raises(OSError, match="not a regular file"):
        StepLog(tmp_path / "steps.jsonl", log=lambda m: None)


def test_skiplist_with_a_reversed_range_is_malformed(tmp_path):
    from trainer.data import DataError, SkipList

    (tmp_path / "skiplist.json").write_text("[[10, 5]]")
    with pytest.raises(DataError, match="malformed.*empty or reversed"):
        SkipList.load(tmp_path / "skiplist.json")
    (tmp_path / "skiplist.json").write_text("[[1, 3], [3, 9]]")
    assert SkipList.load(tmp_path / "skiplist.json").ranges == [(1, 9)]


def test_checkpoints_path_that_is_a_file_is_a_checkpoint_error(tmp_path):
    """What replay-batch and verify-resume catch: one line, not a FileExistsError traceback."""
    from trainer.checkpoint import Checkpointer, CheckpointError

    (tmp_path / "checkpoints").write_text("not a dir")
    with pytest.raises(CheckpointError, match="is not a directory"):
        Checkpointer(tmp_path, rank=0, world_size=1, keep_last=1, keep_every=0,
                     barrier=lambda: None, all_ok=lambda ok: ok, log=lambda m: None)
    assert (tmp_path / "checkpoints").read_text() == "not a dir"


# ------------------------------------------------------------------ the real trainer on a copied run
def _digest_tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run(tmp_path, refs):
    base = refs(*BASE)
    assert [r.kind for r in records(base) if getattr(r, "kind", "step") == "start"] == ["start"]  # a fresh dir starts fresh
    return copy_run(base, tmp_path / "run")


def test_non_utf8_rollback_reason_does_not_break_restarts(run, dataset):
    plan = {"id": "d\udcff", "to_step": 2, "ranges": [], "reason": "\udcff\udcfe", "issuer": "cli"}
    (run / "pending_rollback.json").write_text(json.dumps(plan))  # ensure_ascii: "\udcff" escapes, as the CLI wrote
    for max_steps in ("5", "6"):  # the restart after it too
        p = run_trainer(run, "--max-steps", max_steps, data_dir=dataset, timeout=120)
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    rollback = [r for r in records(run) if getattr(r, "kind", "") == "rollback"]
    assert len(rollback) == 1 and rollback[0].reason == "\\udcff\\udcfe" and rollback[0].from_step == 2
    assert not (run / "pending_rollback.json").exists()


def test_all_checkpoints_unloadable_refuses_instead_of_starting_over(run, dataset):
    ck = run / "checkpoints"
    (ck / "step-00000004" / "manifest.json").write_bytes(b"\x00garbage{")
    for step in ("00000002", "00000000"):
        model = ck / f"step-{step}" / "model.safetensors"
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    before = _digest_tree(run / "checkpoints")
    log_before = (run / "steps.jsonl").read_bytes()
    p = run_trainer(run, "--max-steps", "8", data_dir=dataset, timeout=120)
    line = assert_one_line_error(p, rc=2, contains="none of the 3 checkpoint(s)")
    assert "step-00000004: manifest is unreadable" in line and "model.safetensors fails its checksum" in line
    assert "aside" in line and "fresh start" not in p.stdout
    assert _digest_tree(run / "checkpoints") == before, "checkpoints that failed to load must be left untouched"
    assert (run / "steps.jsonl").read_bytes() == log_before, "no new timeline may be appended"


HOSTILE_FILES = {
    "skiplist-reversed": ("skiplist.json", lambda p: p.write_text("[[10, 5]]"), "empty or reversed"),
    "skiplist-dev-zero": ("skiplist.json", lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
    "skiplist-fifo": ("skiplist.json", lambda p: os.mkfifo(p), "not a regular file"),
    "pending-fifo": ("pending_rollback.json", lambda p: os.mkfifo(p), "not a regular file"),
    "pending-reversed": ("pending_rollback.json", lambda p: p.write_text('{"to_step": 2, "ranges": [[10, 5]]}'),
                         "empty or reversed"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_hostile_state_files_are_refused_in_one_line_without_hanging(run, dataset, case):
    name, make, contains = HOSTILE_FILES[case]
    target = run / name
    target.unlink(missing_ok=True)
    make(target)
    before = _digest_tree(run / "checkpoints")
    p = run_trainer(run, "--max-steps", "6", data_dir=dataset, timeout=60)  # before the fix: read forever / OOM
    assert_one_line_error(p, rc=2, contains=contains)
    assert os.path.lexists(target), "the operator's file stays for them to fix"
    assert _digest_tree(run / "checkpoints") == before


# ------------------------------------------------------------------ run-dir files, flags and data the trainer meets at its start


def test_a_directives_cursor_that_is_no_small_regular_file_is_ignored(tmp_path):
    from sentinel.client.bus import read_cursor

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert read_cursor(fifo) is None  # before: blocked in open() for good
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")
    assert read_cursor(zero) is None  # before: read until MemoryError
    ok = tmp_path / "ok"
    ok.write_text("1700000000000-0\n")
    assert read_cursor(ok) == "1700000000000-0"


def test_the_run_lock_is_never_written_through_a_link_or_into_a_fifo(tmp_path):
    from trainer import rundir_lock

    victim = tmp_path / "victim"
    victim.write_text("IMPORTANT DATA")
    run = tmp_path / "run"
    run.mkdir()
    (run / rundir_lock.LOCK_NAME).symlink_to(victim)
    with pytest.raises(rundir_lock.RunDirBusy, match="symbolic link"):
        rundir_lock.acquire(run)
    assert victim.read_text() == "IMPORTANT DATA"
    run2 = tmp_path / "run2"
    run2.mkdir()
    os.mkfifo(run2 / rundir_lock.LOCK_NAME)
    with pytest.raises(rundir_lock.RunDirBusy, match="not a regular file"):
        rundir_lock.acquire(run2)


def test_a_guard_history_that_is_not_finite_is_refused():
    from pydantic import ValidationError

    from trainer.checkpoint_state import GuardState

    good = {"window": 8, "loss": [0.0] * 8, "grad": [1.0] * 8, "count": 3, "streak": 0}
    GuardState.model_validate(good)
    with pytest.raises(ValidationError, match="not finite"):
        GuardState.model_validate({**good, "loss": [math.nan] * 8})


@pytest.mark.parametrize("sets, says", [
    (["model.n_layer=100000000000"], "model.n_layer: Input should be less than or equal to 1024"),
    (["model.d_model=1000000000"], "less than or equal to 65536"),
    (["guard.window=1000000000000"], "less than or equal to 1000000"),
    (["model.n_layer=1024", "model.d_model=65536", "model.n_head=64"], "parameters needs ~"),
])
def test_a_model_too_large_for_the_machine_is_one_line_before_anything_is_built(tmp_path, dataset, sets, says):
    args = ["--preset", "tiny", "--max-steps", "2", "--data", str(dataset)]
    for s in sets:
        args += ["--set", s]
    p = run_trainer(tmp_path / "run", *args, data_dir=dataset, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and lines and lines[-1].startswith("error: ") and says in lines[-1], p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "run").exists(), "refused before the run dir was made"


@pytest.mark.parametrize("sets, says", [
    ({"model.attention": "triton", "model.dropout": 0.1}, "triton has no attention dropout"),
    ({"model.attention": "triton", "model.d_model": 96, "model.n_head": 2}, "power of two from 16 to 128, not 48"),
    ({"model.attention": "triton", "model.d_model": 512, "model.n_head": 2}, "not 256"),
    ({"model.attention": "flash"}, "Input should be 'sdpa' or 'triton'"),
])
def test_an_attention_kernel_that_cannot_run_the_model_is_one_line(sets, says):
    """``model.attention: triton`` (trainer/attention_triton.py) has no dropout and takes head sizes
    of 16 to 128, powers of two: anything else is refused when the config is read, not at the first
    step on a GPU."""
    from trainer.config import ConfigError, resolve

    with pytest.raises(ConfigError) as e:
        resolve(preset="tiny", config_file=None, saved=None, overrides=sets)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_damaged_directives_log_does_not_stop_a_start(run, dataset):
    with open(run / "directives.jsonl", "ab") as f:
        f.write(b'{"id": "ok-1", "kind": "pause"}\n')
        f.write(b"\xff\xfe torn mid character\n")
        f.write(b"[1, 2]\n")
        f.write(b'{"id": [1]}\n')
    p = run_trainer(run, "--max-steps", "6", data_dir=dataset)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in steps if r.get("kind", "step") == "step") == 6


def test_a_run_dir_whose_checkpoints_are_gone_is_not_started_over(tmp_path, dataset, refs):
    """steps.jsonl logs 12 steps, checkpoints/ is gone (deleted, a mount that did not come up):
    before, a fresh start appended a second history 1..12 to the log and exited 0."""
    import shutil

    run = copy_run(refs("--max-steps", "12", "--ckpt-every", "4"), tmp_path / "run")  # the session's 12-step run
    log = (run / "steps.jsonl").read_bytes()
    shutil.rmtree(run / "checkpoints")
    p = run_trainer(run, "--max-steps", "16", data_dir=dataset)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and "holds no checkpoint" in lines[-1] and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (run / "steps.jsonl").read_bytes() == log, "the log is left as it was"
    # a run that crashed before its first periodic checkpoint starts over, as before
    run2 = tmp_path / "run2"
    run_trainer(run2, "--preset", "tiny", "--max-steps", "3", "--ckpt-every", "4", "--data", str(dataset),
                data_dir=dataset, check=True)
    shutil.rmtree(run2 / "checkpoints")
    assert run_trainer(run2, "--max-steps", "5", data_dir=dataset).returncode == 0


def test_a_data_dir_or_shard_that_is_no_regular_file_is_named_as_what_it_is(tmp_path, dataset):
    """Before: a data dir that is a file or a device, a ``meta.json`` FIFO and a shard replaced by a
    directory were all called missing ("has no meta.json", "shard ... is missing"). What names each
    is the dataset's own open (``TokenDataset.open``, in process); that the trainer turns its error
    into one line and a non-zero exit is shown end to end once, on the FIFO (which must not hang it)."""
    import shutil

    from trainer.data import DataError
    from trainer.data.dataset import TokenDataset

    bad_meta = tmp_path / "fifo-meta"
    bad_meta.mkdir()
    os.mkfifo(bad_meta / "meta.json")
    bad_shard = tmp_path / "dir-shard"
    shutil.copytree(dataset, bad_shard)
    shard = json.loads((bad_shard / "meta.json").read_text())["shards"][0]["name"]
    (bad_shard / shard).unlink()
    (bad_shard / shard).mkdir()
    cases = {"/etc/hostname": "is a regular file, not a directory",
             "/dev/null": "is a character device, not a directory",
             str(bad_meta): "meta.json is not a regular file (a FIFO)",
             str(bad_shard): f"{shard} is a directory",
             str(tmp_path / "nowhere"): "does not exist (run `python -m trainer.data prepare"}
    for data, said in cases.items():
        with pytest.raises(DataError) as e:
            TokenDataset.open(data)
        assert said in str(e.value) and "\n" not in str(e.value), (data, str(e.value))
    p = run_trainer(tmp_path / "run", "--preset", "tiny", "--max-steps", "2", "--data", str(bad_meta), data_dir=dataset)
    assert_one_line_error(p, rc=2, contains=cases[str(bad_meta)])


def test_a_plain_file_where_the_newest_checkpoint_goes_is_named_when_passed_over(tmp_path, dataset, refs):
    """Before: a file ``checkpoints/step-00000012`` (a copy gone wrong) was skipped in silence and the
    run resumed from step 8 with no word of it."""
    import shutil

    run = copy_run(refs("--max-steps", "12", "--ckpt-every", "4"), tmp_path / "run")  # the session's 12-step run
    shutil.rmtree(run / "checkpoints" / "step-00000012")
    (run / "checkpoints" / "step-00000012").write_bytes(b"not a checkpoint")
    p = run_trainer(run, "--max-steps", "14", data_dir=dataset)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "step-00000012: is a file, not a directory (not a checkpoint); falling back" in p.stdout + p.stderr
    assert "resumed from checkpoint step 8" in p.stdout + p.stderr
