"""The embedded bus's files in ``RUN_DIR/bus/`` (0700): their names, the private tokens (password,
secret) made on first use, the lock two starters agree on, and the small files read back (url, pid).

See ``sentinel.embedded`` for the layout and the server they belong to.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from sentinel.bus_url import BusError
from sentinel.contract.fsio import read_regular_file

URL_FILE = "url"
SECRET_FILE = "secret"
CONF_FILE = "server.conf"
PID_FILE = "server.pid"
LOG_FILE = "server.log"
LOCK_FILE = "lock"
PASSWORD_FILE = "password"


def bus_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir).resolve() / "bus"


@contextlib.contextmanager
def _locked(d: Path, timeout: float) -> Iterator[None]:
    """Exclusive fcntl lock on ``d/lock`` so concurrent starters agree on one server."""
    fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() > deadline:
                    raise BusError(f"timed out waiting for the embedded bus lock {d / LOCK_FILE}") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _ensure_private_token(path: Path) -> None:
    """Create ``path`` with 32 random bytes as hex, mode 0600, unless it exists. A symbolic link
    there is refused (a dangling one read as "no password" and the bus ran with none); an empty
    file (a crash or a full disk while it was written) is made anew, for the same reason."""
    import stat

    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise BusError(f"{path} is a symbolic link: refusing it (delete it, and a new one is made)")
    if st is not None and stat.S_ISREG(st.st_mode) and st.st_size == 0:
        path.unlink()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def _ensure_secret(d: Path) -> None:
    _ensure_private_token(d / SECRET_FILE)
    _ensure_private_token(d / PASSWORD_FILE)


def read_password(d: Path) -> str | None:
    """The embedded bus's password (``bus/password``), or None for a bus made before passwords."""
    try:  # a regular file of at most 64 KiB (a FIFO there would wait forever)
        pw = read_regular_file(d / PASSWORD_FILE, 1 << 16).decode().strip() or None
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise BusError(f"the bus password file {d / PASSWORD_FILE} is unreadable ({getattr(e, 'strerror', None) or e})") from None
    if pw and any(ord(c) < 32 or ord(c) == 127 for c in pw):
        # a line break or control character inside: the server's config line breaks, and its error
        # quoted the password's first line (the password itself is never shown)
        raise BusError(f"the bus password file {d / PASSWORD_FILE} holds a line break or a control character: write "
                       "one line of printable characters, or delete it and a new one is made")
    return pw


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _make_private(d: Path) -> None:
    """bus/ is 0700 and everything in it 0600: the AOF holds every directive and step record."""
    os.chmod(d, 0o700)
    for root, dirs, files in os.walk(d, followlinks=False):  # a link's target is outside bus/: left alone
        for name in dirs + files:
            p = os.path.join(root, name)
            if os.path.islink(p):
                continue
            with contextlib.suppress(OSError):
                os.chmod(p, 0o700 if os.path.isdir(p) else 0o600)


def _read_small(path: Path) -> str:
    """A small bus file's text ('' when missing). A FIFO there waited for ever, SIGTERM ignored."""
    try:
        return read_regular_file(path, 4096).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        return ""
    except OSError as e:
        raise BusError(f"{path} is unreadable ({e.strerror or e}): delete it (it is remade)") from None


_URL = re.compile(r"redis://127\.0\.0\.1:(\d{1,5})/0")


def _read_url(d: Path) -> str:
    """``bus/url`` when it is one this module wrote (``redis://127.0.0.1:PORT/0``), else ''. Any
    other text there (a port past 65535, binary bytes) was a traceback in every client."""
    text = _read_small(d / URL_FILE)
    m = _URL.fullmatch(text)
    return text if m and 0 < int(m.group(1)) < 65536 else ""


def _read_pid(d: Path) -> int | None:
    try:
        pid = int(_read_small(d / PID_FILE))
    except (ValueError, BusError):
        return None
    return pid if 0 < pid < 1 << 22 else None
