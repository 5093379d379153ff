"""Register any directory of files as a checkpoint the sentinel can roll back to (torch-free).

A framework's checkpoint (Hugging Face's ``checkpoint-N``, Lightning's ``.ckpt`` directory, torchtitan's
``step-N``) has no manifest of ours. :func:`checkpoint_info` gives it one: ``manifest.json`` with a checksum
per file, written **last** and atomically (tmp + fsync + rename), so a directory still being written is
never listed as whole. A directory that already holds a manifest (our trainer's) is taken as it is.

The manifest is the trainer's (``format``, ``step``, ``files``, ``bytes``, ``world_size``, ``created``,
``timeline``, ``tokens``) plus ``framework``: the name of the loop that wrote the files, so readers know
not to ask for our trainer's own files (``model.safetensors``, ``rng-rank0.safetensors``...). Its digest (``manifest_sha256``
on the bus) is the sha256 of the sorted ``files`` map, as ``trainer.checkpoint.manifest_digest``.

:func:`link_into_run_dir` makes the checkpoint visible where ``sentinel checkpoints`` / ``sentinel rollback``
look: ``RUN_DIR/checkpoints/step-NNNNNNNN``, a relative symlink to the framework's directory.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sentinel.contract.checkpoints import manifest_digest
from sentinel.contract.fsio import checksum_matches, file_checksum
from sentinel.protocol import (
    CHECKPOINT_MANIFEST,
    CheckpointInfo,
    atomic_write_text,
    checkpoint_dir_name,
)

MANIFEST_FORMAT = 1  # the trainer's checkpoint.FORMAT_VERSION: one reader for both


class CheckpointDirError(Exception):
    """A one-line reason a directory cannot be registered as a checkpoint."""


def _files(path: Path) -> dict[str, str]:
    """The checksum (``blake3:<hex>``) of every regular file under ``path`` (relative POSIX names), the manifest excluded."""
    out = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = f.relative_to(path).as_posix()
        if rel == CHECKPOINT_MANIFEST or f.name.startswith(f".{CHECKPOINT_MANIFEST}.tmp"):
            continue
        out[rel] = file_checksum(f)
    return out


def write_manifest(path: str | os.PathLike, step: int, *, world_size: int = 1, timeline: int = 0, tokens: int = 0,
                   framework: str = "custom") -> dict:
    """Hash every file of ``path`` and write ``manifest.json`` last (atomically); return the manifest."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointDirError(f"checkpoint directory not found: {path}")
    files = _files(path)
    if not files:
        raise CheckpointDirError(f"checkpoint directory {path} holds no files")
    total = sum((path / name).stat().st_size for name in files)
    manifest = {"format": MANIFEST_FORMAT, "step": int(step), "files": files, "bytes": total,
                "world_size": int(world_size), "created": time.time(), "timeline": int(timeline),
                "tokens": int(tokens), "framework": framework}
    atomic_write_text(path / CHECKPOINT_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(path: str | os.PathLike) -> dict | None:
    """The directory's manifest, or None when it has none (or one that is no manifest of ours)."""
    try:
        raw = json.loads((Path(path) / CHECKPOINT_MANIFEST).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return raw if isinstance(raw, dict) and isinstance(raw.get("files"), dict) else None


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check every file ``manifest.json`` lists against its checksum (before any framework unpickles one);
    return the manifest, or raise ``CheckpointDirError`` with one line naming what is wrong."""
    path = Path(path)
    manifest = read_manifest(path)
    if manifest is None:
        raise CheckpointDirError(f"{path}: no manifest (not a checkpoint registered with the sentinel)")
    for name, digest in sorted(manifest["files"].items()):
        f = path / name
        if not f.is_file():
            raise CheckpointDirError(f"{path}: {name} is missing")
        if not checksum_matches(f, digest):
            raise CheckpointDirError(f"{path}: {name} does not match its checksum in the manifest (corrupt or changed)")
    return manifest


def _newer_files(path: Path) -> bool:
    """A file of ``path`` changed after its manifest was written (the step saved again after a rollback)."""
    try:
        written = (path / CHECKPOINT_MANIFEST).stat().st_mtime
        return any(p.stat().st_mtime > written for p in path.rglob("*") if p.is_file() and p.name != CHECKPOINT_MANIFEST)
    except OSError:
        return True


def checkpoint_info(run: str, step: int, path: str | os.PathLike, *, world_size: int = 1, timeline: int = 0,
                    tokens: int = 0, framework: str = "custom") -> CheckpointInfo:
    """The ``CheckpointInfo`` of directory ``path`` (saved at ``step``), writing its manifest when it has none.

    Call it once the framework has finished writing the directory: the manifest vouches for the files as
    they are now. A manifest older than a file beside it (the step saved again after a rollback) is
    written anew."""
    manifest = read_manifest(path) if not _newer_files(Path(path)) else None
    if manifest is None or manifest.get("step") != int(step):
        manifest = write_manifest(path, step, world_size=world_size, timeline=timeline, tokens=tokens,
                                  framework=framework)
    return CheckpointInfo(run=run, step=int(step), path=str(Path(path).resolve()), created=float(manifest.get("created") or time.time()),
                          bytes=int(manifest.get("bytes") or 0), manifest_sha256=manifest_digest(manifest),
                          world_size=int(manifest.get("world_size") or world_size), timeline=int(timeline),
                          tokens=int(tokens))


def link_into_run_dir(run_dir: str | os.PathLike, step: int, path: str | os.PathLike) -> Path:
    """``RUN_DIR/checkpoints/step-NNNNNNNN`` -> ``path`` (a relative symlink; replaced atomically when it
    pointed elsewhere). A checkpoint already at that place is left alone. Returns the link's path."""
    root = Path(run_dir) / "checkpoints"
    link = root / checkpoint_dir_name(step)
    target = Path(path).resolve()
    if link.resolve() == target:
        return link
    root.mkdir(parents=True, exist_ok=True)
    if link.exists() and not link.is_symlink():
        raise CheckpointDirError(f"{link} exists and is not a link to {target}: refusing to replace it")
    tmp = root / f".{link.name}.link-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(os.path.relpath(target, root))
    os.replace(tmp, link)
    return link


def unlink_missing(run_dir: str | os.PathLike) -> list[int]:
    """Remove the links of checkpoints the framework deleted (retention); return the steps still there."""
    root = Path(run_dir) / "checkpoints"
    kept = []
    if not root.is_dir():
        return kept
    for p in root.iterdir():
        if not p.name.startswith("step-"):
            continue
        if p.is_symlink() and not p.exists():
            p.unlink(missing_ok=True)
            continue
        try:
            kept.append(int(p.name[len("step-"):]))
        except ValueError:
            continue
    return sorted(kept)
