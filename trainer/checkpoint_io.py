"""A checkpoint file written once: its checksum from the bytes as they are written, its writeback started early.

``HashedFile`` is the file object ``torch.save`` (or the JSON writer) writes into. Each large write
goes to the file while a second thread computes the checksum of the same buffer (BLAKE3 and
``os.write`` both release the GIL), and the kernel is asked to start writing those pages to disk at
once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so the fsync at the commit finds little left to
do. The manifest's checksum thus comes from the bytes written, not from reading the file back
(bench/checkpoint_cost.py: that read-back was a third of a 39 MB save).

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
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import torch

from sentinel.contract.fsio import Checksum
from trainer import tensor_file

_SMALL = 1 << 16  # smaller writes are gathered (zip headers, pickle data), then hashed and written together
# a write this large is hashed on the other thread while it is written: below it, the hand-off (~50 us when
# a core is free, a scheduler slice when none is) costs more than hashing inline (256 KiB: ~150 us)
_THREAD = 1 << 18
# ... and only when the rank has this many cores to itself (``DistEnv.core_share``; the caller passes no hasher
# otherwise). With two, the hand-off often waits for the other core to wake: on the project's 2-vCPU VM, 5-7 of
# 40 `small` saves (39 MB) took ~75 ms, not ~22, the hashing thread starting 25-50 ms late. Hashed inline: median
# 27 ms (not 22), the same mean (28-30 ms), p90 28-29 ms (not 69-73), 1-2 of 40 slow (2026-11-30)
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


class HashedFile:
    """A new file (``O_EXCL``) written through ``write``, its checksum (``blake3:<hex>``) computed from the same bytes;
    ``hasher``: a one-thread executor that hashes large writes while they are written."""

    def __init__(self, path: Path, hasher: Executor | None = None):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.h = Checksum()
        self.hasher = hasher
        self.pending = bytearray()
        self.size = 0
        self.flushed = 0  # bytes whose writeback has been started

    def _write(self, mv: memoryview) -> None:
        while mv:
            mv = mv[os.write(self.fd, mv):]

    def _emit(self, mv: memoryview) -> None:
        if self.hasher is not None and mv.nbytes >= _THREAD:
            fut = self.hasher.submit(self.h.update, mv)  # the caller's buffer stays alive until both finish
            try:
                self._write(mv)
            finally:
                fut.result()
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

    def close(self) -> str:
        """Write what is gathered, start the writeback of the rest, close; return the checksum."""
        try:
            self._drain()
            start_writeback(self.fd)
        finally:
            os.close(self.fd)
        return self.h.hexdigest()

    def abort(self) -> None:
        os.close(self.fd)


_CRC_LOCK = threading.Lock()


def _write_new(path: Path, fill: Callable[[HashedFile], None], *, sync: bool, hasher: Executor | None) -> str:
    """Create ``path`` (it must not exist), let ``fill`` write it, return its checksum. ``sync``: fsync
    it too (a checkpoint's files are fsynced together when the checkpoint is finalised instead)."""
    f = HashedFile(path, hasher)
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


def write_torch(path: Path, obj: Any, *, sync: bool = True, hasher: Executor | None = None) -> str:
    """``torch.save`` into a new file ``path``; return the file's checksum (computed from the bytes as
    they are written: ``trainer.checkpoint_io``).

    Without the zip format's per-record CRC-32: the manifest's checksum, checked before any load,
    covers every byte already, and the CRC cost a third of the serialisation time of a 39 MB
    checkpoint (bench/checkpoint_cost.py). ``torch.load`` reads such files as any other."""
    return _write_new(path, lambda f: _torch_save(obj, f), sync=sync, hasher=hasher)


def write_json(path: Path, obj: Any, *, sync: bool = True) -> str:
    data = json.dumps(obj, indent=1, sort_keys=True).encode()
    return _write_new(path, lambda f: f.write(data), sync=sync, hasher=None)


def write_tensors(path: Path, obj: Any, *, sync: bool = True, hasher: Executor | None = None) -> str:
    """``obj`` as a tensor file (``trainer/tensor_file.py``: the safetensors layout) in a new file ``path``; its
    checksum. The tensors' bytes go to the file as they are in memory: nothing is serialised but the header."""
    header, data = tensor_file.encode(obj)

    def fill(f: HashedFile) -> None:
        f.write(header)
        for raw in data:
            f.write(raw)

    return _write_new(path, fill, sync=sync, hasher=hasher)


def write_file(path: Path, obj: Any, *, sync: bool = True, hasher: Executor | None = None) -> str:
    """``obj`` into a new file ``path`` in the format its name says: ``.json``, ``.safetensors`` or else torch's."""
    if path.suffix == ".json":
        return write_json(path, obj, sync=sync)
    if path.suffix == tensor_file.SUFFIX:
        return write_tensors(path, obj, sync=sync, hasher=hasher)
    return write_torch(path, obj, sync=sync, hasher=hasher)
