"""Acceptance: SIGKILL at random moments (some inside a checkpoint write) + resume == uninterrupted run, bitwise.

Every scenario runs 2N steps uninterrupted (cached reference), then the same command with the same
``--max-steps 2N`` (the LR schedule depends on it), SIGKILLed at a seeded random step/moment, then
restarted with only ``--run-dir`` (the saved config resumes it), and compares the authoritative
StepRecords of both steps.jsonl: loss, grad_norm, param_digest, batch_fingerprint, sample ids, lr,
tokens, ... must match exactly, for every step. Always with grad accumulation 2 and a non-empty
skip list (3:40 plus a wide range so the sampler really steps over skipped ids).
"""

from __future__ import annotations

import random

import pytest

from trainer.checkpoint import list_checkpoints, verify
from trainer_helpers import (  # noqa: F401  (fixtures)
    BASE_ARGS,
    assert_same_trajectory,
    dataset,
    records,
    refs,
    run_and_kill,
    run_trainer,
)

N2 = 24  # 2N steps, single rank
N2_DIST = 16  # 2N steps, 2 ranks (torchrun startup dominates)
COMMON = ["--grad-accum", "2", "--skip", "3:40", "--skip", "20000:35000"]


def _args(dataset, n2: int, ckpt_every: int, *extra: str) -> list[str]:
    return [*BASE_ARGS, "--data", str(dataset), "--max-steps", str(n2), "--ckpt-every", str(ckpt_every), *COMMON, *extra]


def _ref_args(n2: int, ckpt_every: int, *extra: str) -> list[str]:
    return ["--max-steps", str(n2), "--ckpt-every", str(ckpt_every), *COMMON, *extra]


def _resume(run_dir, *, nproc=1, dataset=None):
    """Plain restart: only --run-dir; the saved config.yaml supplies everything else."""
    return run_trainer(run_dir, nproc=nproc, data_dir=dataset, check=True)


def _assert_resumed(run_dir, kills) -> None:
    recs = records(run_dir)
    marks = [r for r in recs if getattr(r, "kind", "step") not in ("step", "marker")]  # resume/rollback/start
    assert marks[0].kind == "start" and marks[0].from_step == 0
    # one timeline marker per (re)start, each a new timeline
    assert len(marks) == 1 + len(kills)
    assert [m.timeline for m in marks] == list(range(len(marks)))
    for m in marks[1:]:
        assert m.kind in ("resume", "start")
        if m.kind == "resume":
            assert m.checkpoint == f"step-{m.from_step:08d}"


def _assert_checkpoints_valid(run_dir, world_size: int = 1) -> None:
    cks = list_checkpoints(run_dir / "checkpoints")
    assert cks, "no checkpoints"
    for step, path in cks:
        man = verify(path)
        assert man["step"] == step and man["world_size"] == world_size
    assert not list((run_dir / "checkpoints").glob(".tmp-*")), "partial checkpoint dir left behind"


@pytest.mark.parametrize("seed", [0, 1])
def test_single_rank_random_kills_resume_bitwise(tmp_path, dataset, refs, seed):
    """Two SIGKILLs at seeded random moments (each one either mid-step or mid-checkpoint-write), then
    resume to the end: the trajectory equals the uninterrupted run's, bitwise."""
    rng = random.Random(1000 + seed)
    ref = refs(*_ref_args(N2, 2))
    run = tmp_path / "run"
    args = _args(dataset, N2, 2)
    kills = []
    lo = 2
    for _ in range(2):
        k = rng.randint(lo, lo + 7)
        kill = run_and_kill(run, args if not kills else [], rng=rng, kill_step=k, data_dir=dataset,
                            during_checkpoint=rng.random() < 0.5)
        assert kill.killed, f"run finished before the kill at step {k} (seed {seed})"
        kills.append(kill)
        lo = kill.at_step + 1
    _resume(run, dataset=dataset)
    assert_same_trajectory(ref, run, N2, f"seed {seed}, kills {[(k.at_step, k.tmp_dirs) for k in kills]}")
    _assert_resumed(run, kills)
    _assert_checkpoints_valid(run)


def test_single_rank_kill_inside_checkpoint_write(tmp_path, dataset, refs):
    """--ckpt-every 1 and the kill fires the moment a .tmp-step-* dir appears: the write is cut midway,
    the partial dir is ignored and cleaned, and the resumed trajectory is still exact."""
    rng = random.Random(7)
    ref = refs(*_ref_args(N2, 1))
    landed = None
    for attempt in range(4):  # the write window is a few ms: retry until a kill lands inside one
        run = tmp_path / f"run{attempt}"
        kill = run_and_kill(run, _args(dataset, N2, 1), rng=rng, kill_step=rng.randint(3, 14),
                            data_dir=dataset, during_checkpoint=True)
        assert kill.killed
        if kill.tmp_dirs:
            landed = run
            break
    assert landed is not None, "no kill landed inside a checkpoint write in 4 attempts"
    newest = max(s for s, _ in list_checkpoints(landed / "checkpoints"))
    assert int(kill.tmp_dirs[0].rsplit("-", 1)[1]) > newest  # the interrupted write is newer than any valid one
    p = _resume(landed, dataset=dataset)
    assert "Traceback" not in p.stderr
    assert_same_trajectory(ref, landed, N2, f"killed at {kill.at_step} in {kill.tmp_dirs}")
    _assert_checkpoints_valid(landed)


def test_async_checkpoint_kill_resume_bitwise(tmp_path, dataset, refs):
    """--async-ckpt writes in the background: killed mid-run (during a background write), resumed, the
    trajectory equals the synchronous reference, and every checkpoint left verifies."""
    rng = random.Random(11)
    ref = refs(*_ref_args(N2, 2))
    run = tmp_path / "run"
    kill = run_and_kill(run, _args(dataset, N2, 2, "--async-ckpt"), rng=rng, kill_step=rng.randint(5, 14),
                        data_dir=dataset, during_checkpoint=True)
    assert kill.killed
    _resume(run, dataset=dataset)
    assert_same_trajectory(ref, run, N2, f"killed at {kill.at_step} in {kill.tmp_dirs}")
    _assert_checkpoints_valid(run)


@pytest.mark.slow
def test_two_rank_ddp_kill_resume_bitwise(tmp_path, dataset, refs):
    """torchrun, 2 ranks (gloo DDP), grad-accum 2, skip list: SIGKILL of the agent and both workers at a
    random moment inside a checkpoint write, resume, exact trajectory; rng-rank{0,1}.pt in every checkpoint."""
    rng = random.Random(21)
    ref = refs(*_ref_args(N2_DIST, 2), nproc=2)
    run = tmp_path / "run"
    kill = run_and_kill(run, _args(dataset, N2_DIST, 2), rng=rng, kill_step=rng.randint(4, 10), nproc=2,
                        data_dir=dataset, during_checkpoint=True)
    assert kill.killed
    _resume(run, nproc=2, dataset=dataset)
    assert_same_trajectory(ref, run, N2_DIST, f"killed at {kill.at_step} in {kill.tmp_dirs}")
    _assert_resumed(run, [kill])
    _assert_checkpoints_valid(run, world_size=2)
    assert all(len(r.rank_losses) == 2 for r in records(run) if getattr(r, "kind", "") == "step")


@pytest.mark.slow
def test_fsdp_two_rank_kill_resume_bitwise(tmp_path, dataset, refs):
    """FSDP2 (fully_shard) with 2 ranks: DCP shards in the checkpoint, killed at a random step, exact resume."""
    rng = random.Random(31)
    ref = refs(*_ref_args(N2_DIST, 2, "--fsdp"), nproc=2)
    run = tmp_path / "run"
    kill = run_and_kill(run, _args(dataset, N2_DIST, 2, "--fsdp"), rng=rng, kill_step=rng.randint(4, 10), nproc=2,
                        data_dir=dataset)
    assert kill.killed
    _resume(run, nproc=2, dataset=dataset)
    assert_same_trajectory(ref, run, N2_DIST, f"killed at {kill.at_step} in {kill.tmp_dirs}")
    _assert_resumed(run, [kill])
    _assert_checkpoints_valid(run, world_size=2)
    for _, path in list_checkpoints(run / "checkpoints"):
        files = set(verify(path)["files"])
        assert {"rng-rank0.pt", "rng-rank1.pt", "train_state.json", "dcp/.metadata"} <= files
        assert "model.pt" not in files and any(f.startswith("dcp/") and f.endswith(".distcp") for f in files)
