"""The trainer audit of 2026-11-25 (hostile run-dir files and flags): each finding, replayed.

Before: a FIFO at ``directives.cursor`` hung the trainer's start for good (SIGTERM did not end it),
a link to /dev/zero there read until the memory ran out; a ``directives.jsonl`` line cut mid UTF-8
character (or ``[1, 2]``, ``{"id": [1]}``) was a traceback; a ``trainer.lock`` symlink made the
trainer overwrite the file it points to, outside the run; ``--set model.n_layer=1e11`` was ended by
the kernel's OOM killer with no message, and huge ``d_model`` / ``vocab_size`` / ``guard.window``
were allocator tracebacks; a guard history of NaN (under a recomputed checksum) was accepted.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from tests.helpers.trainer import copy_run, dataset, run_trainer  # noqa: F401  (dataset is a fixture)

pytestmark = pytest.mark.timeout(240)


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


def test_a_damaged_directives_log_does_not_stop_a_start(tmp_path, dataset):
    run = tmp_path / "run"
    run_trainer(run, "--preset", "tiny", "--max-steps", "3", "--data", str(dataset), data_dir=dataset, check=True)
    with open(run / "directives.jsonl", "ab") as f:
        f.write(b'{"id": "ok-1", "kind": "pause"}\n')
        f.write(b"\xff\xfe torn mid character\n")
        f.write(b"[1, 2]\n")
        f.write(b'{"id": [1]}\n')
    p = run_trainer(run, "--max-steps", "5", data_dir=dataset)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    steps = [json.loads(x) for x in (run / "steps.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in steps if r.get("kind", "step") == "step") == 5


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
    directory were all called missing ("has no meta.json", "shard ... is missing")."""
    import shutil

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
    for i, (data, said) in enumerate(cases.items()):
        p = run_trainer(tmp_path / f"run{i}", "--preset", "tiny", "--max-steps", "2", "--data", data, data_dir=dataset)
        last = [ln for ln in p.stderr.splitlines() if ln.strip()][-1]
        assert p.returncode != 0 and said in last and "Traceback" not in p.stderr, (data, p.stderr[-1500:])


def test_a_plain_file_where_the_newest_checkpoint_goes_is_named_when_passed_over(tmp_path, dataset):
    """Before: a file ``checkpoints/step-00000008`` (a copy gone wrong) was skipped in silence and the
    run resumed from step 4 with no word of it."""
    import shutil

    run = tmp_path / "run"
    run_trainer(run, "--preset", "tiny", "--max-steps", "8", "--ckpt-every", "4", "--data", str(dataset),
                data_dir=dataset, check=True)
    shutil.rmtree(run / "checkpoints" / "step-00000008")
    (run / "checkpoints" / "step-00000008").write_bytes(b"not a checkpoint")
    p = run_trainer(run, "--max-steps", "10", data_dir=dataset)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "step-00000008: is a file, not a directory (not a checkpoint); falling back" in p.stdout + p.stderr
    assert "resumed from checkpoint step 4" in p.stdout + p.stderr
