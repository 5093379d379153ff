"""Acceptance: SIGKILL at random moments (some inside a checkpoint write) + resume == uninterrupted run, bitwise.

Every scenario runs 2N steps uninterrupted (cached reference), then the same command with the same
``--max-steps 2N`` (the LR schedule depends on it), SIGKILLed at a seeded random step/moment, then
restarted with only ``--run-dir`` (the saved config resumes it), and compares the authoritative
StepRecords of both steps.jsonl: loss, grad_norm, param_digest, batch_fingerprint, sample ids, lr,
tokens, ... must match exactly, for every step. Always with grad accumulation 2 and a non-empty
skip list (3:40 plus a wide range so the sampler really steps over skipped ids).
"""

from __future__ import annotations

import json
import random

import pytest

from tests.helpers.cli import sentinel_proc
from tests.helpers.trainer import (
    BASE_ARGS,
    assert_one_line_error,
    assert_same_trajectory,
    checkpoint_steps,
    copy_run,
    records,
    run_and_kill,
    run_trainer,
    trajectory,
)
from trainer.checkpoint import list_checkpoints, verify

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
    step = int(kill.tmp_dirs[0].removeprefix(".tmp-step-").split(".")[0])  # .tmp-step-NNNNNNNN.K (K: the save count)
    assert step > newest  # the interrupted write is newer than any valid one
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


def test_compiled_model_kill_resume_bitwise(tmp_path, dataset, refs):
    """``--compile`` (torch.compile, inductor on the CPU): killed mid-run, resumed with only --run-dir
    (the saved config compiles again), the trajectory equals the uninterrupted compiled run's, bitwise.
    The compiled model's first loss is the eager one's up to rounding: the same weights, batch and
    checkpoint format (the module's state_dict keys do not change)."""
    n2 = 12
    rng = random.Random(31)
    ref = refs(*_ref_args(n2, 2), "--compile")
    run = tmp_path / "run"
    kill = run_and_kill(run, _args(dataset, n2, 2, "--compile"), rng=rng, kill_step=rng.randint(4, 8), data_dir=dataset)
    assert kill.killed and "compiled" in kill.output
    p = _resume(run, dataset=dataset)
    assert "compiled" in p.stdout and "Traceback" not in p.stderr
    assert_same_trajectory(ref, run, n2, f"killed at {kill.at_step}")
    eager = trajectory(refs(*_ref_args(N2, 2)))[1]["loss"]
    assert trajectory(ref)[1]["loss"] == pytest.approx(eager, rel=1e-5)
    _assert_checkpoints_valid(run)
    # the offline tools compile too (the saved config says so), and so compute what the run did
    step = sorted(s for s, _ in list_checkpoints(run / "checkpoints"))[-2]  # with steps after it in the log
    v = sentinel_proc("verify-resume", str(run), "--from-step", str(step), "--steps", "2", "--json", timeout=300)
    assert v.returncode == 0 and json.loads(v.stdout)["equivalent"] is True, v.stdout[-2000:] + v.stderr[-2000:]


@pytest.mark.slow
def test_two_rank_ddp_kill_resume_bitwise(tmp_path, dataset, refs):
    """torchrun, 2 ranks (gloo DDP), grad-accum 2, skip list: SIGKILL of the agent and both workers at a
    random moment inside a checkpoint write, resume, exact trajectory; rng-rank{0,1}.safetensors in every checkpoint."""
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
        assert {"rng-rank0.safetensors", "rng-rank1.safetensors", "train_state.json", "dcp/.metadata"} <= files
        assert "model.safetensors" not in files and any(f.startswith("dcp/") and f.endswith(".distcp") for f in files)


# ---- a seq_len schedule: resume exact on either side of a change of length

SCHEDULE = ("--set", "data.seq_len_schedule=[[0,16],[6,32],[14,64]]")  # 4, 2, then 1 sequence(s) per id


def _seq_len_markers(run_dir) -> list[tuple[int, str]]:
    return [(r.step, r.detail) for r in records(run_dir) if getattr(r, "marker", None) == "seq_len_change"]


def test_seq_len_schedule_kills_before_and_after_a_change_resume_bitwise(tmp_path, dataset, refs):
    """Lengths 16 -> 32 (step 6) -> 64 (step 14). SIGKILL before the first change (the restart crosses
    both), again after the second (the last restart loads a checkpoint taken at 64): bitwise equal to
    the uninterrupted run. The data stream is the unscheduled one: no id repeated, none skipped."""
    from trainer.data import Sampler, SkipList, TokenDataset

    ref = refs(*_ref_args(N2, 2, *SCHEDULE))
    assert _seq_len_markers(ref) == [(6, "seq_len 16->32 (128->256 tokens per step)"),
                                     (14, "seq_len 32->64 (256->512 tokens per step)")]
    steps = {s: r for s, r in trajectory(ref).items()}
    # 8 sequences per step (micro-batch 4 x grad-accum 2): 2, 4, then 8 ids of 64-token windows
    assert [len(steps[s]["sample_ids"]) for s in (1, 6, 7, 14, 15, N2)] == [2, 2, 4, 4, 8, 8]
    assert [steps[s]["batch_tokens"] for s in (6, 7, 15)] == [128, 256, 512]
    assert steps[N2]["tokens"] == sum(r["batch_tokens"] for r in steps.values() if not r["skipped"])
    ds = TokenDataset.open(dataset)
    drawn = [i for s in sorted(steps) for i in steps[s]["sample_ids"]]
    want, _ = Sampler(ds.num_samples(64), 1337, ds.fingerprint).next_ids(len(drawn), SkipList([(3, 40), (20000, 35000)]))
    assert drawn == want

    rng = random.Random(41)
    run = tmp_path / "run"
    first = run_and_kill(run, _args(dataset, N2, 2, *SCHEDULE), rng=rng, kill_step=rng.randint(2, 4), data_dir=dataset)
    second = run_and_kill(run, [], rng=rng, kill_step=rng.randint(17, 20), data_dir=dataset)
    assert first.killed and second.killed and first.at_step < 6 and second.at_step >= 17
    assert 16 <= max(checkpoint_steps(run)) < N2  # the last restart resumes from a checkpoint at seq_len 64
    state = json.loads((run / "checkpoints" / f"step-{max(checkpoint_steps(run)):08d}" / "train_state.json").read_text())
    assert (state["seq_len"], state["train_seq_len"]) == (64, 64)
    _resume(run, dataset=dataset)
    assert_same_trajectory(ref, run, N2, f"kills at {first.at_step}, {second.at_step}")
    _assert_resumed(run, [first, second])
    assert set(_seq_len_markers(run)) == set(_seq_len_markers(ref))


def test_seq_len_schedule_resume_with_another_model_seq_len_is_refused(tmp_path, refs):
    """model.seq_len (the position table, the unit of every sample id) still cannot change on resume:
    one line that points at the schedule, and the run dir is untouched."""
    run = copy_run(refs(*_ref_args(N2, 2, *SCHEDULE)), tmp_path / "run")
    before = (run / "steps.jsonl").read_bytes()
    p = run_trainer(run, "--max-steps", str(N2 + 4), "--set", "model.seq_len=32")  # the saved schedule no longer fits
    assert_one_line_error(p, contains="seq_len 64 (from step 14) must divide model.seq_len 32")
    p = run_trainer(run, "--max-steps", str(N2 + 4), "--set", "model.seq_len=32", "--set", "data.seq_len_schedule=[]")
    line = assert_one_line_error(p, contains="cannot change model.seq_len")
    assert "data.seq_len_schedule" in line
    assert (run / "steps.jsonl").read_bytes() == before


def test_seq_len_schedule_bad_value_is_one_line(tmp_path, dataset):
    p = run_trainer(tmp_path / "run", *BASE_ARGS, "--data", str(dataset), "--max-steps", "2",
                    "--set", "data.seq_len_schedule=[[0,48]]")
    assert_one_line_error(p, contains="seq_len 48 (from step 0) must divide model.seq_len 64")
    assert not (tmp_path / "run" / "steps.jsonl").exists()


@pytest.mark.slow
def test_seq_len_schedule_two_rank_ddp_kill_resume_bitwise(tmp_path, dataset, refs):
    """torchrun, 2 ranks (gloo DDP): killed before the changes, resumed across both, exact. With async
    saves, so that two ranks' writer processes meet here too (their markers, rank 0's commit; killed with
    their trainers): every checkpoint left verifies, and the trajectory is the sync reference's."""
    sched = ("--set", "data.seq_len_schedule=[[0,16],[5,32],[9,64]]")
    ref = refs(*_ref_args(N2_DIST, 2, *sched), nproc=2)
    rng = random.Random(51)
    run = tmp_path / "run"
    kill = run_and_kill(run, _args(dataset, N2_DIST, 2, *sched, "--async-ckpt"), rng=rng, kill_step=rng.randint(2, 4),
                        nproc=2, data_dir=dataset)
    assert kill.killed and kill.at_step < 5
    _resume(run, nproc=2, dataset=dataset)
    assert_same_trajectory(ref, run, N2_DIST, f"killed at {kill.at_step}")
    _assert_checkpoints_valid(run, world_size=2)
    assert [s for s, _ in _seq_len_markers(ref)] == [5, 9] and set(_seq_len_markers(run)) == set(_seq_len_markers(ref))
    assert [len(trajectory(ref)[s]["sample_ids"]) for s in (1, 6, 10)] == [4, 8, 16]  # 16 sequences per step
