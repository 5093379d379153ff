"""One trainer per run directory: an exclusive lock on ``RUN_DIR/trainer.lock``.

Two trainers on one run dir would interleave steps.jsonl, race on checkpoints and each resume the
other's state. Only the launcher's rank 0 takes the lock (torchrun's other ranks of the same run
never touch it), and the kernel drops it when the process dies, SIGKILL included, so a resume after
a crash never finds a stale lock. The file holds the owner's pid, host and start time, for the
message the second trainer prints.

Filesystems without ``flock`` (Lustre mounted without ``-o flock`` or ``-o localflock`` answers
ENOSYS; some NFS setups ENOLCK or EOPNOTSUPP) get a one-line warning and a fallback: POSIX record
locks (``fcntl.lockf``, same kernel-dropped semantics), and where those fail too, an exclusive
``O_EXCL`` file ``trainer.lock.owner`` holding pid and host. That last one outlives a killed owner,
so a second trainer on the same host takes it over when the recorded pid is gone; one on another
host cannot see that pid and asks for the file to be removed once that trainer is known dead.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time
from pathlib import Path

LOCK_NAME = "trainer.lock"
OWNER_NAME = "trainer.lock.owner"  # the O_EXCL fallback where the filesystem has no locks at all
# errno of a filesystem that has no (flock / POSIX) locks, as opposed to a lock held by someone
UNSUPPORTED = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK, errno.EINVAL}
BUSY = {errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK}


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
        how = _lock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    if how is None:
        owner = _owner(fd)
        os.close(fd)
        raise RunDirBusy(_busy(run_dir, owner)) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode())
    _held[key] = fd
    return fd


def _busy(run_dir: Path, owner: str) -> str:
    return (f"run dir {run_dir} is in use by another trainer{owner}; "
            "stop it first (two trainers on one run dir would corrupt its log and checkpoints)")


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def _lock(fd: int, path: Path) -> str | None:
    """Lock ``fd`` exclusively without blocking: the way it was taken ("flock", "lockf" or "owner
    file"), or None when another process holds it. Only a filesystem that refuses every lock falls
    through to the owner file."""
    why: list[str] = []
    for name, take in (("flock", fcntl.flock), ("lockf", fcntl.lockf)):
        try:
            take(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in BUSY:
                return None
            if e.errno not in UNSUPPORTED:
                raise RunDirBusy(f"{path} cannot be locked ({e.strerror or e})") from None
            why.append(f"{name}: {errno.errorcode.get(e.errno, e.errno)}")
            continue
        if why:
            _warn(f"the run dir's filesystem has no flock ({why[0]}; Lustre needs -o flock); "
                  f"locked {path.name} with POSIX record locks instead")
        return name
    _owner_file(path.with_name(OWNER_NAME))
    _warn(f"the run dir's filesystem has no file locks ({', '.join(why)}; Lustre needs -o flock); "
          f"using the owner file {OWNER_NAME} instead (a crash on another host leaves it behind)")
    return "owner file"


def _alive_here(info: dict) -> bool:
    """Whether the owner recorded in ``info`` may still run: True unless it was on this host and its
    pid is gone (another host's pid cannot be checked)."""
    if str(info.get("host")) != socket.gethostname():
        return True
    try:
        os.kill(int(info["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, KeyError, TypeError):
        return True
    return True


def _owner_file(path: Path) -> None:
    """Create ``path`` with O_EXCL (pid, host, since) or raise RunDirBusy; a file left by a dead
    process of this host is replaced (once)."""
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
    for attempt in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            try:
                info = json.loads(path.read_bytes() or b"{}")
            except (OSError, ValueError):
                info = {}
            if attempt == 0 and isinstance(info, dict) and info and not _alive_here(info):
                _warn(f"removing the stale {path.name} of pid {info.get('pid')} (no longer running)")
                path.unlink(missing_ok=True)
                continue
            owner = _describe(info) if isinstance(info, dict) else ""
            raise RunDirBusy(_busy(path.parent, owner) + f"; if that trainer is dead, remove {path}") from None
        except OSError as e:
            raise RunDirBusy(f"{path} cannot be created as the run's owner file ({e.strerror or e})") from None
        try:
            os.write(fd, record)
        finally:
            os.close(fd)
        atexit.register(_remove_owner_file, path, os.getpid())
        return
    raise RunDirBusy(_busy(path.parent, ""))


def _remove_owner_file(path: Path, pid: int) -> None:
    try:
        if json.loads(path.read_bytes()).get("pid") == pid == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def _describe(info: dict) -> str:
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f" (pid {int(info['pid'])} on {str(info['host'])[:64]}, since {since})"
    except (ValueError, KeyError, TypeError):
        return ""


def _owner(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return ""
    return _describe(info) if isinstance(info, dict) else ""
