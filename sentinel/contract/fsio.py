"""File I/O both sides share: the one atomic write, directory fsync, file checksums and bounded read.

* ``atomic_write_text``: tmp + fsync + rename + fsync(dir): a crash leaves the old content or the
  new, never half;
* ``fsync_dir``: make a rename or a new file in a directory durable;
* ``Checksum`` / ``file_checksum`` / ``checksum_matches`` / ``checksums_match``: the checksum of a checkpoint file, as its
  manifest records it: ``blake3:<64 hex>`` (BLAKE3, 256 bits). Manifests written before BLAKE3 record
  a bare sha256 (64 hex), and still verify: the recorded value says which function to run;
* ``announce``: tell the kernel which small files are about to be read, so their reads overlap;
* ``map_file``: a private mapping of a regular file, the one a checksum and its reader can share;
* ``sha256_file``: the checksum recorded in dataset metadata (and in older checkpoint manifests);
* ``open_regular`` / ``read_regular_file``: read a state file only when it is a regular file, and
  only so much of it (a symlink to /dev/zero or a FIFO is refused, not read forever).
"""

from __future__ import annotations

import atexit
import collections
import errno
import functools
import hashlib
import hmac
import mmap
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import blake3

from sentinel.contract.limits import MAX_STATE_BYTES

__all__ = ["ANNOUNCE_MAX_BYTES", "CHECKSUM_PREFIX", "MAX_STATE_BYTES", "TRASH_PREFIX", "Checksum", "UnreadableFileError",
           "announce", "announce_dir", "atomic_write_text", "checksum_matches", "checksums_match", "clear_trash", "file_checksum", "fsync_dir",
           "map_file", "move_to_trash", "open_regular", "read_regular_file", "release_later", "remove_dir", "sha256_file", "wait_released"]

CHECKSUM_PREFIX = "blake3:"
# BLAKE3 rather than sha256: as collision-resistant (a manifest's digest, carried signed on the bus,
# pins every byte), and 3.7x faster on one core (39 MB: 5.0 ms against 18.4 ms with SHA-NI; an AMD EPYC
# here). A checkpoint's save and load hash every byte once, so that was a third of a 39 MB save
# (docs/benchmarks/checkpoint-cost.md).
_READ_CHUNK = 1 << 20


class Checksum:
    """The running checksum of bytes as they are written: ``update`` (releases the GIL for large
    buffers), then ``hexdigest`` -> ``blake3:<64 hex>``, the form a manifest records."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = blake3.blake3()

    def update(self, data) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return CHECKSUM_PREFIX + self._h.hexdigest()


def file_checksum(path, *, like: str | None = None) -> str:
    """A file's checksum as a manifest records it (``blake3:<hex>``); with ``like`` a bare 64-hex
    sha256 (a manifest written before BLAKE3), the file's sha256 instead, so the two compare."""
    if like is not None and not like.startswith(CHECKSUM_PREFIX):
        return sha256_file(path)
    h = blake3.blake3()
    buf = bytearray(_READ_CHUNK)  # one buffer, reused: no fresh pages per chunk
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return CHECKSUM_PREFIX + h.hexdigest()


def checksum_matches(path, recorded: str) -> bool:
    """Whether the file at ``path`` has the checksum a manifest recorded for it (either form)."""
    return hmac.compare_digest(file_checksum(path, like=recorded), recorded)


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="checksums")


os.register_at_fork(after_in_child=_hash_pool.cache_clear)  # a forked child has none of the parent's threads


# what ``release_later`` was given, let go by a thread that looks every RELEASE_EVERY_SECONDS: waking a
# thread to do it (a queue, a pool) cost the load 40 us of its 2 ms on this VM, the unmapping 70-130 us
RELEASE_EVERY_SECONDS = 0.05
_pending: collections.deque = collections.deque()
_releasing = threading.Lock()


@functools.cache
def _releaser() -> threading.Thread:
    th = threading.Thread(target=_release_forever, name="release", daemon=True)
    th.start()
    return th


def _release_forever() -> None:
    while True:
        time.sleep(RELEASE_EVERY_SECONDS)
        if _pending:
            wait_released()


def _forget_in_child() -> None:  # a forked child has none of the parent's threads
    _releaser.cache_clear()
    _pending.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def release_later(obj) -> None:
    """Let go of ``obj`` (what holds a load's mappings: the tensors that view them) within
    ``RELEASE_EVERY_SECONDS``, on a thread of its own, so that the unmapping and the tensors' freeing
    follow the load instead of ending it. The caller keeps no reference of its own.
    ``wait_released`` lets go of everything handed over, at once."""
    _releaser()
    _pending.append(obj)


def wait_released() -> None:
    """Let go of everything given to ``release_later`` so far, on this thread, and return once it is
    (its pages unmapped: a page still mapped stays in the page cache, which a benchmark's eviction
    must not find)."""
    with _releasing:
        while _pending:
            _pending.popleft()


# before the interpreter finalises, its main thread lets go of what is left, after the releaser's turn in
# progress if there is one (``wait_released``'s lock): a daemon thread still inside torch's deleter when
# finalisation begins is ended there by ``pthread_exit``, and its C++ frames abort the process
# ("terminate called without an active exception", exit -6: a trainer that stopped right after a load)
atexit.register(wait_released)


# a file up to this size is announced to the kernel before any is read (``announce``); a larger one
# is read at the disk's bandwidth by the kernel's own readahead, which an announcement only delays
ANNOUNCE_MAX_BYTES = 4 << 20


def announce(paths) -> None:
    """Tell the kernel that every file of ``paths`` up to ``ANNOUNCE_MAX_BYTES`` is about to be read
    (``POSIX_FADV_WILLNEED``), so that their reads go to the disk at once instead of one round trip
    after another. A checkpoint of small files is latency-bound: the checksums of ``tiny``'s four
    files (1.5 MB) read from a cold cache in 1.39-1.45 ms announced, 1.68-1.84 ms not (a plain
    sequential read of them: 1.45-1.60 ms). Announcing the 13 and 26 MB files of ``small`` cost
    1-3 ms of 24 (docs/benchmarks/checkpoint-cost.md). Each file is asked for whole: asking for the
    first 64 KiB of every file before the rest of any made ``tiny``'s load 0.1 ms slower. Advice
    only: a failure is ignored."""
    if not hasattr(os, "posix_fadvise"):
        return
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            continue  # the read that follows reports it
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and 0 < st.st_size <= ANNOUNCE_MAX_BYTES:
                os.posix_fadvise(fd, 0, st.st_size, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def announce_dir(path) -> dict[str, int]:
    """``announce`` every regular file of the directory ``path`` (not its links or subdirectories), the
    smallest first, before anything names them: a checkpoint's manifest is read while its files are
    already on their way, so their reads start one round trip earlier (on ``tiny``, the manifest's read
    and check took 0.25 ms of a 2 ms load before any other file was asked for). Returns the size of
    each regular file found, by name: those up to ``ANNOUNCE_MAX_BYTES`` were announced, and
    ``checksums_match(announced=...)`` neither announces them again nor asks their sizes again."""
    try:
        with os.scandir(path) as it:
            found = {e.name: e.stat(follow_symlinks=False).st_size for e in it if e.is_file(follow_symlinks=False)}
    except OSError:
        return {}
    announce([os.path.join(path, name) for name, size in sorted(found.items(), key=lambda x: x[1]) if 0 < size <= ANNOUNCE_MAX_BYTES])
    return found


def map_file(path) -> mmap.mmap | None:
    """A private (copy-on-write) mapping of the regular file at ``path``; None for an empty file or
    anything else (a FIFO, a device). Raises OSError as ``open`` does."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            return None
        return mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)


def _mapped_checksum_matches(path, recorded: str, keep: dict | None = None, mapped: mmap.mmap | None = None) -> bool:
    """``checksum_matches`` of a small regular file mapped into memory and hashed in one call: no
    1 MiB reads through Python. With ``keep``, a file that matches leaves its mapping there
    (``keep[path]``), so that its reader parses the very bytes that were hashed, from the pages the
    hash faulted in, instead of opening the path again (on ``tiny``, 1.87 -> 1.64 ms for the model's
    and the optimizer's files, hashed, parsed and copied from a cold cache). ``mapped``: that mapping,
    made already (``checksums_match``). A sha256 manifest, an empty file or a file gone takes the plain
    path. Like every mapping of a checkpoint's file, this assumes that nothing truncates a committed
    checkpoint's file while it is read (a mapping read past its end faults)."""
    if not recorded.startswith(CHECKSUM_PREFIX):
        return checksum_matches(path, recorded)
    if mapped is None:
        mapped = _map_or_none(path)
    if mapped is None:
        return checksum_matches(path, recorded)
    ok = hmac.compare_digest(CHECKSUM_PREFIX + blake3.blake3().update(mapped).hexdigest(), recorded)
    if ok and keep is not None:
        keep[path] = mapped
    return ok


def _map_or_none(path) -> mmap.mmap | None:
    try:
        return map_file(path)
    except (OSError, ValueError):
        return None


def _small_size(path) -> int | None:
    """The size of a small regular file (up to ``ANNOUNCE_MAX_BYTES``); None for anything else."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # the plain path reports it
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_size <= ANNOUNCE_MAX_BYTES else None


def checksums_match(files: list[tuple[Path, str]], keep: dict | None = None,
                    meanwhile: Callable[[Path, mmap.mmap], None] | None = None, announced: dict | None = None) -> list[bool]:
    """``checksum_matches`` of each (path, recorded) pair. The small files (regular, up to
    ``ANNOUNCE_MAX_BYTES``) are announced (``announce``), the smallest first, then mapped and hashed
    on this thread in that order (with ``keep``, the mapping of each that matches is left in it, by
    path: ``_mapped_checksum_matches``); the others, a file per core (hashing and reading release the
    GIL), on threads kept from call to call (starting a pool per checkpoint load cost more than hashing
    all of ``tiny``'s 1.5 MB). On ``tiny``'s four files (1.5 MB) the checksums took 1.28-1.31 ms from
    a cold cache all on the threads, 1.14-1.17 ms so; from the page cache 0.82-0.84 ms and
    0.39-0.42 ms: a thread's turn costs more than a small file's hash.

    ``meanwhile(path, mapping)``: work for this thread while the disk reads, called for each small
    file mapped, just before it is hashed: its first pages have arrived by then, its last ones often
    not, and the hash follows them as they come; then, when the threads hash several large files, for
    each of those, with a mapping of its own, while they do. What it reads is not verified yet: it may
    parse and check, never apply (``trainer.checkpointing``: a load parses each file's header there).
    It must not raise; a small file's mapping stays the one hashed. ``announced``: regular files whose
    sizes are known, by path, those up to ``ANNOUNCE_MAX_BYTES`` announced already (``announce_dir``)."""
    announced = announced or {}
    sizes = [_small_size(p) if (n := announced.get(p)) is None else n if n <= ANNOUNCE_MAX_BYTES else None for p, _ in files]
    big = [i for i, n in enumerate(sizes) if n is None]
    small = sorted((i for i, n in enumerate(sizes) if n is not None), key=lambda i: sizes[i])  # as announced
    announce([files[i][0] for i in small if files[i][0] not in announced])
    out = [False] * len(files)
    pending = _hash_pool().map(lambda i: checksum_matches(*files[i]), big) if len(big) > 1 else ()
    if len(big) == 1:
        out[big[0]] = checksum_matches(*files[big[0]])
    for i in small:
        path, recorded = files[i]
        mapped = _map_or_none(path) if recorded.startswith(CHECKSUM_PREFIX) else None
        if meanwhile is not None and mapped is not None:
            meanwhile(path, mapped)
        out[i] = _mapped_checksum_matches(path, recorded, keep, mapped)
    if meanwhile is not None and pending:  # the large files, while the threads hash them: a mapping of each
        for i in big:
            if (mapped := _map_or_none(files[i][0])) is not None:
                meanwhile(files[i][0], mapped)
    for i, ok in zip(big, pending):
        out[i] = ok
    return out


def sha256_file(path, bufsize: int = 1 << 20) -> str:
    """Checksum of one file (hex), as recorded in checkpoint manifests and dataset metadata."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path) -> None:
    """fsync a directory, so the names created or renamed in it survive a crash (by name, a file's data too)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path, text: str) -> None:
    """tmp + fsync + rename + fsync(dir): a crash leaves the old content or the new, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class UnreadableFileError(OSError):
    """A path that is no regular file (a device, a FIFO, a socket) or is too large to be what it
    should be. The message says which, without the path: the caller names the file its own way.
    An ``OSError``, so a caller that only knows "unreadable" treats it like any other."""


def _require_regular(mode: int, path) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
    kind = next((name for test, name in kinds if test(mode)), "an unknown kind of file")
    raise UnreadableFileError(f"not a regular file: {kind}")


def open_regular(path):
    """``path`` (symlinks followed) opened for binary reading, when it is a regular file. Reading
    /dev/zero or /dev/urandom never ends and opening a FIFO waits for a writer that may never come,
    so anything else is an ``UnreadableFileError`` (a directory: ``IsADirectoryError``) before it is
    read. Checked before opening (opening a device can have effects) and again on the open file
    (the path can change in between; O_NONBLOCK keeps that open of a FIFO from waiting). Other
    ``OSError`` (missing, a symlink loop, a name too long) passes through."""
    _require_regular(os.stat(path).st_mode, path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        _require_regular(os.fstat(fd).st_mode, path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path, limit: int = MAX_STATE_BYTES) -> bytes:
    """The bytes of a small file: ``open_regular``, and at most ``limit`` bytes (more is an
    ``UnreadableFileError``: a state or rules file of gigabytes is a mistake or an attack, and
    reading it would take the memory with it). The state files both sides read (skip list,
    pending rollback plan, config, manifests) go through here."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnreadableFileError(f"larger than {limit:,} bytes")
    return data


# A checkpoint directory is deleted in two moves: renamed out of the step names, then removed. A kill
# midway through ``shutil.rmtree`` would otherwise leave a step directory without its manifest (or its
# files) under a step's name for good; a ``.trash-*`` directory is what the next start clears instead.
TRASH_PREFIX = ".trash-"


def move_to_trash(path: Path) -> Path:
    """Rename directory ``path`` to ``.trash-<name>-<ns>`` beside it (atomic); return the new path."""
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{time.time_ns()}"
    path.rename(trash)
    return trash


def remove_dir(path: Path) -> None:
    """Delete directory ``path`` so that no crash leaves part of it under its name (``move_to_trash``,
    then the delete, whose errors are ignored: the name is gone already)."""
    shutil.rmtree(move_to_trash(path), ignore_errors=True)


def clear_trash(parent: Path) -> None:
    """Remove what a crash left in ``parent`` while ``remove_dir`` deleted something (at start)."""
    for p in parent.glob(TRASH_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)
