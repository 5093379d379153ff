"""File I/O both sides share: the one atomic write, directory fsync, file sha256 and bounded read.

* ``atomic_write_text``: tmp + fsync + rename + fsync(dir): a crash leaves the old content or the
  new, never half;
* ``fsync_dir``: make a rename or a new file in a directory durable;
* ``sha256_file``: the checksum recorded in checkpoint manifests and dataset metadata;
* ``open_regular`` / ``read_regular_file``: read a state file only when it is a regular file, and
  only so much of it (a symlink to /dev/zero or a FIFO is refused, not read forever).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path

from sentinel.contract.limits import MAX_STATE_BYTES

__all__ = ["MAX_STATE_BYTES", "UnreadableFileError", "atomic_write_text", "fsync_dir", "open_regular",
           "read_regular_file", "sha256_file"]


def sha256_file(path, bufsize: int = 1 << 20) -> str:
    """Checksum of one file (hex), as recorded in checkpoint manifests and dataset metadata."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path) -> None:
    """fsync a directory, so the names created or renamed in it survive a crash."""
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
