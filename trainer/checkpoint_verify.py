"""Reading a checkpoint directory back: which step directories exist (``list_checkpoints``), and
whether one is valid (``verify``, ``verify_share``): a well-formed manifest naming its step, every file
it lists present with a matching checksum, and a ``train_state.json`` that passes its strict schema.
``trainer.checkpoint`` writes them (and re-exports all of this); ``trainer.checkpointing`` loads them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sentinel.contract.checkpoints import ManifestError, TrainStateFile, check_manifest, first_error
from sentinel.contract.fsio import announce_dir, checksums_match
from sentinel.contract.rundir import CHECKPOINT_MANIFEST as MANIFEST
from sentinel.contract.rundir import STEP_DIR_RE as STEP_DIR

# torch's format (a checkpoint written before tensor files): ``torch.load`` never opens bytes its reader
# has not hashed itself, so each rank hashes every such file instead of its share (``verify_share``)
TORCH_SUFFIX = ".pt"


class CheckpointError(Exception):
    """One-line problem with a checkpoint (corrupt, missing, incompatible)."""



@dataclass
class ValidCheckpoint:
    step: int
    path: Path
    manifest: dict

    @property
    def bytes(self) -> int:
        return int(self.manifest.get("bytes", 0))


def _read_bytes(path: Path) -> bytes:
    """A small file's bytes through ``os.read``, without the buffered file object ``Path.read_bytes``
    builds around it (a checkpoint's manifest: 10.7 us that way, 3.3 us this)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _read_json(path: Path, what: str, data: bytes | None = None):
    try:
        return json.loads(_read_bytes(path) if data is None else data)
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8/JSON, or nested past the parser
        raise CheckpointError(f"{path.parent.name}: {what} is unreadable") from None


def checksum_share(names: list[str], sizes: list[int], index: int, count: int) -> list[str]:
    """The files the ``index``-th of ``count`` ranks of one node hashes when they verify a checkpoint
    together: largest first, each to the rank with the fewest bytes so far (ties: the fewest files,
    then the lowest index). A function of the names and sizes alone, so the node's ranks agree on it
    without talking."""
    load, nfiles = [0] * count, [0] * count
    mine = []
    for size, name in sorted(zip(sizes, names), key=lambda x: (-x[0], x[1])):
        r = min(range(count), key=lambda i: (load[i], nfiles[i], i))
        load[r] += size
        nfiles[r] += 1
        if r == index:
            mine.append(name)
    return mine


def files_fingerprint(names: list[str], sizes: list[int]) -> int:
    """63 bits naming the files a rank sees (names and sizes): ranks that verify a share each must see
    the same files, or one rank's check would vouch for a file another rank reads."""
    text = "\n".join(f"{n}\t{size}" for n, size in sorted(zip(names, sizes)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def verify(path: Path) -> dict:
    """Check a checkpoint directory against its manifest; return the manifest or raise CheckpointError.

    Valid means: a well-formed manifest naming this step, listing every file the step needs
    (``sentinel.contract.checkpoints.check_manifest``), each present with a matching checksum, and a
    ``train_state.json`` that passes its strict schema. Checksums run before any parsing of the
    files they cover (``verify_share``'s ``meanwhile`` is the only way to parse earlier), and nothing
    here unpickles anything."""
    return verify_share(path)[0]


def verify_share(path: Path, share: tuple[int, int] | None = None, keep: dict | None = None,
                 meanwhile: Callable[[Path, Any], None] | None = None, ready: Callable[[], None] | None = None) -> tuple[dict, int, dict]:
    """``verify``, hashing only this rank's share of the files with ``share=(index, count)``
    (``checksum_share``), and every file of torch's format (``TORCH_SUFFIX``); returns the manifest,
    the fingerprint of the files seen (0 without a share) and ``train_state.json`` as
    ``read_train_state`` gives it. The caller combines every rank's verdict, and checks that all saw
    the same files, before anything is applied (``trainer.checkpointing.TrainerCheckpoints.load``).
    The rest is checked in full. With ``keep``
    (a dict), each small file hashed through a mapping leaves that mapping there, by path, for its
    reader (``sentinel.contract.fsio.checksums_match``); ``train_state.json`` is parsed from it.
    ``meanwhile(file, mapping)``: ``checksums_match``'s, work for while the disk reads, before each file's hash
    (for ``train_state.json`` with ``keep``, the state read from it instead, the one returned).
    ``ready()``: work that needs no file, for while the disk fetches the manifest (called once the
    directory is announced, before the manifest is read: a cold read's first round trip)."""
    if not os.path.isdir(path):  # os.path's: pathlib's checks cost 25 us each, on every load
        what = "a dangling link" if os.path.islink(path) and not path.exists() else "a file, not a directory"
        raise CheckpointError(f"{path.name}: is {what} (not a checkpoint)")
    seen = announce_dir(path) if keep is not None else {}  # the manifest is read while the rest arrives
    if ready is not None:
        ready()
    mpath = path / MANIFEST
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path.name}: incomplete (no manifest)")
    raw = _read_json(mpath, "manifest")
    try:
        manifest = check_manifest(raw, path.name)
    except ManifestError as e:
        raise CheckpointError(f"{path.name}: {e}") from None
    files = manifest.files
    names = sorted(files)
    for name in names:  # the directory's scan saw most (a file in a subdirectory, dcp/'s, it did not)
        if name not in seen and not os.path.isfile(f := path / name):
            raise CheckpointError(f"{path.name}: {name} " + ("is no regular file" if os.path.lexists(f) else "is missing"))
    fingerprint = 0
    if share is not None:
        sizes = [seen[n] if n in seen else os.stat(path / n).st_size for n in names]
        fingerprint = files_fingerprint(names, sizes)
        index, count = share
        if 0 <= index < count and count > 1:  # else (one rank, or a launcher's odd local rank): every file
            mine = set(checksum_share(names, sizes, index, count))
            names = [n for n in names if n in mine or n.endswith(TORCH_SUFFIX)]
    ts_path, early = path / "train_state.json", []

    def during(file: Path, mapped) -> None:  # before each file's hash, while the disk reads
        if file == ts_path and keep is not None:
            try:
                early.append(read_train_state(path, manifest.step, bytes(mapped)))
            except CheckpointError as e:
                early.append(e)
                return
            mapped = early[0]  # what ``meanwhile`` is given of train_state.json: the state read
        if meanwhile is not None:
            meanwhile(file, mapped)

    if names:
        pairs = [(path / n, files[n]) for n in names]
        known = {f: seen[n] for (f, _), n in zip(pairs, names) if n in seen}
        ok = checksums_match(pairs, keep, during, known)
        for name, good in zip(names, ok):
            if not good:
                raise CheckpointError(f"{path.name}: {name} fails its checksum (corrupt or truncated)")
    hashed = keep.get(ts_path) if keep is not None else None  # left in ``keep``: unmapped with the rest
    if hashed is not None and early:  # read from the very mapping that was hashed, while the disk read
        if isinstance(early[0], CheckpointError):
            raise early[0]
        state = early[0]
    else:
        state = read_train_state(path, manifest.step, None if hashed is None else bytes(hashed))
    if state["world_size"] != manifest.world_size:
        raise CheckpointError(f"{path.name}: train_state.json world_size {state['world_size']} differs from the manifest's {manifest.world_size}")
    return raw, fingerprint, state


def read_train_state(path: Path, step: int | None = None, data: bytes | None = None) -> dict:
    """``train_state.json`` of a checkpoint, validated (types, ranges, consistency with ``step``);
    ``data``: its bytes, already read (and hashed)."""
    try:
        if data is None:
            state = TrainStateFile.model_validate(_read_json(path / "train_state.json", "train_state.json"))
        else:  # pydantic's own JSON reader: half the time of json.loads and a validation of its dicts
            state = TrainStateFile.model_validate_json(data)
    except ValidationError as e:
        if data is not None and e.errors()[0]["type"] in ("json_invalid", "recursion_loop"):
            raise CheckpointError(f"{path.name}: train_state.json is unreadable") from None
        raise CheckpointError(f"{path.name}: train_state.json is malformed ({first_error(e)})") from None
    if step is not None and state.step != step:
        raise CheckpointError(f"{path.name}: train_state.json says step {state.step}, the checkpoint is step {step}")
    return state.model_dump()


def list_checkpoints(ckpt_root: Path, *, strays: bool = False) -> list[tuple[int, Path]]:
    """All step directories (valid or not), newest first. ``strays``: also what bears a step
    directory's name but is none (a plain file, a FIFO, a dangling link), so that a resume names it
    when it passes it over instead of skipping it in silence."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for p in ckpt_root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (strays or p.is_dir()):
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)
