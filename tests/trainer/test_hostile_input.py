"""Hostile input to ``python -m trainer``: one line on stderr, a non-zero exit, no traceback, no hang,
and never a lost checkpoint or step record.

Flag checks run ``trainer.__main__.main`` in process (they stop before the trainer is built, so
they are fast and must leave no run dir behind); everything that needs a run dir runs the real
trainer in a subprocess on a copy of one tiny cached run (4 steps, checkpoints 0, 2, 4).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.helpers.trainer import (  # noqa: F401  (fixtures)
    assert_one_line_error,
    copy_run,
    dataset,
    records,
    refs,
    run_trainer,
)

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
        model = ck / f"step-{step}" / "model.pt"
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    before = _digest_tree(run / "checkpoints")
    log_before = (run / "steps.jsonl").read_bytes()
    p = run_trainer(run, "--max-steps", "8", data_dir=dataset, timeout=120)
    line = assert_one_line_error(p, rc=2, contains="none of the 3 checkpoint(s)")
    assert "step-00000004: manifest is unreadable" in line and "model.pt fails its sha256 check" in line
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
