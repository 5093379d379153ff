"""One trainer per run directory: an exclusive ``flock`` on ``RUN_DIR/trainer.lock``.

Two trainers on one run dir would interleave steps.jsonl, race on checkpoints and each resume the
other's state. Only the launcher's rank 0 takes the lock (torchrun's other ranks of the same run
never touch it), and the kernel drops it when the process dies, SIGKILL included, so a resume after
a crash never finds a stale lock. The file holds the owner's pid, host and start time, for the
message the second trainer prints.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

LOCK_NAME = "trainer.lock"


class RunDirBusy(Exception):
    """Another live process holds the run dir's lock (one-line message)."""


_held: dict[str, int] = {}  # run dirs this process holds (a second Trainer in the same process is fine)


def acquire(run_dir: Path) -> int:
    """Take the lock (non-blocking); return the fd, kept open for the process lifetime."""
    path = Path(run_dir) / LOCK_NAME
    key = str(path.resolve())
    if key in _held:
        return _held[key]
    # never through a symlink (it would be truncated and overwritten wherever it points), and only a
    # regular file (a FIFO there would block the open; O_NONBLOCK keeps it from waiting)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise RunDirBusy(f"{path} is a symbolic link: refusing to write the lock through it (remove it)") from None
        raise RunDirBusy(f"{path} cannot be opened as the run's lock file ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise RunDirBusy(f"{path} is not a regular file: it cannot be the run's lock file (remove it)")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner(fd)
        os.close(fd)
        raise RunDirBusy(f"run dir {run_dir} is in use by another trainer{owner}; "
                         "stop it first (two trainers on one run dir would corrupt its log and checkpoints)") from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
    _held[key] = fd
    return fd


def _owner(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f" (pid {int(info['pid'])} on {str(info['host'])[:64]}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""
