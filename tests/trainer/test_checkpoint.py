"""Acceptance: checkpoint layout, retention, corruption fallback, weights_only loading, disk-full safety, async.

All through the real trainer CLI (subprocesses), plus a few direct calls into ``trainer.checkpoint``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import blake3
import pytest
import torch

from tests.helpers import python_c
from tests.helpers.trainer import (
    BASE_ARGS,
    REPO,
    assert_same_trajectory,
    checkpoint_steps,
    copy_run,
    records,
    run_trainer,
)
from trainer import flat_state
from trainer.checkpoint import CheckpointError, list_checkpoints, verify, write_json
from trainer.checkpoint_io import write_tensors
from trainer.piece_files import legacy_name, load_file, load_torch

COMMON = ["--grad-accum", "2", "--skip", "3:40", "--skip", "20000:35000"]
REF12 = ["--max-steps", "12", "--ckpt-every", "4", *COMMON]  # checkpoints at 4, 8, 12


def _sha(p: Path) -> str:
    """A file's checksum as a manifest records it, computed here independently of the trainer's code."""
    return "blake3:" + blake3.blake3(p.read_bytes()).hexdigest()


def _check_layout(ck: Path, step: int, world_size: int, *, dcp: bool = False) -> dict:
    assert re.fullmatch(r"step-\d{8}", ck.name) and int(ck.name[5:]) == step
    man = json.loads((ck / "manifest.json").read_text())
    assert man["step"] == step and man["world_size"] == world_size and man["format"] == 1
    on_disk = {p.relative_to(ck).as_posix() for p in ck.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(man["files"]) == on_disk, "manifest must list every file, and only those"
    for name, digest in man["files"].items():
        assert _sha(ck / name) == digest, f"{name}: checksum mismatch"
    assert man["bytes"] == sum((ck / n).stat().st_size for n in man["files"])
    expect = {"train_state.json", *(f"rng-rank{r}.safetensors" for r in range(world_size))}
    expect |= set() if dcp else {"model.safetensors", "optim.safetensors"}
    assert expect <= on_disk, f"missing {expect - on_disk}"
    ts = json.loads((ck / "train_state.json").read_text())
    assert ts["step"] == step and ts["world_size"] == world_size and ts["grad_accum_pos"] == 0
    for key in ("tokens", "timeline", "sampler", "skiplist", "guard", "scheduler", "dataset_fingerprint"):
        assert key in ts, key
    assert [3, 40] in ts["skiplist"]
    for r in range(world_size):  # RNG state is plain tensors, in a tensor file
        st = load_file(ck / f"rng-rank{r}.safetensors")
        assert isinstance(st["torch"], torch.Tensor)
    return man


def test_layout_single_rank(refs):
    run = refs(*REF12)
    cks = list_checkpoints(run / "checkpoints")
    assert [s for s, _ in cks] == [12, 8, 4]
    for step, path in cks:
        _check_layout(path, step, 1)
        assert verify(path)["step"] == step
    assert not list((run / "checkpoints").glob(".tmp-*"))
    sd = load_file(cks[0][1] / "model.safetensors")
    assert all(isinstance(v, torch.Tensor) for v in sd.values())


@pytest.mark.slow
def test_layout_two_ranks(refs):
    """2-rank DDP: one rng-rank{r}.safetensors per rank, model/optim once (same reference run as test_resume_exact)."""
    run = refs("--max-steps", "16", "--ckpt-every", "2", *COMMON, nproc=2)
    cks = list_checkpoints(run / "checkpoints")
    assert [s for s, _ in cks] == [16, 14, 12]  # default keep_last 3
    for step, path in cks:
        _check_layout(path, step, 2)
    r0 = load_file(cks[0][1] / "rng-rank0.safetensors")["torch"]
    r1 = load_file(cks[0][1] / "rng-rank1.safetensors")["torch"]
    assert not torch.equal(r0, r1), "each rank has its own RNG stream"


def test_retention_keep_last_and_every(tmp_path, dataset):
    run = tmp_path / "run"
    run_trainer(run, *BASE_ARGS, "--data", str(dataset), "--max-steps", "20", "--ckpt-every", "1",
                "--keep-last", "3", "--keep-every", "5", data_dir=dataset, check=True)
    assert checkpoint_steps(run) == [5, 10, 15, 18, 19, 20]
    for _step, path in list_checkpoints(run / "checkpoints"):
        verify(path)


def test_initial_checkpoint_is_a_rollback_target_that_replays_bitwise(tmp_path, dataset, refs):
    """A fresh start saves the initial state (step 0) too, so damage before the first periodic save
    can be rolled back instead of only paged. Rolling back to it and training again reproduces the
    run that never stopped, bit for bit; ``checkpoint.initial=false`` opts out."""
    args = ["--max-steps", "8", "--ckpt-every", "4", *COMMON]
    ref = refs(*args)
    assert checkpoint_steps(ref) == [0, 4, 8]
    _check_layout(ref / "checkpoints" / "step-00000000", 0, 1)
    run = copy_run(ref, tmp_path / "run")
    p = subprocess.run([sys.executable, "-m", "sentinel", "rollback", str(run), "--to-step", "0", "--yes",
                        "--reason", "drill", "--json"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["plan"]["steps_lost"] == 8
    run_trainer(run, data_dir=dataset, check=True)
    marks = [r for r in records(run) if getattr(r, "kind", "step") == "rollback"]
    assert len(marks) == 1 and marks[0].from_step == 0
    assert_same_trajectory(ref, run, 8, "rolled back to the initial checkpoint")

    off = tmp_path / "off"
    run_trainer(off, *BASE_ARGS, "--data", str(dataset), *args, "--set", "checkpoint.initial=false",
                data_dir=dataset, check=True)
    assert checkpoint_steps(off) == [4, 8]
    assert_same_trajectory(ref, off, 8, "saving the initial state changes nothing in training")


def test_async_checkpoints_valid_and_retained(tmp_path, dataset, refs):
    """--async-ckpt: every kept checkpoint verifies and holds the same state as a synchronous save."""
    run = tmp_path / "run"
    run_trainer(run, *BASE_ARGS, "--data", str(dataset), *REF12, "--async-ckpt", "--keep-last", "2",
                "--keep-every", "8", data_dir=dataset, check=True)
    # the async run's trajectory is the synchronous one; its checkpoints hold the same tensors
    ref = refs(*REF12)
    assert_same_trajectory(ref, run, 12)
    assert checkpoint_steps(run) == [8, 12]
    for step, path in list_checkpoints(run / "checkpoints"):
        _check_layout(path, step, 1)
        for name in ("model.safetensors", "optim.safetensors"):
            a = load_file(path / name)
            b = load_file(ref / "checkpoints" / path.name / name)
            assert repr(_flat(a)) == repr(_flat(b)), f"{path.name}/{name} differs from the synchronous save"


def _flat(obj):
    if isinstance(obj, torch.Tensor):
        return (str(obj.dtype), tuple(obj.shape), hashlib.sha256(obj.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
    if isinstance(obj, dict):
        return {k: _flat(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_flat(v) for v in obj]
    return obj


def _flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size // 2)


CORRUPTIONS = {
    "flip-model": (lambda ck: _flip_byte(ck / "model.safetensors"), "model.safetensors"),
    "truncate-optim": (lambda ck: _truncate(ck / "optim.safetensors"), "optim.safetensors"),
    "delete-manifest": (lambda ck: (ck / "manifest.json").unlink(), "manifest"),
    "flip-rng": (lambda ck: _flip_byte(ck / "rng-rank0.safetensors"), "rng-rank0.safetensors"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_newest_checkpoint_falls_back_and_stays_exact(tmp_path, dataset, refs, kind):
    ref = refs(*REF12)
    run = copy_run(ref, tmp_path / "run")
    corrupt, what = CORRUPTIONS[kind]
    corrupt(run / "checkpoints" / "step-00000012")
    with pytest.raises(CheckpointError):
        verify(run / "checkpoints" / "step-00000012")
    p = run_trainer(run, data_dir=dataset, check=True)
    out = p.stdout + p.stderr
    assert "Traceback" not in out
    warn = [ln for ln in out.splitlines() if "step-00000012" in ln]
    assert len(warn) == 1, f"the corrupt checkpoint must be reported in exactly one line:\n{out}"
    assert what in warn[0] and "falling back" in warn[0], warn[0]
    assert "resumed from checkpoint step 8" in out
    marks = [r for r in records(run) if getattr(r, "kind", "") == "resume"]
    assert [m.from_step for m in marks] == [8]
    assert_same_trajectory(ref, run, 12)  # steps 9..12 re-run from step 8, bitwise as before
    verify(run / "checkpoints" / "step-00000012")  # re-saved (the corrupt dir swapped out)
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith((".tmp", ".trash"))]


def _flip_header_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[8] ^= 0xFF  # the first byte of a tensor file's JSON header: its parser refuses it
    p.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("file, damage, found_by", [
    ("model.safetensors", _flip_byte, 1),  # rank 1's share of the checksums: rank 0 parses it unverified, and passes
    ("model.safetensors", _flip_header_byte, 1),  # rank 0's parser refuses it too: the checksum is what is said
    ("optim.safetensors", _flip_byte, 0),  # rank 0's own share
], ids=["other-rank", "other-rank-header", "own-share"])
def test_two_ranks_fall_back_together_from_a_file_only_one_rank_would_catch(tmp_path, dataset, refs, file, damage, found_by):
    """2 ranks, the newest checkpoint's model or optimizer file corrupt. Each rank hashes a share of the
    files (``checksum_share``: on ``tiny``, rank 0 the optimizer's, rank 1 the rest) and parses what it
    restores; one vote turns the checkpoint down before either applies a byte. Rank 0 (which logs) names
    the file even when rank 1 found it, a checksum's failure before its own parser's, and both ranks fall
    back to the same checkpoint: the run stays bitwise exact."""
    ref = refs("--max-steps", "16", "--ckpt-every", "2", *COMMON, nproc=2)
    run = copy_run(ref, tmp_path / "run")
    damage(run / "checkpoints" / "step-00000016" / file)
    out = (p := run_trainer(run, nproc=2, data_dir=dataset, check=True)).stdout + p.stderr
    assert "Traceback" not in out
    warn = [ln for ln in out.splitlines() if "step-00000016" in ln and "falling back" in ln]
    assert len(warn) == 1, out
    assert f"{file} fails its checksum" in warn[0], warn[0]
    assert ("(on rank 1)" in warn[0]) == (found_by == 1), warn[0]
    assert "resumed from checkpoint step 14" in out
    assert_same_trajectory(ref, run, 16)


class _Evil:
    """Unpickling this runs ``touch MARKER`` — unless the loader refuses arbitrary globals."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_loading_uses_weights_only_after_verify():
    """No pickle in a checkpoint the trainer writes (tensor files: a JSON header and raw bytes); every
    torch.load left (checkpoints of torch's format, written before) passes weights_only=True, and the
    trainer reads its checkpoints back through one loader."""
    srcs = {p: p.read_text() for p in (REPO / "trainer").rglob("*.py")}
    calls = [(p, m) for p, s in srcs.items() for m in re.finditer(r"torch\.load\(([^)]*)\)", s)]
    assert calls
    for p, m in calls:
        assert "weights_only=True" in m.group(1), f"{p}: torch.load without weights_only=True: {m.group(0)}"
    loader = srcs[REPO / "trainer" / "checkpointing.py"]  # where the trainer reads its checkpoints back
    assert "load_file(" in loader and "torch.load(" not in loader
    tensor_files = srcs[REPO / "trainer" / "tensor_file.py"].split('"""', 2)[2]  # its code, past the docstring
    assert "pickle" not in tensor_files and "torch.load(" not in tensor_files


def test_load_torch_refuses_pickled_object(tmp_path):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "model.pt"
    torch.save({"w": _Evil(marker)}, evil)
    with pytest.raises((CheckpointError, Exception)) as ei:
        load_torch(evil)
    assert not marker.exists(), "weights_only must not execute pickled code"
    assert isinstance(ei.value, CheckpointError), f"expected a one-line CheckpointError, got {ei.value!r}"


def _to_legacy(ck: Path) -> None:
    """Rewrite checkpoint ``ck`` as one written before tensor files: each piece a ``.pt`` of torch's format."""
    for f in sorted(ck.glob("*.safetensors")):
        obj = load_file(f, mapped=False)
        torch.save(obj, ck / legacy_name(f.name))
        f.unlink()
    man = json.loads((ck / "manifest.json").read_text())
    man["files"] = {p.name: _sha(p) for p in ck.iterdir() if p.is_file() and p.name != "manifest.json"}
    (ck / "manifest.json").write_text(json.dumps(man))


def test_planted_pickle_with_matching_manifest_is_refused(tmp_path, dataset, refs):
    """A checkpoint of torch's format (written before tensor files) still loads through weights_only. A
    malicious model.pt whose checksum IS in the manifest passes verification but not weights_only: no
    code runs, the checkpoint is reported in one line and the run falls back to the previous one."""
    run = copy_run(refs(*REF12), tmp_path / "run")
    ck = run / "checkpoints" / "step-00000012"
    _to_legacy(ck)
    marker = tmp_path / "PWNED"
    torch.save({"w": _Evil(marker)}, ck / "model.pt")
    _resign(ck)
    verify(ck)  # the checksum matches: only weights_only stands between the file and code execution
    p = run_trainer(run, data_dir=dataset, check=True)
    assert not marker.exists(), "pickled code ran while loading a checkpoint"
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out[-3000:]
    warn = [ln for ln in out.splitlines() if "step-00000012" in ln]
    assert len(warn) == 1 and warn[0].startswith("warning: ") and "weights_only" in warn[0], out
    assert "resumed from checkpoint step 8" in out


def test_the_ranks_of_a_node_share_the_checksums_but_each_hashes_torch_files_it_reads(tmp_path, refs):
    """``verify_share`` on the two ranks of a node: the tensor files and JSON split between them (each
    parses the other's unverified, and the load's vote covers it), every file hashed once; a checkpoint
    of torch's format is hashed whole by each rank, since ``torch.load`` never opens bytes its reader did
    not hash itself. Both see the same files (one fingerprint)."""
    from trainer.checkpoint import verify_share

    run = copy_run(refs(*REF12), tmp_path / "run")
    ck = run / "checkpoints" / "step-00000012"

    def hashed(rank: int) -> tuple[set, int]:
        seen: set = set()
        _, fingerprint, _ = verify_share(ck, (rank, 2), {}, lambda f, mapped: seen.add(f.name))
        return seen, fingerprint

    (a, fa), (b, fb) = hashed(0), hashed(1)
    files = set(json.loads((ck / "manifest.json").read_text())["files"])
    assert a and b and not a & b and a | b == files and fa == fb != 0
    _to_legacy(ck)
    (a, fa), (b, fb) = hashed(0), hashed(1)
    torch_files = {n for n in json.loads((ck / "manifest.json").read_text())["files"] if n.endswith(".pt")}
    assert torch_files and torch_files <= a and torch_files <= b and fa == fb


def _replace_with(make):
    def edit(p: Path) -> None:
        kept = p.with_name("kept")
        p.rename(kept)
        make(p, kept)
    return edit


@pytest.mark.parametrize("edit, why", [
    (_replace_with(lambda p, kept: p.mkdir()), "model.safetensors is no regular file"),
    (_replace_with(lambda p, kept: os.mkfifo(p)), "model.safetensors is no regular file"),
    (_replace_with(lambda p, kept: p.symlink_to(p.with_name("gone"))), "model.safetensors is no regular file"),
    (_replace_with(lambda p, kept: None), "model.safetensors is missing"),
    (_replace_with(lambda p, kept: p.symlink_to(kept)), None),
], ids=["a-directory", "a-fifo", "a-dangling-link", "missing", "a-link-to-it"])
def test_a_listed_file_that_is_no_regular_file_is_named_alike_by_a_load_and_by_verify(tmp_path, refs, edit, why):
    """A load checks the files the manifest lists against its scan of the directory (``announce_dir``),
    ``verify`` against the file system: both name a file that is missing or no regular file in one
    line, and follow a link to the file as a reader would."""
    from trainer.checkpoint import verify_share

    run = copy_run(refs(*REF12), tmp_path / "run")
    ck = run / "checkpoints" / "step-00000012"
    edit(ck / "model.safetensors")
    for check in (lambda: verify_share(ck, None, {}), lambda: verify(ck)):
        if why is None:
            check()
            continue
        with pytest.raises(CheckpointError) as e:
            check()
        assert str(e.value) == f"step-00000012: {why}"


def test_manifests_of_sha256_checksums_written_before_blake3_still_verify(tmp_path, refs):
    """Checkpoints saved before BLAKE3 record bare sha256 digests: they verify, and a flipped byte fails."""
    from sentinel.runfiles.checkpoints import check_checkpoint

    run = copy_run(refs(*REF12), tmp_path / "run")
    ck = run / "checkpoints" / "step-00000012"
    man = json.loads((ck / "manifest.json").read_text())
    man["files"] = {n: hashlib.sha256((ck / n).read_bytes()).hexdigest() for n in man["files"]}
    (ck / "manifest.json").write_text(json.dumps(man))
    assert verify(ck)["files"] == man["files"]
    assert check_checkpoint(ck, rehash=True)[0] == "checksum_ok"
    _flip_byte(ck / "optim.safetensors")
    with pytest.raises(CheckpointError, match="optim.safetensors fails its checksum"):
        verify(ck)
    assert check_checkpoint(ck, rehash=True)[:2] == ("corrupt", "optim.safetensors fails its checksum (corrupt or truncated)")


def _resign(ck: Path) -> None:
    """Re-sign the manifest after tampering: what an attacker with write access (or a buggy writer) does."""
    man = json.loads((ck / "manifest.json").read_text())
    man["files"] = {n: _sha(ck / n) for n in man["files"] if (ck / n).is_file()}
    (ck / "manifest.json").write_text(json.dumps(man))


def _edit_json(name: str, edit):
    def apply(ck: Path) -> None:
        doc = json.loads((ck / name).read_text())
        edit(doc)
        (ck / name).write_text(json.dumps(doc))
    return apply


def _drop_from_manifest(name: str):
    return _edit_json("manifest.json", lambda m: m["files"].pop(name))


def _tensor_file(name: str, make):
    def apply(ck: Path) -> None:
        obj = make(ck)
        (ck / name).unlink()
        write_tensors(ck / name, obj)
    return apply


def _reshaped_model(ck: Path) -> dict:
    sd = {k: v.clone() for k, v in load_file(ck / "model.safetensors").items()}
    k = next(iter(sd))
    sd[k] = torch.zeros(3, 3)
    return sd


# case -> (tamper (the manifest is re-signed afterwards), what the one warning line names)
SIGNED_MALFORMED = {
    "model-dropped-from-manifest": (_drop_from_manifest("model.safetensors"), "model.safetensors is not in the manifest"),
    "rng-dropped-from-manifest": (_drop_from_manifest("rng-rank0.safetensors"), "rng-rank0.safetensors is not in the manifest"),
    "optim-deleted-and-unlisted": (lambda ck: ((ck / "optim.safetensors").unlink(), _drop_from_manifest("optim.safetensors")(ck)), "optim.safetensors"),
    "negative-step": (_edit_json("train_state.json", lambda t: t.update(step=-5)), "step"),
    "step-not-the-dir": (_edit_json("train_state.json", lambda t: (t.update(step=11), t["scheduler"].update(step=11))), "says step 11"),
    "step-as-string": (_edit_json("train_state.json", lambda t: t.update(step="12")), "step"),
    "cursor-past-epoch": (_edit_json("train_state.json", lambda t: t["sampler"].update(position=10**12)), "cursor position"),
    "skip-range-overflow": (_edit_json("train_state.json", lambda t: t["skiplist"].append([1, 10**23])), "skiplist"),
    "world-size-mismatch": (_edit_json("train_state.json", lambda t: t.update(world_size=2)), "world_size"),
    "accum-mid-step": (_edit_json("train_state.json", lambda t: t.update(grad_accum_pos=1)), "grad_accum_pos"),
    "guard-history-short": (_edit_json("train_state.json", lambda t: t["guard"].update(loss=[0.0])), "guard"),
    "missing-field": (_edit_json("train_state.json", lambda t: t.pop("sampler")), "sampler"),
    "nested-json": (lambda ck: (ck / "train_state.json").write_text("[" * 100_000 + "]" * 100_000), "train_state.json is unreadable"),
    "manifest-path-escape": (_edit_json("manifest.json", lambda m: m["files"].update({"../escape": "0" * 64})), "unsafe file name"),
    "manifest-step-mismatch": (_edit_json("manifest.json", lambda m: m.update(step=4)), "manifest names step 4"),
    "checksum-unknown-algorithm": (_edit_json("manifest.json", lambda m: m["files"].update({"model.safetensors": "md5:" + "0" * 32})), "manifest files is invalid"),
    "checksum-short": (_edit_json("manifest.json", lambda m: m["files"].update({"model.safetensors": "blake3:" + "0" * 63})), "manifest files is invalid"),
    "model-wrong-shape": (_tensor_file("model.safetensors", _reshaped_model), "model.safetensors"),
    "optim-empty": (_tensor_file("optim.safetensors", lambda ck: {}), "optim.safetensors is not an optimizer state dict"),
    "rng-garbage": (_tensor_file("rng-rank0.safetensors", lambda ck: {"python": torch.zeros(3)}), "not a valid RNG state"),
    "model-not-a-tensor-file": (lambda ck: (ck / "model.safetensors").write_bytes(b"not a tensor file"), "model.safetensors is not a readable tensor file"),
    "optim-truncated": (lambda ck: (ck / "optim.safetensors").write_bytes((ck / "optim.safetensors").read_bytes()[:4096]), "optim.safetensors is not a readable tensor file"),
    "model-a-pickle": (lambda ck: torch.save(load_file(ck / "model.safetensors"), ck / "model.safetensors"), "model.safetensors is not a readable tensor file"),
}


def _tampered(src: Path, dst: Path, case: str) -> Path:
    run = copy_run(src, dst)
    ck = run / "checkpoints" / "step-00000012"
    SIGNED_MALFORMED[case][0](ck)
    if not case.startswith(("manifest-", "checksum-")):
        _resign(ck)
    return run


@pytest.mark.parametrize("case", sorted(SIGNED_MALFORMED))
def test_signed_but_malformed_checkpoint_is_rejected_in_one_line(tmp_path, dataset, refs, case, monkeypatch):
    """Checksum-valid but malformed: rejected with one reason (in process: fast), never a traceback."""
    import trainer.checkpointing as checkpointing_mod
    import trainer.train as train_mod
    from trainer.config import load_yaml, resolve
    from trainer.dist import DistEnv

    run = _tampered(refs(*REF12), tmp_path / "run", case)
    cfg = resolve(preset=None, config_file=None, saved=load_yaml(run / "config.yaml"), overrides={"data.dir": str(dataset)})
    tr = train_mod.Trainer(cfg, run, DistEnv(0, 0, 1, torch.device("cpu")), offline=True)
    logged: list[str] = []
    monkeypatch.setattr(checkpointing_mod, "_log", lambda env, msg: logged.append(msg))
    assert tr.load_checkpoint() == 8
    assert len(logged) == 1 and "step-00000012" in logged[0] and "falling back" in logged[0], logged
    assert SIGNED_MALFORMED[case][1] in logged[0], logged[0]
    with pytest.raises(CheckpointError):
        tr.load_checkpoint(12)


# a load parses each tensor file's header while the file is read, before its checksum is known: a file
# whose header (or the train state's JSON) is what was damaged must still be reported by its checksum
HEADER_DAMAGE = {
    "model header": ("model.safetensors", 12),
    "optim header": ("optim.safetensors", 40),
    "rng header": ("rng-rank0.safetensors", 30),
    "train state": ("train_state.json", 5),
    "model length prefix": ("model.safetensors", 0),
}


@pytest.mark.parametrize("case", sorted(HEADER_DAMAGE) + ["model header, large files", "optim header, large files"])
def test_a_damaged_header_is_reported_by_its_checksum(tmp_path, dataset, refs, case, monkeypatch):
    """The header a load parses early is damaged, so its parse fails before the checksum is computed:
    the checksum's verdict is the one reported, the load falls back in one line, nothing is applied.
    ``large files``: the model's and optimizer's files over the announcement's limit (lowered here), so
    that threads hash them while the load parses them through mappings of their own."""
    import sentinel.contract.fsio as fsio
    import trainer.checkpointing as checkpointing_mod
    import trainer.train as train_mod
    from trainer.config import load_yaml, resolve
    from trainer.dist import DistEnv

    if case.endswith(", large files"):
        monkeypatch.setattr(fsio, "ANNOUNCE_MAX_BYTES", 50_000)  # model and optim are larger, the rest not
        case = case.removesuffix(", large files")
    name, at = HEADER_DAMAGE[case]
    run = copy_run(refs(*REF12), tmp_path / "run")
    f = run / "checkpoints" / "step-00000012" / name
    data = bytearray(f.read_bytes())
    data[at] ^= 0x5A
    f.write_bytes(bytes(data))
    cfg = resolve(preset=None, config_file=None, saved=load_yaml(run / "config.yaml"), overrides={"data.dir": str(dataset)})
    tr = train_mod.Trainer(cfg, run, DistEnv(0, 0, 1, torch.device("cpu")), offline=True)
    parsed: list[str] = []
    parse_early = checkpointing_mod.TrainerCheckpoints._parse_early
    monkeypatch.setattr(checkpointing_mod.TrainerCheckpoints, "_parse_early",
                        lambda self, file, mapped, *rest: (parsed.append(file.name), parse_early(self, file, mapped, *rest))[1])
    logged: list[str] = []
    monkeypatch.setattr(checkpointing_mod, "_log", lambda env, msg: logged.append(msg))
    before = [p.detach().clone() for p in tr.raw_model.parameters()]
    assert tr.load_checkpoint() == 8
    assert logged == [f"warning: checkpoint step-00000012: {name} fails its checksum (corrupt or truncated); falling back to the previous one"]
    assert name in parsed or name == "train_state.json"  # the damaged file was parsed before its hash
    assert not all(torch.equal(a, b) for a, b in zip(before, tr.raw_model.parameters()))  # step 8's state, applied


def test_a_checkpoint_of_torchs_format_loads_to_the_same_state(tmp_path, dataset, refs):
    """A checkpoint written before tensor files (``model.pt``, ``optim.pt``, ``rng-rank0.pt``) verifies and
    loads to exactly the state its tensor-file twin loads to."""
    import trainer.train as train_mod
    from trainer.config import load_yaml, resolve
    from trainer.dist import DistEnv

    run = copy_run(refs(*REF12), tmp_path / "run")
    ck = run / "checkpoints" / "step-00000008"
    cfg = resolve(preset=None, config_file=None, saved=load_yaml(run / "config.yaml"), overrides={"data.dir": str(dataset)})
    tr = train_mod.Trainer(cfg, run, DistEnv(0, 0, 1, torch.device("cpu")), offline=True)
    states = []
    for legacy in (False, True):
        if legacy:
            _to_legacy(ck)
            assert sorted(json.loads((ck / "manifest.json").read_text())["files"]) == ["model.pt", "optim.pt", "rng-rank0.pt", "train_state.json"]
        assert tr.load_checkpoint(8) == 8
        states.append((repr(_flat(tr.raw_model.state_dict())), repr(_flat(tr.opt.state_dict())), torch.get_rng_state().clone()))
    assert states[0][0] == states[1][0] and states[0][1] == states[1][1] and torch.equal(states[0][2], states[1][2])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mappings from /proc")
def test_a_load_keeps_no_checkpoint_file_mapped(tmp_path, dataset, refs, monkeypatch):
    """model.pt and optim.pt are loaded with mmap: every tensor is copied out (into the live model and
    moments on a rollback, into private memory on a cold resume), so no checkpoint file stays mapped
    (retention could not free its disk space) and the values are exactly the file's. The mappings are
    let go just after the load, by the releasing thread (``sentinel.contract.fsio.release_later``), not
    at its end. The copies run on one thread below ``COPY_THREADS_MIN_BYTES``, else on the rank's share
    of the cores, and the run's own thread count is back after the load. The same share decides whether
    a save hashes on a second thread."""
    import time

    import trainer.dist as dist_mod
    import trainer.train as train_mod
    from trainer import state as state_mod
    from trainer.checkpoint_io import HASH_THREAD_MIN_CORES
    from trainer.config import load_yaml, resolve
    from trainer.dist import DistEnv, usable_cpus

    run = copy_run(refs(*REF12), tmp_path / "run")
    cfg = resolve(preset=None, config_file=None, saved=load_yaml(run / "config.yaml"), overrides={"data.dir": str(dataset)})
    tr = train_mod.Trainer(cfg, run, DistEnv(0, 0, 1, torch.device("cpu")), offline=True)

    def mapped() -> list[str]:  # once the releasing thread has let go of the load's mappings (it looks every 50 ms)
        deadline = time.monotonic() + 5
        while (found := [ln for ln in Path("/proc/self/maps").read_text().splitlines() if str(run / "checkpoints") in ln]) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        return found

    threads_in_copy: list[int] = []
    copy_model = state_mod.ModelPiece.load_state_dict
    monkeypatch.setattr(state_mod.ModelPiece, "load_state_dict",
                        lambda self, sd: (threads_in_copy.append(torch.get_num_threads()), copy_model(self, sd))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as under torchrun (OMP_NUM_THREADS=1)
    try:
        assert tr.load_checkpoint(12) == 12 and tr.opt.state.get(next(tr.raw_model.parameters())) is not None
        assert threads_in_copy == [1] and torch.get_num_threads() == 1  # 0.2 MB: one thread
        # and a save hashes its large writes on a second thread only with a core for it (2 here: inline)
        assert tr.checkpoints.ckpt.hash_thread == (usable_cpus() >= HASH_THREAD_MIN_CORES)
    finally:
        torch.set_num_threads(before)
    assert mapped() == [], "a cold load left a checkpoint file mapped"
    moments = {id(v) for st in tr.opt.state.values() for v in st.values()}
    monkeypatch.setattr(dist_mod, "COPY_THREADS_MIN_BYTES", 0)  # as for a state of 8 MiB or more
    torch.set_num_threads(1)
    try:
        assert tr.load_checkpoint(8) == 8, "the rollback case: the moments exist already"
        assert threads_in_copy[-1] == usable_cpus() and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert mapped() == [], "an in-process load left a checkpoint file mapped"
    assert {id(v) for st in tr.opt.state.values() for v in st.values()} == moments, "copied into the live moments"
    ck = run / "checkpoints" / "step-00000008"
    for name, want in load_file(ck / "model.safetensors").items():
        assert torch.equal(tr.raw_model.state_dict()[name], want), name
    saved = flat_state.unpack(load_file(ck / "optim.safetensors"), "optim.safetensors")["state"]
    live = tr.opt.state_dict()["state"]
    assert saved.keys() == live.keys() and all(torch.equal(live[i][k], v) for i in saved for k, v in saved[i].items())
    # the file holds three flat tensors (step, exp_avg, exp_avg_sq), which a save writes from the live
    # moments as they are: the loads above kept them flat
    packed = flat_state.pack(tr.opt.state_dict())
    assert [g["key"] for g in packed["groups"]] == ["step", "exp_avg", "exp_avg_sq"]
    assert all(g["data"].untyped_storage().data_ptr() == live[0][g["key"]].untyped_storage().data_ptr() for g in packed["groups"])


@pytest.mark.parametrize("case", ["model-dropped-from-manifest", "negative-step", "model-wrong-shape"])
def test_signed_but_malformed_checkpoint_falls_back_exactly(tmp_path, dataset, refs, case):
    """End to end: the trainer resumes from step 8 and re-runs 9..12 bitwise as before."""
    ref = refs(*REF12)
    run = _tampered(ref, tmp_path / "run", case)
    p = run_trainer(run, data_dir=dataset, check=True)
    out = p.stdout + p.stderr
    assert "Traceback" not in out
    assert len([ln for ln in out.splitlines() if "step-00000012" in ln and "falling back" in ln]) == 1, out
    assert "resumed from checkpoint step 8" in out
    assert_same_trajectory(ref, run, 12)


def _limit_file_size(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_failed_checkpoint_write_never_damages_previous(tmp_path, dataset, mode):
    """Disk full, simulated with RLIMIT_FSIZE: model.pt/optim.pt (~0.5/1 MB) fail with EFBIG while the
    step log and small files still write. Training goes on, each failed save is one line, and the
    previous checkpoints still verify; a later normal restart resumes from them."""
    run = tmp_path / "run"
    extra = ["--async-ckpt"] if mode == "async" else []
    run_trainer(run, *BASE_ARGS, "--data", str(dataset), "--max-steps", "8", "--ckpt-every", "4", *extra,
                data_dir=dataset, check=True)
    before = {s: verify(p) for s, p in list_checkpoints(run / "checkpoints")}
    assert sorted(before) == [0, 4, 8]  # the initial state, then every 4 steps
    digests = {s: {n: _sha(run / "checkpoints" / f"step-{s:08d}" / n) for n in m["files"]} for s, m in before.items()}

    p = run_trainer(run, "--max-steps", "16", data_dir=dataset, preexec_fn=_limit_file_size(200_000))
    out = p.stdout + p.stderr
    assert "Traceback" not in out, out[-4000:]
    # saves at 12 and 16 fail: at 16 the newest valid checkpoint (8) is 8 steps old, past the bound
    # (the 4-step interval), so the run stops with one line and a non-zero exit: never a silent rc 0
    assert p.returncode == 2, f"rc {p.returncode}: {out[-3000:]}"
    errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
    assert len(errors) >= 2, "each failed checkpoint write must be reported"
    for ln in errors:
        assert ln.startswith(("error: ", "warning: ")) and "File too large" in ln, ln
    final = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(final) == 1 and "newest valid checkpoint is step 8" in final[0], p.stderr
    assert max(_steps(run)) == 16  # every step record written (the step log is small enough)
    # the previous checkpoints are intact, byte for byte, and nothing half-written is left
    assert checkpoint_steps(run) == [0, 4, 8]
    for s, m in before.items():
        ck = run / "checkpoints" / f"step-{s:08d}"
        assert verify(ck)["files"] == m["files"]
        assert {n: _sha(ck / n) for n in m["files"]} == digests[s]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    if mode == "sync":  # and a normal restart resumes from the newest one
        p = run_trainer(run, data_dir=dataset, check=True)
        assert "resumed from checkpoint step 8" in p.stdout


def _steps(run):
    from sentinel.client.steplog import authoritative

    return authoritative(run / "steps.jsonl")


def test_a_loaded_optimizer_counts_its_steps_on_the_parameters_device():
    """torch leaves a loaded ``step`` on the CPU; SkipStepAdamW counts steps with a device tensor, so
    its load puts them on the parameters' device (the first step after a resume on CUDA failed
    before). Parameters on the meta device stand in for a GPU here: without the fix ``step`` stays
    on the CPU while the moments move."""
    from trainer.optim import SkipStepAdamW

    src = torch.nn.Parameter(torch.randn(4, 3))
    src.grad = torch.randn(4, 3)
    opt = SkipStepAdamW([src], weight_decay=0.1)
    opt.step(1e-3, torch.ones(()))
    saved = opt.state_dict()
    assert saved["state"][0]["step"].device.type == "cpu"

    dst = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    loaded = SkipStepAdamW([dst], weight_decay=0.1)
    loaded.load_state_dict(saved)
    st = loaded.state[dst]
    assert st["exp_avg"].device.type == "meta" and st["step"].device.type == "meta"

    again = SkipStepAdamW([src], weight_decay=0.1)  # on the CPU: the same values, bit for bit
    again.load_state_dict(saved)
    for k in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(again.state[src][k], opt.state[src][k])


def test_the_optimizers_moments_are_flat_per_dtype_and_update_as_a_tensor_each_would():
    """SkipStepAdamW lays out every plain, contiguous parameter's state at its first step as views of
    flat tensors per device and dtype (a parameter without a gradient too, as a fresh run's would be);
    a non-contiguous one keeps its own. The update is bit for bit the per-tensor one, and the flat
    file's ``pack`` writes the flat tensors as they are, or concatenates where they are not flat."""
    from trainer.optim import SkipStepAdamW

    def params():
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5)),
              torch.nn.Parameter(torch.randn(2, 2, dtype=torch.float64)),
              torch.nn.Parameter(torch.randn(3, 4).t()), torch.nn.Parameter(torch.randn(3))]
        return ps

    flat_ps, ref_ps = params(), params()
    flat, ref = SkipStepAdamW(flat_ps, weight_decay=0.1), SkipStepAdamW(ref_ps, weight_decay=0.1)
    ref._flat_done = True  # a tensor each, as before the flat layout
    for i in range(3):
        for ps in (flat_ps, ref_ps):
            torch.manual_seed(100 + i)
            for p in ps[:4]:  # the last never gets a gradient
                p.grad = torch.randn_like(p)
        flat.step(1e-2, torch.ones(()))
        ref.step(1e-2, torch.ones(()))
    for a, b in zip(flat_ps, ref_ps):
        assert torch.equal(a, b)
    st = [flat.state[p] for p in flat_ps]
    f32 = st[0]["exp_avg"].untyped_storage().data_ptr()
    assert st[1]["exp_avg"].untyped_storage().data_ptr() == f32 == st[4]["exp_avg"].untyped_storage().data_ptr()
    assert st[2]["exp_avg"].untyped_storage().data_ptr() != f32 and st[2]["exp_avg"].dtype == torch.float64
    assert st[3]["exp_avg"].untyped_storage().data_ptr() != f32  # non-contiguous: its own tensor
    assert float(st[4]["step"]) == 0.0 and not st[4]["exp_avg"].any() and not ref.state.get(ref_ps[4])
    packed = flat_state.pack(flat.state_dict())
    again = flat_state.unpack(packed, "optim.pt")["state"]
    want = flat.state_dict()["state"]
    assert again.keys() == want.keys() and all(torch.equal(again[i][k], v) for i in want for k, v in want[i].items())


def test_deterministic_mode_turns_off_the_fused_attention_kernels_on_cuda_only(numerics_flags):
    """Their backward does not repeat (measured on an H100: docs/benchmarks.md, "On an H100"); the
    switches are global flags, so this runs without a GPU. On CPU the kernels stay as they are."""
    from trainer.determinism import make_deterministic

    b = torch.backends.cuda
    for enable in (b.enable_flash_sdp, b.enable_mem_efficient_sdp, b.enable_cudnn_sdp):
        enable(True)
    make_deterministic("cpu")
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert not torch.utils.deterministic.fill_uninitialized_memory  # a debugging aid: ~21 ms a gpt2-124m step on an H200
    assert b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled() and b.cudnn_sdp_enabled()
    make_deterministic("cuda")
    assert not (b.flash_sdp_enabled() or b.mem_efficient_sdp_enabled() or b.cudnn_sdp_enabled())
    assert b.math_sdp_enabled()


def _direct_checkpointer(run_dir: Path, **kw):
    from trainer.checkpoint import Checkpointer

    return Checkpointer(run_dir, rank=0, world_size=1, keep_last=10, keep_every=0, barrier=lambda: None,
                        all_ok=lambda ok: ok, log=lambda m: None, **kw)


def test_a_crash_while_retention_deletes_a_checkpoint_leaves_no_step_without_its_manifest(tmp_path, monkeypatch):
    """Retention renames a checkpoint out of the step names before it deletes it. Killed midway (here:
    the deletion raises once the manifest is gone) it leaves a ``.trash-*`` directory, which the next
    start removes, not a step directory without its manifest that no retention would ever remove
    again (found by ``test_single_rank_random_kills_resume_bitwise``)."""
    import shutil

    from trainer.checkpoint import Checkpointer

    def checkpointer():
        return Checkpointer(tmp_path, rank=0, world_size=1, keep_last=2, keep_every=0, barrier=lambda: None,
                            all_ok=lambda ok: ok, log=lambda m: None)

    def save(ck, step):
        ck.save(step, shared={"model.pt": {"w": torch.full((3,), float(step))}, "train_state.json": {"step": step}},
                per_rank={}, meta={"run": "t"})

    class Killed(BaseException):
        pass

    def dies_midway(path, *args, **kwargs):
        (Path(path) / "manifest.json").unlink()
        raise Killed

    ck, root = checkpointer(), tmp_path / "checkpoints"
    save(ck, 1), save(ck, 2)
    monkeypatch.setattr(shutil, "rmtree", dies_midway)
    with pytest.raises(Killed):
        save(ck, 3)  # committed; retention then dies while deleting step 1
    monkeypatch.undo()
    steps = list_checkpoints(root, strays=True)
    assert [s for s, _ in steps] == [3, 2] and all((p / "manifest.json").is_file() for _, p in steps)
    assert len(list(root.glob(".trash-step-00000001-*"))) == 1
    checkpointer().clean_partial()  # the next start
    assert not list(root.glob(".trash-*")) and [s for s, _ in list_checkpoints(root, strays=True)] == [3, 2]


@pytest.mark.parametrize("async_save,idle,writer,hash_thread", [
    (False, False, "thread", True), (False, False, "thread", False), (True, False, "thread", True), (True, True, "thread", True),
    (True, False, "process", True), (True, True, "process", True), (True, False, "process", False)],
    ids=["sync", "sync-inline", "async", "async-idle", "async-process", "async-process-idle", "async-process-inline"])
def test_saved_files_hash_as_written_and_async_snapshot_is_taken_before_the_fence(tmp_path, monkeypatch, async_save, idle,
                                                                                  writer, hash_thread):
    """The manifest's checksums (computed from the bytes as they were written) match the files on disk,
    with a helper thread hashing too (``hash_thread``: a rank with cores to spare) or without, for a tensor
    large enough to span several hashed pieces and for small writes gathered together.
    An async save is handed the live tensors: once ``fence()`` returns, changing them in place (what the
    optimizer step does) must not reach the checkpoint, whether the save's thread writes the files or the
    writer process does (over its copy in shared memory). With ``idle_writer`` (checkpoint.async_priority:
    idle) the save's thread, and the writer process, run at SCHED_IDLE and still finish."""
    from sentinel.contract.fsio import Checksum
    from trainer import tensor_file

    hashed_on, update = set(), Checksum.update
    monkeypatch.setattr(Checksum, "update", lambda self, data: (hashed_on.add(threading.current_thread().name), update(self, data))[1])
    ck = _direct_checkpointer(tmp_path, idle_writer=idle, async_writer=writer, hash_thread=hash_thread)
    big = torch.arange(3 << 20, dtype=torch.float32)  # 12 MiB: three pieces for HashLater
    small = {f"w{i}": torch.full((7,), float(i)) for i in range(50)}  # many small records
    expect = {"big": big.clone(), **{k: v.clone() for k, v in small.items()}}
    built_on = []  # a file given as a callable (a live piece's state_dict) is built by the save: off the loop if async

    def model_state():
        built_on.append(threading.get_ident())
        return {"big": big, **small}

    ck.save(5, shared={"model.safetensors": model_state, "train_state.json": {"step": 5}},
            per_rank={"rng-rank0.safetensors": {"torch": torch.get_rng_state()}}, meta={"run": "t"}, async_save=async_save)
    ck.fence()
    assert len(built_on) == 1 and (built_on[0] != threading.get_ident()) == async_save
    big.add_(1.0)  # the optimizer step, right after the fence
    for v in small.values():
        v.mul_(-1.0)
    ck.wait()
    path = tmp_path / "checkpoints" / "step-00000005"
    man = json.loads((path / "manifest.json").read_text())
    assert set(man["files"]) == {"model.safetensors", "train_state.json", "rng-rank0.safetensors"}
    for name, digest in man["files"].items():
        assert _sha(path / name) == digest, name
    saved = tensor_file.load(path / "model.safetensors", mapped=False)
    assert saved.keys() == expect.keys() and all(torch.equal(saved[k], expect[k]) for k in expect)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
    if async_save:  # one long-lived thread runs every async save, at the priority asked for
        assert os.sched_getscheduler(ck._writer.native_id) == (os.SCHED_IDLE if idle else os.SCHED_OTHER)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the loop's thread keeps its own
    if writer == "thread":  # (the writer process hashes out of sight)
        assert hash_thread or not any(n.startswith("ckpt-hash") for n in hashed_on), hashed_on
    if writer == "process":  # and one long-lived writer process, at that priority too
        assert ck.async_writer == "process" and ck._proc.alive()
        assert os.sched_getscheduler(ck._proc.proc.pid) == (os.SCHED_IDLE if idle else os.SCHED_OTHER)
        ck._proc.close()


@pytest.mark.parametrize("async_save,hash_thread", [(False, False), (True, False), (False, True)],
                         ids=["sync", "async-thread", "sync-helper"])
def test_a_save_writes_every_tensor_file_before_it_hashes_them(tmp_path, monkeypatch, async_save, hash_thread):
    """A save writes every tensor file of a checkpoint (their writeback started) and only then hashes them, from
    the same buffers, so the disk drains while the rank hashes (``checkpoint_io.HashLater``): without a helper
    (a rank without cores to spare) every large write comes before the first large hash, all on the save's
    thread. With one, each byte is still hashed exactly once, by whichever thread got to it. Either way the
    manifest's checksums match the files on disk, and an async save's files hold the state as it was at the
    save, not as it is after the fence."""
    from sentinel.contract.fsio import Checksum
    from trainer import tensor_file

    events, update, write = [], Checksum.update, os.write

    def spy_update(self, data):
        events.append(("hash", threading.current_thread().name, memoryview(data).nbytes))
        return update(self, data)

    def spy_write(fd, data):
        events.append(("write", threading.current_thread().name, memoryview(data).nbytes))
        return write(fd, data)

    monkeypatch.setattr(Checksum, "update", spy_update)
    monkeypatch.setattr(os, "write", spy_write)
    ck = _direct_checkpointer(tmp_path, async_writer="thread", hash_thread=hash_thread)
    model = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.full((7,), 2.0)}  # 4 MiB and a few bytes
    optim = {"m": torch.ones(3 << 19), "v": torch.full((3 << 19,), 3.0)}  # 6 MiB each
    expect = {"model.safetensors": {k: v.clone() for k, v in model.items()},
              "optim.safetensors": {k: v.clone() for k, v in optim.items()}}
    ck.save(7, shared={"model.safetensors": model, "optim.safetensors": optim, "train_state.json": {"step": 7}},
            per_rank={"rng-rank0.safetensors": {"torch": torch.get_rng_state()}}, meta={"run": "t"}, async_save=async_save)
    ck.fence()
    for v in [*model.values(), *optim.values()]:
        v.add_(1.0)  # the optimizer step, right after the fence
    ck.wait()
    path = tmp_path / "checkpoints" / "step-00000007"
    man = json.loads((path / "manifest.json").read_text())
    assert set(man["files"]) == {"model.safetensors", "optim.safetensors", "train_state.json", "rng-rank0.safetensors"}
    for name, digest in man["files"].items():
        assert _sha(path / name) == digest, name
    for name, want in expect.items():
        got = tensor_file.load(path / name, mapped=False)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), name
    # every byte of every file (the manifest's included) hashed exactly once, by whichever thread got to it
    assert sum(n for k, _, n in events if k == "hash") == sum(p.stat().st_size for p in path.iterdir())
    big = [(k, who) for k, who, n in events if n >= 1 << 20]
    assert sum(k == "write" for k, _ in big) >= 3 and sum(k == "hash" for k, _ in big) >= 3, events
    if not hash_thread:
        last_write, first_hash = max(i for i, (k, _) in enumerate(big) if k == "write"), [k for k, _ in big].index("hash")
        assert last_write < first_hash and len({who for _, who in big}) == 1, events


@pytest.mark.parametrize("helper", [False, True], ids=["caller-only", "helper"])
def test_hash_later_hashes_each_file_in_order_once_whoever_hashes_it(tmp_path, monkeypatch, helper):
    """``HashLater``: every file's checksum is that of its bytes in the order written, each piece hashed
    exactly once, whether by the caller at ``checksums()`` or by the helper thread as the writes come (the
    helper is seen to take its share before the caller asks); ``close()`` without ``checksums()`` (a save
    that failed midway) stops the helper and drops the buffers."""
    import random

    from sentinel.contract.fsio import Checksum
    from trainer.checkpoint_io import _PIECE, HashLater

    hashed, update = [], Checksum.update
    monkeypatch.setattr(Checksum, "update", lambda self, data: (hashed.append(memoryview(data).nbytes), update(self, data))[1])
    rnd = random.Random(5)
    sizes = {"empty": [], "one-byte": [1], "small-writes": [10, 3, 4096], "spans-pieces": [_PIECE + 17, 5, 2 * _PIECE],
             "many": [rnd.randrange(1, 300_000) for _ in range(40)]}
    later = HashLater(helper=helper)
    want, nbytes = {}, 0
    for name, parts in sizes.items():
        path, h = tmp_path / name, blake3.blake3()
        pending = later.open(path)
        for n in parts:
            data = memoryview(rnd.randbytes(n))
            later.written(pending, data)
            h.update(data)
            nbytes += n
        want[path] = "blake3:" + h.hexdigest()
        if helper and name == "spans-pieces":  # a piece's worth waits: the helper is woken and takes some
            deadline = time.monotonic() + 30
            while pending.done == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
            assert pending.done > 0
    assert later.checksums() == want
    assert sum(hashed) == nbytes and max(hashed) <= _PIECE
    assert later._helper is None or not later._helper.is_alive()
    dropped = HashLater(helper=helper)
    dropped.written(dropped.open(tmp_path / "x"), memoryview(bytes(3 * _PIECE)))
    dropped.close()
    assert dropped._helper is None or not dropped._helper.is_alive()


def test_a_dead_writer_process_is_started_again_and_one_that_dies_in_a_save_fails_it_in_one_line(tmp_path):
    """The writer process, killed between saves, is started again by the next save. Killed while a save waits
    for it: that save fails in one line (its files removed), and the thread writes every save after it."""
    logged = []
    ck = _direct_checkpointer(tmp_path, async_writer="process")
    ck.log = logged.append
    root = tmp_path / "checkpoints"

    def save(step: int) -> None:
        ck.save(step, shared={"model.pt": {"w": torch.full((1000,), float(step))}, "train_state.json": {"step": step}},
                per_rank={}, meta={"run": "t"}, async_save=True)

    save(1)
    ck.wait()
    first = ck._proc.proc
    first.kill()
    first.wait()
    save(2)
    ck.wait()
    second = ck._proc.proc
    assert second.pid != first.pid and second.poll() is None
    assert [p.name for p in sorted(root.glob("step-*"))] == ["step-00000001", "step-00000002"] and not logged

    os.kill(second.pid, signal.SIGSTOP)  # it cannot answer: the save's thread waits for it
    save(3)
    ck._snapshot_taken.wait(10)
    second.kill()
    ck.wait()
    assert logged == ["warning: async checkpoint step 3 failed: the checkpoint writer process died (killed by SIGKILL); "
                      "async saves write on a thread"]
    assert ck.async_writer == "thread" and not list(root.glob(".tmp-*")) and not (root / "step-00000003").exists()
    save(4)
    ck.wait()
    assert (root / "step-00000004" / "manifest.json").is_file() and len(logged) == 1
    assert torch.equal(load_torch(root / "step-00000004" / "model.pt")["w"], torch.full((1000,), 4.0))


def test_without_memfd_async_saves_are_written_by_the_thread_and_say_so_once(tmp_path, monkeypatch):
    """Where no memory can be shared with a writer process (no ``memfd_create``: not Linux), async saves
    are written by the save's thread, after one line that says so."""
    monkeypatch.delattr(os, "memfd_create")
    logged = []
    ck = _direct_checkpointer(tmp_path, async_writer="process")
    ck.log = logged.append
    for step in (1, 2):
        ck.save(step, shared={"model.pt": {"w": torch.ones(3)}, "train_state.json": {"step": step}}, per_rank={},
                meta={"run": "t"}, async_save=True)
        ck.wait()
    assert logged == ["warning: no memfd_create on this system; async saves write on a thread"]
    assert ck.async_writer == "thread" and ck._proc is None
    assert all((tmp_path / "checkpoints" / f"step-0000000{s}" / "manifest.json").is_file() for s in (1, 2))


def test_the_writer_process_ends_with_the_training_process_that_started_it(tmp_path):
    """A training process killed outright leaves no writer behind: the writer sees its socket close, and exits."""
    script = (
        "import os, sys, torch\n"
        "from trainer.checkpoint import Checkpointer\n"
        f"ck = Checkpointer({str(tmp_path)!r}, rank=0, world_size=1, keep_last=2, keep_every=0, barrier=lambda: None,\n"
        "                  all_ok=lambda ok: ok, log=print, async_writer='process')\n"
        "ck.save(1, shared={'model.pt': {'w': torch.ones(4)}, 'train_state.json': {'step': 1}}, per_rank={},\n"
        "        meta={'run': 't'}, async_save=True)\n"
        "ck.wait()\n"
        "print(ck._proc.proc.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    out = python_c(script)
    assert out.returncode == -9, out.stderr
    pid = int(out.stdout.split()[-1])
    assert (tmp_path / "checkpoints" / "step-00000001" / "manifest.json").is_file()
    deadline = time.time() + 20
    while time.time() < deadline and Path(f"/proc/{pid}").exists() and "zombie" not in _proc_state(pid):
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in _proc_state(pid)
    # and it is no command for people: started by hand, it says so in one line
    bad = subprocess.run([sys.executable, "-m", "trainer.checkpoint_writer_main"], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "not by hand" in bad.stderr


def _proc_state(pid: int) -> str:
    try:
        return next((ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:")), "").lower()
    except OSError:
        return "gone"


def test_the_async_writer_thread_survives_a_failed_save_and_runs_the_next(tmp_path):
    """An async save that raises past its own handling is reported once by ``wait()``; the one writer
    thread lives on, so the next async save is written (not queued behind a dead thread forever). While a
    save runs, the interpreter hands the GIL over after 0.5 ms; Python's interval is back after it, failed or not."""
    from trainer.checkpoint_thread import ASYNC_SWITCH_INTERVAL_S

    logged, seen, before = [], [], sys.getswitchinterval()
    ck = _direct_checkpointer(tmp_path)
    ck.log = logged.append
    ck._submit(lambda: (seen.append(sys.getswitchinterval()), 1 / 0))
    ck.wait()
    assert ck.last_error == "division by zero" and logged == ["warning: async checkpoint failed: division by zero"]
    assert seen == [min(before, ASYNC_SWITCH_INTERVAL_S)] and sys.getswitchinterval() == before
    ck.save(7, shared={"model.pt": {"w": torch.ones(3)}, "train_state.json": {"step": 7}}, per_rank={},
            meta={"run": "t"}, async_save=True)
    ck.wait()
    assert (tmp_path / "checkpoints" / "step-00000007" / "manifest.json").is_file() and ck.last_error == "division by zero"
    # a file that fails to build on the save's thread: the fence still returns, the save fails in one line
    ck.save(8, shared={"model.pt": lambda: {}["model"], "train_state.json": {"step": 8}}, per_rank={},
            meta={"run": "t"}, async_save=True)
    ck.fence()
    ck.wait()
    assert logged[-1] == "warning: async checkpoint failed: 'model'" and len(logged) == 2
    assert not (tmp_path / "checkpoints" / "step-00000008").exists() and not list((tmp_path / "checkpoints").glob(".tmp-*"))
    writer = ck._writer
    del ck  # a Checkpointer let go of takes its thread with it (the thread holds no reference to it)
    gc.collect()
    writer.join(timeout=10)
    assert not writer.is_alive()


def test_overlapping_async_saves_of_two_checkpointers_put_pythons_switch_interval_back_once_both_end(tmp_path):
    """The switch interval is the process's: a save that ends while another still runs leaves it short, and
    the last one to end puts back the value from before the first (not the short one it found)."""
    from trainer.checkpoint_thread import ASYNC_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    short = min(before, ASYNC_SWITCH_INTERVAL_S)
    a, b = _direct_checkpointer(tmp_path / "a"), _direct_checkpointer(tmp_path / "b")
    b_runs, a_done, seen = threading.Event(), threading.Event(), {}

    def job_b():  # starts while a's save runs, ends after it
        b_runs.set()
        a_done.wait(10)
        seen["b, after a ended"] = sys.getswitchinterval()

    a_holds = threading.Event()
    a._submit(lambda: (a_holds.set(), b_runs.wait(10), seen.setdefault("a", sys.getswitchinterval())))
    assert a_holds.wait(10)
    b._submit(job_b)
    a.wait()
    a_done.set()
    b.wait()
    assert seen == {"a": short, "b, after a ended": short}
    assert sys.getswitchinterval() == before


SHARES = {  # sizes by name -> what each of 2 ranks hashes (largest first, to the rank with fewer bytes)
    "ddp-checkpoint": ({"optim.pt": 26, "model.pt": 13, "rng-rank0.pt": 1, "rng-rank1.pt": 1, "train_state.json": 1},
                       [["optim.pt"], ["model.pt", "rng-rank0.pt", "rng-rank1.pt", "train_state.json"]]),
    "equal-sizes": ({"a": 5, "b": 5, "c": 5, "d": 5}, [["a", "c"], ["b", "d"]]),
    "fewer-files-than-ranks": ({"only": 7}, [["only"], []]),
    "empty-files": ({"x": 0, "y": 0}, [["x"], ["y"]]),
}


@pytest.mark.parametrize("case", sorted(SHARES))
def test_checksum_shares_cover_every_file_once(case):
    from trainer.checkpoint import checksum_share

    sizes, want = SHARES[case]
    names = sorted(sizes)
    got = [checksum_share(names, [sizes[n] for n in names], i, 2) for i in range(2)]
    assert [sorted(g) for g in got] == want
    assert sorted(n for g in got for n in g) == names
    assert checksum_share(names, [sizes[n] for n in names], 0, 1) == sorted(names, key=lambda n: (-sizes[n], n))


def _all_ok_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from trainer.dist import DistEnv

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    env = DistEnv(rank, rank, 2, torch.device("cpu"), dist.group.WORLD, local_world_size=2)
    got = [env.all_ok(True, same=7), env.all_ok(rank == 0, same=7), env.all_ok(True, same=7 + rank),
           env.all_ok(True, same=2**62 + 5)]
    from trainer.dist import BROADCAST_INLINE_BYTES

    sent = [[], None, "x" * (BROADCAST_INLINE_BYTES - 30), "y" * (BROADCAST_INLINE_BYTES + 1), list(range(50_000)),
            {"kind": "skip", "ranges": [[3, 40]]}]
    got.append([env.broadcast_object(obj if rank == 0 else "not rank 0's") == obj for obj in sent])
    got.append(env.gather(None if rank == 0 else (0, "rank 1's reason")))
    dist.destroy_process_group()
    Path(out, f"rank{rank}").write_text(json.dumps(got))


def test_all_ok_needs_every_rank_ok_and_the_same_fingerprint(tmp_path):
    """The vote a shared checkpoint verification ends with: one failed share, or ranks that saw
    different files (another fingerprint), fail it on every rank. And ``broadcast_object`` (every step's
    directives): rank 0's object on both ranks, whether its pickle fits the one broadcast or needs the
    second, around the boundary and far past it. ``gather`` (why a load turned a checkpoint down):
    every rank's object, by rank, on every rank."""
    import socket

    import torch.multiprocessing as tmp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp.spawn(_all_ok_worker, args=(port, str(tmp_path)), nprocs=2)
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}").read_text()) == [True, False, False, True, [True] * 6,
                                                                        [None, [0, "rank 1's reason"]]]


def test_async_finalize_waits_for_a_rank_marker_being_written(tmp_path):
    """Rank 0 of an async save commits once every rank's ``.done-rankN`` says ``ok``. A marker seen
    between its creation and its content (empty) is not yet an answer: reading it as a failure lost a
    checkpoint of a 2-rank bench run, now and then."""
    import threading

    from trainer.checkpoint import Checkpointer

    logged: list[str] = []
    ck = Checkpointer(tmp_path, rank=0, world_size=2, keep_last=10, keep_every=0, barrier=lambda: None,
                      all_ok=lambda ok: ok, log=logged.append)
    tmp = ck.root / ".tmp-step-00000007.1"
    tmp.mkdir(parents=True)
    written = {"train_state.json": write_json(tmp / "train_state.json", {"step": 7}, sync=False)}
    (tmp / ".done-rank0").write_text("ok")
    (tmp / ".done-rank1").write_text("")  # created, not yet written

    def finish():
        time.sleep(0.2)
        (tmp / ".done-rank1").write_text("ok")

    threading.Thread(target=finish).start()
    info = ck._finalize_when_ranks_done(tmp, 7, {"run": "t"}, written, timeout=10.0)
    assert info is not None and info[0].name == "step-00000007", (info, ck.last_error, logged)
    assert not list(info[0].glob(".done-rank*")) and not tmp.exists()


@pytest.mark.parametrize("share, catches", [(None, True), ((0, 1), True), ((1, 1), True), ((5, 2), True),
                                            ((0, 2), True), ((1, 2), False)])
def test_a_share_hashes_its_files_and_an_odd_local_rank_hashes_all(tmp_path, refs, share, catches):
    """``verify_share``: with 2 ranks, the rank holding the biggest file (optim.safetensors) catches its
    corruption and the other does not read it; a lone rank, or a local rank the launcher numbered past
    the node's count, hashes every file (never none)."""
    from trainer.checkpoint import verify_share

    run = copy_run(refs(*REF12), tmp_path / "run")
    path = run / "checkpoints" / "step-00000012"
    _flip_byte(path / "optim.safetensors")
    if catches:
        with pytest.raises(CheckpointError, match="optim.safetensors fails its checksum"):
            verify_share(path, share)
    else:
        manifest, fingerprint, state = verify_share(path, share)
        assert manifest["step"] == 12 == state["step"] and fingerprint > 0


@pytest.mark.parametrize("cpu_max, limit", [
    ("max 100000\n", None),          # no quota: the affinity
    ("150000 100000\n", 2),           # 1.5 CPUs, rounded up
    ("50000 100000\n", 1),            # half a CPU: still one
    ("100000000 100000\n", None),     # a quota above the affinity
    ("garbage\n", None), ("", None), ("1 0\n", None),  # unreadable: the affinity
])
def test_usable_cpus_reads_a_containers_cpu_quota(tmp_path, cpu_max, limit):
    from trainer.dist import usable_cpus

    f = tmp_path / "cpu.max"
    f.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(f) == (min(affinity, limit) if limit else affinity)
    assert usable_cpus(tmp_path / "absent") == affinity


@pytest.mark.parametrize("data", [b"\xff\xfe not utf-8", b"not json", b"[" * 100_000 + b"]" * 100_000, b"[1, 2]",
                                  b'{"step": 3}', b'{"step": "3"}', b""],
                         ids=["not-utf8", "not-json", "nested", "not-an-object", "fields-missing", "step-as-string", "empty"])
def test_train_state_bytes_hashed_already_fail_as_the_file_read_from_disk_does(tmp_path, data):
    """A load validates ``train_state.json`` from the bytes its checksum was computed over (pydantic's
    JSON reader); a file read from the disk goes through ``json.loads``. Either way hostile bytes give
    one line, that says the same of the same field (pydantic words a wrong type differently from JSON
    than from a dict: "should be an object", "should be a valid dictionary")."""
    from trainer.checkpoint_verify import read_train_state

    ck = tmp_path / "step-00000003"
    ck.mkdir()
    (ck / "train_state.json").write_bytes(data)
    errors = []
    for given in (data, None):
        with pytest.raises(CheckpointError) as e:
            read_train_state(ck, 3, given)
        errors.append(str(e.value))
    assert errors[0].rsplit(": ", 1)[0] == errors[1].rsplit(": ", 1)[0], errors
    assert "\n" not in errors[0] and errors[0].startswith("step-00000003: train_state.json is ")


def test_the_fused_update_is_the_loops_to_rounding_and_a_skip_leaves_everything_bit_for_bit():
    """On CUDA SkipStepAdamW updates each group with torch's fused AdamW kernel (``fused=None``: CUDA only;
    ``fused=True`` takes the same path on the CPU here). Over 40 steps, one in five skipped with a NaN in
    its gradients, it stays within float32 rounding of the loop; a skipped step changes no bit of the
    parameters, the moments or the step counts; a group it cannot take (float64 beside float32, a
    strided parameter) runs the loop, bit for bit as the loop would."""
    from trainer.optim import SkipStepAdamW

    def params():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32)),
                torch.nn.Parameter(torch.randn(7, 5))]

    fused_ps, loop_ps = params(), params()
    groups = lambda ps: [{"params": ps[:1] + ps[2:], "weight_decay": 0.1}, {"params": ps[1:2], "weight_decay": 0.0}]  # noqa: E731
    fused, loop = SkipStepAdamW(groups(fused_ps), fused=True), SkipStepAdamW(groups(loop_ps), fused=False)
    for i in range(40):
        skip = i % 5 == 3
        torch.manual_seed(1000 + i)
        grads = [torch.randn_like(p) for p in fused_ps]
        if skip:
            grads[0][3, 4] = float("nan")
        before = [p.detach().clone() for p in fused_ps] + [t.clone() for st in fused.state.values() for t in st.values()]
        for ps in (fused_ps, loop_ps):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        factor = torch.tensor(0.0 if skip else 1.0)
        fused.step(1e-2 * (1 + i % 3), factor)
        loop.step(1e-2 * (1 + i % 3), factor)
        if skip and i > 3:
            after = [p.detach() for p in fused_ps] + [t for st in fused.state.values() for t in st.values()]
            assert all(torch.equal(a, b) for a, b in zip(before, after))
    for a, b in zip(fused_ps, loop_ps):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=0, atol=1e-5)
    assert not all(torch.equal(a, b) for a, b in zip(fused_ps, loop_ps))  # the fused kernel ran: its rounding differs
    for p, q in zip(fused_ps, loop_ps):
        assert torch.equal(fused.state[p]["step"], loop.state[q]["step"]) and float(loop.state[q]["step"]) == 32.0
        assert torch.allclose(fused.state[p]["exp_avg_sq"], loop.state[q]["exp_avg_sq"], rtol=1e-5, atol=1e-9)

    mixed = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3, dtype=torch.float64))]
    strided = [torch.nn.Parameter(torch.randn(3, 4).t())]
    for ps in (mixed, strided):
        twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        a, b = SkipStepAdamW(ps, weight_decay=0.1, fused=True), SkipStepAdamW(twins, weight_decay=0.1, fused=False)
        for p, q in zip(ps, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        a.step(1e-2, torch.ones(()))
        b.step(1e-2, torch.ones(()))
        assert all(torch.equal(p, q) for p, q in zip(ps, twins))
