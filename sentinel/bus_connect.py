"""Connections to the control bus: ``connect`` (checked to be a Redis that answers, a password
never sent to a stranger on an embedded bus's port: ``guard_port``), and the translation of
redis-py's exceptions into one-line ``BusError`` / ``BusUnavailable``."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

try:
    from redis.connection import HiredisRespSerializer
    from redis.utils import HIREDIS_AVAILABLE as _HIREDIS
except ImportError:  # pragma: no cover - a redis-py without either name: its own packer
    _HIREDIS = False

from sentinel.bus_url import ENV_PASSWORD, BusError, BusUnavailable, _split_tls_query, redact_url, url_problem


def _describe(r: redis.Redis) -> str:
    """A redacted URL for a client, for error messages."""
    kw = r.connection_pool.connection_kwargs
    scheme = "rediss" if r.connection_pool.connection_class.__name__.startswith("SSL") else "redis"
    user = kw.get("username")
    # a user with no password may be a password whose colon was forgotten (redis://PASSWORD@host): hidden too
    auth = f"{quote(user)}:***@" if user and kw.get("password") else ("***@" if user or kw.get("password") else "")
    if kw.get("path"):  # a unix socket
        return f"unix://{auth}{kw['path']}?db={kw.get('db', 0)}"
    return f"{scheme}://{auth}{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())[:300] or e.__class__.__name__  # a server's raw bytes can run to megabytes
    # redis-py: "Error 111 connecting to 127.0.0.1:6390. Connection refused." -> "Connection refused"
    m = re.match(r"Error (?:-?\d+ )?(?:connecting|while writing) to [^ ]+?\.? (.+)$", msg)
    if m:
        msg = m.group(1)
    return msg.rstrip(".")


def translate(e: BaseException, where: str) -> BusError:
    """Map a redis-py exception to a one-line ``BusError`` (``BusUnavailable`` when retryable)."""
    if isinstance(e, BusError):
        return e
    if isinstance(e, redis.AuthenticationError) or (
        isinstance(e, redis.ResponseError) and str(e).startswith(("WRONGPASS", "NOAUTH"))
    ):
        return BusError(f"authentication failed for {where}: {_one_line(e)}")
    if isinstance(e, redis.exceptions.NoPermissionError) or str(e).startswith("NOPERM"):
        return BusError(f"permission denied at {where}: {_one_line(e)}")
    if isinstance(e, redis.ConnectionError) and re.search(r"SSL|certificate|TLS", str(e)):
        # a certificate problem will not fix itself: not BusUnavailable
        return BusError(f"TLS handshake with {where} failed: {_one_line(e)}")
    if isinstance(e, (redis.ConnectionError, redis.TimeoutError, OSError)):
        return BusUnavailable(f"cannot reach Redis at {where}: {_one_line(e)}")
    return BusError(f"Redis error at {where}: {_one_line(e)}")


@contextlib.contextmanager
def bus_errors(r_or_url: redis.Redis | str) -> Iterator[None]:
    """``with bus_errors(r): ...`` turns redis-py exceptions into one-line ``BusError``s."""
    try:
        yield
    except redis.RedisError as e:
        where = redact_url(r_or_url) if isinstance(r_or_url, str) else _describe(r_or_url)
        raise translate(e, where) from None


def connect(
    url: str,
    *,
    password: str | None = None,
    username: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    timeout: float = 2.0,
    check: bool = True,
    retries: int = 2,
    decode: bool = True,
) -> redis.Redis:
    """Open a client for ``url`` (``redis://`` or ``rediss://``) with ``decode_responses=True``.

    Credentials: URL userinfo (``redis://user:pw@host``), else ``username``/``password``, else
    env SENTINEL_REDIS_PASSWORD. TLS files: arguments, else URL query ``tls_ca``/``tls_cert``/
    ``tls_key`` (or redis-py's ``ssl_ca_certs``/``ssl_certfile``/``ssl_keyfile``). ``timeout``
    bounds both connecting and each reply. With ``check`` (default) the server is PINGed so a bad
    URL or password fails here with a one-line ``BusError``; ``check=False`` never touches the
    network (the trainer's client must start even when Redis is down). ``retries`` is how often a
    command is retried on a connection error (short exponential backoff, capped at 0.5 s).
    ``decode=False`` returns ``bytes`` (for readers of untrusted streams: see ``raw``).
    """
    bad = url_problem(url)
    if bad:
        raise BusError(bad)
    clean, tls = _split_tls_query(url)
    parts = urlsplit(clean)
    scheme = parts.scheme
    kwargs: dict[str, Any] = {
        "decode_responses": decode,
        # a non-UTF-8 byte anywhere in a reply must not raise out of a reader that only displays it
        # (CLI views); readers that act on entries use ``raw`` and refuse such entries instead
        "encoding_errors": "replace",
        "protocol": 2,  # pinned: the stream helpers parse RESP2 reply shapes
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
        "health_check_interval": 30,
    }
    if _HIREDIS:
        kwargs["command_packer"] = _ReusingPacker()
    if not parts.password:
        pw = password if password is not None else os.environ.get(ENV_PASSWORD)
        if pw:
            kwargs["password"] = pw
    if not parts.username and username:
        kwargs["username"] = username
    if scheme == "rediss":
        for key, val in (("ssl_ca_certs", tls_ca), ("ssl_certfile", tls_cert), ("ssl_keyfile", tls_key)):
            if val or tls.get(key):
                path = val or unquote(tls[key])
                if not Path(path).is_file():
                    raise BusError(f"TLS file {path} ({key}) does not exist")
                kwargs[key] = path
    elif tls_ca or tls_cert or tls_key or tls:
        raise BusError(f"TLS files given for a non-TLS URL {redact_url(url)}: use rediss://")
    with contextlib.suppress(ValueError):
        owner_check = _OWNER_CHECKS.get((parts.port, unquote(parts.password or kwargs.get("password") or "")))
        if owner_check is not None and scheme == "redis":
            kwargs["connection_class"] = _guarded(owner_check)
    try:
        r = redis.Redis.from_url(clean, **kwargs)
    except (ValueError, TypeError) as e:
        raise BusError(f"invalid bus URL {redact_url(url)}: {' '.join(redact_url(str(e)).split())[:200]}") from None
    if check:
        try:
            check_is_redis(url, timeout)
            with bus_errors(r):
                _ping_within(r, 3 * timeout + 2.0, redact_url(url))
        except (ValueError, TypeError) as e:  # an option value redis-py only checks when it connects (ssl_cert_reqs=bogus)
            raise BusError(f"invalid bus URL {redact_url(url)}: {' '.join(redact_url(str(e)).split())[:200]}") from None
    return r


class _ReusingPacker:
    """redis-py's hiredis command packer, keeping the last XREADGROUP and the last EVALSHA it packed.

    A daemon's step read names every run's stream (2N + 7 arguments; as ``bus.read_group_with_hashes``,
    an EVALSHA of 2N + 7) and is the same at every iteration: at 300 runs, packing those 607 arguments
    again, about 100 times a second, was 5-7% of the daemon's CPU (``bench/daemon_scale.py``). A repeat
    is found by comparing the arguments (the same string objects: an identity check each). Every other
    command is packed as before. Only with ``hiredis`` (a dependency): without it redis-py's own packer
    stays in place. The numbers in a step read (COUNT, BLOCK) are ints from ``read_group``, so equal
    arguments pack alike."""

    REUSED = ("XREADGROUP", "EVALSHA")

    def __init__(self) -> None:
        self._inner = HiredisRespSerializer()
        self._last: dict[str, tuple[tuple, list]] = {}  # command -> (arguments, packed)

    def pack(self, *args: Any) -> list:
        name = args[0]
        if name not in self.REUSED:
            return self._inner.pack(*args)
        last = self._last.get(name)
        if last is not None and last[0] == args:
            return last[1]
        out = self._inner.pack(*args)
        self._last[name] = (args, out)
        return out


# (port, password) of the embedded buses this process knows -> the check of who listens there, run
# before any byte goes out on a new connection (AUTH is the first): ``embedded.with_password``
# registers each URL it hands out, so every client of an embedded bus is guarded, however its URL came
_OWNER_CHECKS: dict[tuple[int, str], Callable[[int], None]] = {}


def guard_port(url: str, check: Callable[[int], None]) -> None:
    """Have every connection that ``connect`` opens to ``url`` (its port and password) call
    ``check(port)`` once its socket is up and before it sends anything; ``check`` raises BusError
    for a listener that must not get the password."""
    parts = urlsplit(url)
    with contextlib.suppress(ValueError):
        if parts.port and parts.password:
            _OWNER_CHECKS[(parts.port, unquote(parts.password))] = check


def _guarded(check: Callable[[int], None]) -> type:
    class GuardedConnection(redis.Connection):
        def _connect(self):
            sock = super()._connect()
            try:
                check(self.port)
            except BusError as e:
                with contextlib.suppress(OSError):
                    sock.close()
                raise redis.ConnectionError(str(e)) from None
            return sock

    return GuardedConnection


def _looks_like_redis(host: str, port: int, timeout: float, where: str) -> None:
    """One inline PING on a plain socket, and at most 64 bytes of its answer read: a Redis server
    answers ``+PONG`` or an error (``-NOAUTH ...``). Anything else (an HTTP server, another
    protocol, a bulk of a gigabyte announced) is refused here, before the client library reads
    what the server announces into memory. A connection that fails is left to the client (its
    own message)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            sock.sendall(b"PING\r\n")
            first = sock.recv(64)
    except OSError:
        return
    if first[:1] not in (b"+", b"-"):
        shown = first[:24].decode("ascii", "backslashreplace")
        raise BusError(f"{where} is not a Redis server: it answered a PING with {shown!r}"
                       + ("" if first else " (nothing: it closed the connection)"))


def check_is_redis(url: str, timeout: float = 2.0) -> None:
    """``_looks_like_redis`` for a ``redis://`` URL (other schemes, and a server that cannot be
    reached, pass): BusError when what answers there is no Redis server."""
    parts = urlsplit(_split_tls_query(url)[0])
    if parts.scheme == "redis" and parts.hostname:
        try:
            port = parts.port or 6379
        except ValueError:
            return
        _looks_like_redis(parts.hostname, port, timeout, redact_url(url))


def _ping_within(r: redis.Redis, deadline_s: float, where: str) -> None:
    """PING, with a deadline on the whole exchange. The socket timeout bounds each read only: a
    server that is no Redis and keeps sending (a line with no end, a bulk of a gigabyte announced)
    held the first command for good, at 100 % CPU or gigabytes of memory. Past the deadline the
    connection is closed under the reader and the bus is unreachable."""
    import threading

    outcome: list[BaseException | None] = []

    def ping() -> None:
        try:
            r.ping()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(e)

    t = threading.Thread(target=ping, name="bus-ping", daemon=True)
    t.start()
    t.join(deadline_s)
    if not outcome:
        with contextlib.suppress(Exception):
            r.connection_pool.disconnect()  # the reader's socket closes: its thread ends
        raise BusUnavailable(f"cannot reach Redis at {where}: no answer to PING within {deadline_s:g} s "
                             "(a stalled or overloaded server, or one that is no Redis)")
    if outcome[0] is not None:
        raise outcome[0]


# --------------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------------
