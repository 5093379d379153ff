"""``checkpoints/step-*/``: listing, sizes, and a re-hash of every file against its manifest's checksum
(``checksum_ok`` / ``corrupt`` / ``incomplete``), plus ``verified.json`` from ``sentinel
verify-resume`` (``resume_verified`` / ``failed``). The manifest is judged by the trainer's own
validator (``contract.checkpoints.check_manifest``): a checkpoint listed ``checksum_ok`` here is one
the trainer will load."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sentinel.contract.checkpoints import ManifestError, check_manifest
from sentinel.contract.fsio import checksum_matches
from sentinel.contract.limits import MAX_COUNT, MAX_TIMELINE
from sentinel.contract.parsing import finite_or_none
from sentinel.contract.rundir import CHECKPOINT_MANIFEST as MANIFEST
from sentinel.contract.rundir import CKPT_DIR, STEP_DIR_RE, VERIFIED, checkpoint_dir_name
from sentinel.runfiles.base import RunDirError, _int_in, load_json_file

step_dir_name = checkpoint_dir_name


@dataclass
class Checkpoint:
    step: int
    path: Path
    manifest: dict | None
    bytes: int
    created: float | None
    checksum: str  # checksum_ok | corrupt | incomplete | unverified (not re-hashed)
    problem: str | None = None
    verify_resume: dict | None = None  # the verified.json entry, if any

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def status(self) -> str:
        """What an operator should believe: a bad checksum beats an old verify-resume result."""
        if self.checksum in ("corrupt", "incomplete"):
            return self.checksum
        if self.verify_resume and self.verify_resume.get("verified") in ("resume_verified", "failed"):
            return str(self.verify_resume["verified"])
        return self.checksum

    @property
    def usable(self) -> bool:
        return self.checksum in ("checksum_ok", "unverified") and self.status != "failed"

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "name": self.name, "path": str(self.path), "bytes": self.bytes, "created": self.created,
            "age_seconds": (time.time() - self.created) if self.created else None, "verified": self.status,
            "checksum": self.checksum, "problem": self.problem, "verify_resume": self.verify_resume,
            # from the manifest: shown only when they are what the trainer writes (a hostile "x" is "-")
            "timeline": _int_in((self.manifest or {}).get("timeline"), 0, MAX_TIMELINE),
            "tokens": _int_in((self.manifest or {}).get("tokens"), 0, MAX_COUNT),
            "world_size": _int_in((self.manifest or {}).get("world_size"), 1, 1 << 20),
        }


def _dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def check_checkpoint(path: Path, *, rehash: bool = True) -> tuple[str, str | None, dict | None]:
    """(state, problem, manifest) for one ``step-N`` directory, like ``trainer.checkpoint.verify``
    (the same manifest validator; the train state is the trainer's to judge, with torch)."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "incomplete", "no manifest (the write never finished)", None
    try:
        manifest = load_json_file(mpath)
    except (OSError, RunDirError):
        return "corrupt", "manifest.json is unreadable", None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "corrupt", "manifest.json is unreadable", None
    try:
        files = check_manifest(manifest, path.name).files
    except ManifestError as e:
        return "corrupt", str(e), manifest
    for name in sorted(files):
        if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/"):
            return "corrupt", f"unsafe file name {name!r} in the manifest", manifest
        if not (path / name).is_file():
            if os.path.lexists(path / name):  # a FIFO, a directory, a link to a device: not what was saved
                return "corrupt", f"{name} is no regular file", manifest
            return "incomplete", f"{name} is missing", manifest
    if not rehash:
        return "unverified", None, manifest
    for name, digest in sorted(files.items()):
        try:
            if not checksum_matches(path / name, digest):
                return "corrupt", f"{name} fails its checksum (corrupt or truncated)", manifest
        except OSError as e:
            return "corrupt", f"{name}: {e.strerror or e}", manifest
    return "checksum_ok", None, manifest


def read_verified(run_dir: str | os.PathLike) -> dict[int, dict]:
    """``checkpoints/verified.json`` written by ``sentinel verify-resume``: {step: {"verified", "time", ...}}."""
    p = Path(run_dir) / CKPT_DIR / VERIFIED
    try:
        raw = load_json_file(p)
    except (OSError, RunDirError):  # an annotation: unreadable, the checkpoints are only not marked verified
        return {}
    out: dict[int, dict] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            try:
                out[int(k)] = v if isinstance(v, dict) else {"verified": str(v)}
            except ValueError:
                continue
    return out


def checkpoint_steps(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory (valid or not), newest first; in-flight ``.tmp-*`` writes excluded."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def load_checkpoint(step: int, path: Path, verified: dict[int, dict] | None = None, *, rehash: bool = True) -> Checkpoint:
    state, problem, manifest = check_checkpoint(path, rehash=rehash)
    size = _int_in((manifest or {}).get("bytes"), 0, MAX_COUNT)
    size = _dir_bytes(path) if size is None else size
    created = finite_or_none(manifest.get("created")) if manifest else None
    if created is None:
        try:
            created = path.stat().st_mtime
        except OSError:
            created = None
    return Checkpoint(step=step, path=path, manifest=manifest, bytes=size, created=created, checksum=state,
                      problem=problem, verify_resume=(verified or {}).get(step))


def list_checkpoints(run_dir: str | os.PathLike, *, rehash: bool = True) -> list[Checkpoint]:
    """All checkpoints of a run, newest first, each with its checksum / verification state."""
    verified = read_verified(run_dir)
    return [load_checkpoint(s, p, verified, rehash=rehash) for s, p in checkpoint_steps(run_dir)]


def find_checkpoint(run_dir: str | os.PathLike, step: int, *, rehash: bool = True) -> Checkpoint | None:
    p = Path(run_dir) / CKPT_DIR / step_dir_name(step)
    if not p.is_dir():
        return None
    return load_checkpoint(step, p, read_verified(run_dir), rehash=rehash)
