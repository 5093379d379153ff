"""A checkpoint file written once: its checksum from the bytes as they are written, its writeback started early.

``HashedFile`` is the file object ``torch.save`` (or the JSON writer) writes into. The kernel is asked
to start writing its pages to disk as they come (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the
fsync at the commit finds little left to do, and the checksum comes from the bytes written, not from
reading the file back (bench/checkpoint_cost.py: that read-back was a third of a 39 MB save).

A checkpoint's tensor files are hashed by ``HashLater``: all of them are written first, then hashed from
the same buffers (which nothing changes until the save is over), so the disk drains the writeback while
the rank hashes; a rank with cores to spare (``HASH_THREAD_MIN_CORES``) also hashes on a helper thread
while it writes. Other files (JSON, torch's format, whose writer may reuse its buffers) are hashed inline,
before each write.

``write_tensors``, ``write_json`` and ``write_torch`` create such a file from an object (``trainer.checkpoint``
writes a checkpoint's files with them: ``write_file`` picks by the name's suffix).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sentinel.contract.fsio import Checksum
from trainer import tensor_file

_SMALL = 1 << 16  # smaller writes are gathered (zip headers, pickle data), then hashed and written together
# a rank with this many cores to itself (``DistEnv.core_share``) hashes on a helper thread while it writes
# (``HashLater(helper=True)``). With two, the other core slows the writes: on the project's 2-vCPU VM, a helper
# hashing `small`'s files (39 MB) took the median save from 29.8 to 25.5 ms, but its p90 from 40 to 81 ms, a 13 MB
# write then taking 32 ms, not 3 (2026-12-02; with a hand-off at each write, 2026-11-30: p90 69-73 against 28-29 ms)
HASH_THREAD_MIN_CORES = 3
_WRITEBACK = 1 << 22  # start the disk write every 4 MiB
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):  # not Linux/glibc: writeback starts at the fsync instead
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to start writing ``[offset, offset+nbytes)`` (0: to the end) to disk, without
    waiting. An optimisation only: durability still comes from the fsync, so a failure is ignored."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


_PIECE = 1 << 22  # HashLater hashes in pieces of at most 4 MiB: neither thread holds a file long


class _Pending:
    """One file's buffers, written and not yet hashed, and its running checksum (``lock``: one hasher at a time)."""

    __slots__ = ("done", "finished", "h", "lock", "pieces")

    def __init__(self) -> None:
        self.h, self.pieces, self.done, self.finished, self.lock = Checksum(), [], 0, False, threading.Lock()

    def hash_one(self) -> bool:  # under ``lock``
        if self.done >= len(self.pieces):
            return False
        self.h.update(self.pieces[self.done])
        self.pieces[self.done] = None  # the buffer is the caller's: hold it no longer than needed
        self.done += 1
        return True


class HashLater:
    """The checksums of a set of files whose buffers stay unchanged until ``checksums()`` (a save's state does
    not change until the save returns), computed off the writes' critical path.

    Hashing each buffer before writing it keeps the disk idle while the rank hashes. Here the caller writes
    every file first (its writeback started every 4 MiB) and then hashes them while the disk drains. On the
    project's 2-vCPU VM, `small` (39 MB, one rank) saved at 0.88-0.90 of a raw write + fsync of its bytes
    against 0.78 hashed before each write (docs/benchmarks/checkpoint-cost.md, change 29).

    With ``helper`` (a rank with cores to spare: ``HASH_THREAD_MIN_CORES``) a thread hashes from the first
    piece written on, woken once a piece's worth waits; the caller, once every file is written, hashes what
    the helper has not reached, from the last file back, so that neither waits for the other longer than one
    4 MiB piece, and a helper that never gets a core costs nothing but its help."""

    def __init__(self, helper: bool = False) -> None:
        self._files: dict[Path, _Pending] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._unclaimed = 0  # bytes written since the helper was last woken
        self._helper = threading.Thread(target=self._help, name="ckpt-hash", daemon=True) if helper else None
        if self._helper is not None:
            self._helper.start()

    def __enter__(self) -> HashLater:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self, path: Path) -> _Pending:
        with self._cv:
            p = self._files[path] = _Pending()
        return p

    def written(self, p: _Pending, mv: memoryview) -> None:
        with self._cv:
            p.pieces.extend(mv[i:i + _PIECE] for i in range(0, mv.nbytes, _PIECE))
            self._unclaimed += mv.nbytes
            if self._unclaimed >= _PIECE:  # the helper is woken once a piece's worth waits, not at every write
                self._unclaimed = 0
                self._cv.notify()

    def _next(self) -> _Pending | None:  # under ``_cv``: the first file with a piece to hash
        return next((p for p in self._files.values() if not p.finished and p.done < len(p.pieces)), None)

    def _help(self) -> None:
        while True:
            with self._cv:
                while (p := self._next()) is None:
                    if self._closed:
                        return
                    self._cv.wait()
            with p.lock:  # the caller may hold it, finishing this file: then it is finished when we get it
                if not p.finished:
                    p.hash_one()

    def checksums(self) -> dict[Path, str]:
        """path -> checksum of every file opened; forgets their buffers (call once every file is written)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            files = list(self._files.items())
        for _, p in reversed(files):
            with p.lock:
                while p.hash_one():
                    pass
                p.finished = True
        self.close()
        return {path: p.h.hexdigest() for path, p in files}

    def close(self) -> None:
        """Stop the helper (a save that failed midway: the buffers are dropped unhashed)."""
        with self._cv:
            self._closed = True
            for p in self._files.values():
                p.finished = True
            self._files = {}
            self._cv.notify()
        if self._helper is not None:
            self._helper.join()


class HashedFile:
    """A new file (``O_EXCL``) written through ``write``, its checksum (``blake3:<hex>``) computed from the same bytes:
    inline, before each write, or with ``later`` by ``later`` (``HashLater``), once every file is written."""

    def __init__(self, path: Path, *, later: HashLater | None = None):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.h = Checksum()
        self.later, self.pending_hash = later, later.open(path) if later is not None else None
        self.pending = bytearray()
        self.size = 0
        self.flushed = 0  # bytes whose writeback has been started

    def _write(self, mv: memoryview) -> None:
        while mv:
            mv = mv[os.write(self.fd, mv):]

    def _emit(self, mv: memoryview) -> None:
        if self.later is not None:  # the gathered small writes come here in a fresh buffer each time
            self._write(mv)
            self.later.written(self.pending_hash, mv)
        else:
            self.h.update(mv)
            self._write(mv)
        self.size += mv.nbytes
        if self.size - self.flushed >= _WRITEBACK:
            start_writeback(self.fd, self.flushed, self.size - self.flushed)
            self.flushed = self.size

    def _drain(self) -> None:
        if self.pending:
            self._emit(memoryview(self.pending))
            self.pending = bytearray()

    def write(self, data) -> int:
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        if n < _SMALL:
            self.pending += mv
            if len(self.pending) >= _SMALL:
                self._drain()
        else:
            self._drain()
            self._emit(mv)
        return n

    def flush(self) -> None:
        self._drain()

    def close(self) -> str | None:
        """Write what is gathered, start the writeback of the rest, close; return the checksum (None when
        ``later`` computes it)."""
        try:
            self._drain()
            start_writeback(self.fd)
        finally:
            os.close(self.fd)
        return None if self.later is not None else self.h.hexdigest()

    def abort(self) -> None:
        os.close(self.fd)


_CRC_LOCK = threading.Lock()


def _write_new(path: Path, fill: Callable[[HashedFile], None], *, sync: bool, later: HashLater | None = None) -> str | None:
    """Create ``path`` (it must not exist), let ``fill`` write it, return its checksum (None with ``later``,
    which computes it). ``sync``: fsync it too (a checkpoint's files are fsynced together when the
    checkpoint is finalised instead)."""
    f = HashedFile(path, later=later)
    try:
        fill(f)
        if sync:
            f.flush()
            os.fsync(f.fd)
    except BaseException:
        f.abort()
        raise
    return f.close()


@contextlib.contextmanager
def _no_zip_crc():
    cfg = getattr(getattr(getattr(torch.utils, "serialization", None), "config", None), "save", None)  # torch >= 2.6
    if cfg is None:
        yield
        return
    with _CRC_LOCK:  # a process-wide setting; an async save's thread may be writing at the same time
        old = cfg.compute_crc32
        cfg.compute_crc32 = False
        try:
            yield
        finally:
            cfg.compute_crc32 = old


def _torch_save(obj: Any, f: HashedFile) -> None:
    with _no_zip_crc():
        try:
            torch.save(obj, f)
        except RuntimeError as e:
            # torch's zip writer turns a failed write (disk full, EFBIG, quota) into a RuntimeError
            # ("unexpected pos ..."); surface the OSError underneath so callers handle it as I/O
            cause = e.__context__
            while cause is not None and not isinstance(cause, OSError):
                cause = cause.__context__
            raise cause or OSError(errno.EIO, f"torch.save failed: {str(e).splitlines()[0]}") from None


def write_torch(path: Path, obj: Any, *, sync: bool = True) -> str:
    """``torch.save`` into a new file ``path``; return the file's checksum (computed from the bytes as
    they are written: ``trainer.checkpoint_io``).

    Without the zip format's per-record CRC-32: the manifest's checksum, checked before any load,
    covers every byte already, and the CRC cost a third of the serialisation time of a 39 MB
    checkpoint (bench/checkpoint_cost.py). ``torch.load`` reads such files as any other."""
    return _write_new(path, lambda f: _torch_save(obj, f), sync=sync)


def write_json(path: Path, obj: Any, *, sync: bool = True) -> str:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    return _write_new(path, lambda f: f.write(data), sync=sync)


def write_tensors(path: Path, obj: Any, *, sync: bool = True, later: HashLater | None = None) -> str | None:
    """``obj`` as a tensor file (``trainer/tensor_file.py``: the safetensors layout) in a new file ``path``; its
    checksum (with ``later``: None, and ``later.checksums()`` has it once every file is written). The tensors'
    bytes go to the file as they are in memory: nothing is serialised but the header."""
    header, data = tensor_file.encode(obj)

    def fill(f: HashedFile) -> None:
        f.write(header)
        for raw in data:
            f.write(raw)

    return _write_new(path, fill, sync=sync, later=later)


def write_file(path: Path, obj: Any, *, sync: bool = True, later: HashLater | None = None) -> str | None:
    """``obj`` into a new file ``path`` in the format its name says: ``.json``, ``.safetensors`` or else torch's.
    Its checksum; None for a tensor file when ``later`` computes it (``HashLater``)."""
    if path.suffix == ".json":
        return write_json(path, obj, sync=sync)
    if path.suffix == tensor_file.SUFFIX:
        return write_tensors(path, obj, sync=sync, later=later)
    return write_torch(path, obj, sync=sync)
