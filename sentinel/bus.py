"""The control bus: Redis connections, URL/secret resolution and thin stream helpers.

Used by the daemon, the CLI and the trainer's bus client. Everything here is deliberately thin:
the value is in the error handling (one-line ``BusError`` messages that never leak a password,
``ensure_group`` that swallows *only* BUSYGROUP, ``read_group`` that survives a Redis restarted
without persistence) and in one consistent convention:

* clients are created with ``decode_responses=True``: every value on the bus is UTF-8 JSON text,
  so callers always get ``str`` keys, ids and values, never ``bytes``;
* every stream entry carries the record JSON under the single field ``json``.

Redis exceptions raised by the helpers are translated into ``BusError`` (``BusUnavailable`` for
connection problems, so daemons can back off and retry on exactly that).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from sentinel.protocol import (
    Ack,
    Directive,
    Event,
    RECORD_MAC_FIELD,
    Keys,
    SchemaError,
    StepRecord,
    TimelineRecord,
    UnreadableFileError,
    open_regular,
    parse_step_line,
    read_regular_file,
    record_mac,
)

FIELD = "json"  # the one field of every stream entry
ENV_URL = "SENTINEL_REDIS_URL"
ENV_PASSWORD = "SENTINEL_REDIS_PASSWORD"
ENV_SECRET = "SENTINEL_SECRET"

# URL query parameters we accept for TLS files (ours first, then redis-py's own names)
_TLS_QUERY = {
    "tls_ca": "ssl_ca_certs",
    "ssl_ca_certs": "ssl_ca_certs",
    "tls_cert": "ssl_certfile",
    "ssl_certfile": "ssl_certfile",
    "tls_key": "ssl_keyfile",
    "ssl_keyfile": "ssl_keyfile",
}


class BusError(Exception):
    """A control-bus failure, with a one-line message that is safe to print (no secrets)."""


class BusUnavailable(BusError):
    """Redis could not be reached (refused, timed out, connection lost): worth retrying later."""


# --------------------------------------------------------------------------------------------
# URLs, secrets
# --------------------------------------------------------------------------------------------


_SCHEME_PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:/*")


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (userinfo and ``password=`` query).

    The userinfo is everything between the scheme and the *last* ``@``, however the URL is
    otherwise broken: a password with an unencoded ``/``, ``?`` or ``#`` (``redis://:pw/x@host``)
    ends the host part for a URL parser, which would then find no ``@`` and print the password;
    a mistyped scheme (``redis:/:pw@h``, ``:pw@h``) too."""
    head, at, tail = url.rpartition("@")
    if at:
        m = _SCHEME_PREFIX.match(head)
        scheme, userinfo = (head[:m.end()], head[m.end():]) if m else ("", head)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        url = f"{scheme}{user}:***@{tail}" if user else f"{scheme}***@{tail}"
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if not parts.query:
        return url
    pairs = [(k, "***" if k.lower() in ("password", "pass", "pw") else v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(pairs, safe="/*"), parts.fragment))


# what a bus URL's query may hold besides the TLS files: redis-py passes every other key to its
# connection class, and an unknown one (a typo) raised a TypeError at the first command
URL_OPTIONS = frozenset({"db", "socket_timeout", "socket_connect_timeout", "socket_keepalive", "retry_on_timeout",
                         "max_connections", "health_check_interval", "client_name", "ssl_cert_reqs",
                         "ssl_check_hostname", "protocol", "timeout", "readonly", "username", "password"})


def url_problem(url: str) -> str | None:
    """What is wrong with a bus URL, in one line with no secret in it; None when it can be used.
    No network: the trainer checks its --redis-url with this before it creates anything."""
    try:
        clean, _ = _split_tls_query(url)
        parts = urlsplit(clean)
        parts.port  # noqa: B018 -- a port that is not a number, or out of range, raises here, not in redis-py
        keys = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True)]
    except ValueError as e:  # "Invalid IPv6 URL", "Port out of range 0-65535", ...
        # the parser's words may quote the password ("Port could not be cast to integer value as 'pw'"):
        # with credentials in the URL, only say where to look
        why = ("it does not parse (a password with / ? # or @ must be percent-encoded)" if "@" in url
               and not str(e).startswith("Port out of range") else " ".join(str(e).split()))
        return f"invalid bus URL {redact_url(url)}: {why}"
    if not parts.scheme and "://" not in url:  # a bare word may be a secret pasted into the wrong flag: not echoed
        return "invalid bus URL: it has no scheme; use redis://[USER:PASSWORD@]HOST[:PORT][/DB], rediss:// or unix://"
    if parts.scheme not in ("redis", "rediss", "unix"):
        return f"unsupported bus URL scheme {parts.scheme!r} in {redact_url(url)}: use redis://, rediss:// or unix://"
    if parts.scheme != "unix" and not parts.hostname:  # redis:/h (one slash) reads as a path: it would go to localhost
        return f"invalid bus URL {redact_url(url)}: no host (redis://[USER:PASSWORD@]HOST[:PORT][/DB])"
    if parts.scheme == "unix" and not parts.path:
        return f"invalid bus URL {redact_url(url)}: no socket path (unix:///path/to/redis.sock)"
    unknown = sorted(set(keys) - URL_OPTIONS)
    if unknown:
        return (f"invalid bus URL {redact_url(url)}: unknown option(s) {', '.join(repr(k[:40]) for k in unknown[:5])} "
                f"(known: tls_ca, tls_cert, tls_key, {', '.join(sorted(URL_OPTIONS))})")
    return None


def resolve_url(run_dir: str | os.PathLike | None = None, redis_url: str | None = None) -> str:
    """Pick the bus URL: ``redis_url`` (the --redis-url flag) > env SENTINEL_REDIS_URL > RUN_DIR/bus/url.

    From RUN_DIR/bus/url, the embedded bus's password (RUN_DIR/bus/password) is added to the URL:
    print it only through ``redact_url``.
    """
    if redis_url:
        return redis_url
    env = os.environ.get(ENV_URL)
    if env:
        return env
    if run_dir is not None:
        f = Path(run_dir) / "bus" / "url"
        try:  # a regular file of at most 64 KiB: a FIFO there would wait forever, a device never end
            url = read_regular_file(f, 1 << 16).decode().strip()
        except FileNotFoundError:
            raise BusError(
                f"no control bus for {run_dir}: {f} does not exist (start the run, or pass --redis-url / set {ENV_URL})"
            ) from None
        except (OSError, UnicodeDecodeError) as e:  # a directory, binary garbage: no URL to try
            why = getattr(e, "strerror", None) or (str(e) if isinstance(e, UnreadableFileError) else e.__class__.__name__)
            raise BusError(f"no control bus for {run_dir}: {f} is unreadable ({why})") from None
        if not url:
            raise BusError(f"no control bus for {run_dir}: {f} is empty")
        from sentinel.embedded import with_password  # the embedded bus's password sits beside its url

        return with_password(url, f.parent)
    raise BusError(f"no control bus: pass --redis-url, set {ENV_URL}, or give a run directory")


def _check_private(path: Path) -> None:
    st = path.stat()
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise BusError(
            f"secret file {path} is accessible by group/others (mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {path}"
        )


MAX_SECRET_BYTES = 1 << 16


def load_secret(run_dir: str | os.PathLike | None = None, secret_file: str | os.PathLike | None = None) -> bytes:
    """The HMAC key for directives: ``secret_file`` (an explicit --secret-file) > env
    SENTINEL_SECRET > RUN_DIR/bus/secret, the same order as the bus URL's (flag > env > run dir).

    The key is the *text* of the secret (stripped, UTF-8), not its hex-decoded bytes, so that
    ``SENTINEL_SECRET=$(cat RUN_DIR/bus/secret)`` and the file give the same key. A file that
    group or others can access is refused: anyone who can read it can forge rollbacks.
    """
    env = os.environ.get(ENV_SECRET)
    if secret_file is not None:
        path = Path(secret_file)
    elif env:
        return env.strip().encode()
    elif run_dir is not None:
        path = Path(run_dir) / "bus" / "secret"
    else:
        raise BusError(f"no directive secret: set {ENV_SECRET}, pass --secret-file, or give a run directory")
    try:
        # a regular file first (/dev/zero or a pipe would be read forever, a FIFO wait for a writer),
        # then private, then at most 64 KiB of UTF-8 text
        with open_regular(path) as f:
            _check_private(path)
            data = f.read(MAX_SECRET_BYTES + 1)
        if len(data) > MAX_SECRET_BYTES:
            raise BusError(f"secret file {path} is larger than {MAX_SECRET_BYTES // 1024} KiB: not a secret")
        text = data.decode().strip()
    except FileNotFoundError:
        raise BusError(f"secret file {path} does not exist") from None
    except PermissionError:
        raise BusError(f"secret file {path} is not readable by this user") from None
    except IsADirectoryError:
        raise BusError(f"secret file {path} is a directory") from None
    except UnreadableFileError as e:
        raise BusError(f"secret file {path} is {e}") from None
    except UnicodeDecodeError:  # never echo its bytes: it is a secret, even when it is a broken one
        raise BusError(f"secret file {path} is not UTF-8 text") from None
    except OSError as e:  # a symlink loop, a name too long
        raise BusError(f"secret file {path} is unreadable ({e.strerror or e.__class__.__name__})") from None
    if not text:
        raise BusError(f"secret file {path} is empty")
    return text.encode()


# --------------------------------------------------------------------------------------------
# Connections
# --------------------------------------------------------------------------------------------


def _split_tls_query(url: str) -> tuple[str, dict[str, str]]:
    """Remove our TLS query parameters from ``url`` (redis-py would pass unknown ones through)."""
    parts = urlsplit(url)
    if not parts.query:
        return url, {}  # as given: urlunsplit would turn unix:///path into unix:/path
    keep, tls = [], {}
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k in _TLS_QUERY:
            tls[_TLS_QUERY[k]] = v
        else:
            keep.append((k, v))
    rebuilt = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(keep), parts.fragment))
    if not parts.netloc and url.startswith(f"{parts.scheme}://"):
        rebuilt = f"{parts.scheme}://{rebuilt[len(parts.scheme) + 1:]}"
    return rebuilt, tls


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


class Entry(NamedTuple):
    """One stream entry: the stream key, the entry id, and its fields (``{"json": ...}``).

    ``bad`` is set (to a ``REJECT_REASONS`` value, e.g. ``"not_utf8"``) when the entry could not
    even be decoded; ``fields`` is then empty. Such an entry must still be acknowledged.
    """

    stream: str
    id: str
    fields: dict[str, str]
    bad: str | None = None


def raw(r: redis.Redis) -> redis.Redis:
    """A client on the same server that returns ``bytes`` (cached on ``r``).

    Untrusted streams are read through it: with ``decode_responses=True`` one non-UTF-8 byte in
    any entry makes redis-py raise while parsing the *whole* reply, so a single hostile entry
    would block every entry behind it, forever. Raw replies are decoded entry by entry instead.
    """
    if not r.connection_pool.connection_kwargs.get("decode_responses"):
        return r
    cached = getattr(r, "_sentinel_raw", None)
    if cached is None:
        pool = r.connection_pool
        kwargs = {**pool.connection_kwargs, "decode_responses": False}
        cached = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))
        r._sentinel_raw = cached  # type: ignore[attr-defined]
    return cached


def _text(b: bytes | str) -> str:
    return b if isinstance(b, str) else b.decode("utf-8")


def to_entry(stream: bytes | str, eid: bytes | str, fields: dict | None) -> Entry:
    """Decode one raw entry; a field name or value that is not UTF-8 marks it ``bad``."""
    s, i = _text(stream), _text(eid)  # stream names and ids are ASCII by construction
    try:
        return Entry(s, i, {_text(k): _text(v) for k, v in (fields or {}).items()})
    except UnicodeDecodeError:
        return Entry(s, i, {}, "not_utf8")


def ensure_group(r: redis.Redis, stream: str, group: str, start_id: str = "0") -> bool:
    """Create consumer group ``group`` on ``stream`` (creating the stream too). Idempotent.

    Returns True when it created the group. Only the BUSYGROUP reply (group already exists) is
    swallowed; anything else (wrong key type, ACL, connection) is a ``BusError``.
    """
    try:
        r.xgroup_create(stream, group, id=start_id, mkstream=True)
        return True
    except redis.ResponseError as e:
        if str(e).startswith("BUSYGROUP"):
            return False
        raise translate(e, _describe(r)) from None
    except redis.RedisError as e:
        raise translate(e, _describe(r)) from None


def _clamp_block(r: redis.Redis, block_ms: int | None) -> int | None:
    """Keep a blocking read shorter than the socket timeout, or redis-py reports a timeout error."""
    if block_ms is None:
        return None
    sock_t = r.connection_pool.connection_kwargs.get("socket_timeout")
    if sock_t:
        block_ms = min(int(block_ms), max(1, int(sock_t * 1000 * 0.8)))
    return max(0, int(block_ms)) or 1  # BLOCK 0 would mean "forever"


def _entries(resp) -> list[Entry]:
    out: list[Entry] = []
    # connect() speaks RESP2: [[stream, [(id, fields), ...]], ...]
    for stream, items in resp or []:
        for eid, fields in items:
            if fields is None:  # entry deleted (trimmed) while pending
                continue
            out.append(to_entry(stream, eid, fields))
    return out


def read_stream(r: redis.Redis, stream: str, after_id: str, *, count: int = 1000) -> list[Entry]:
    """XREAD entries after ``after_id`` (no group), decoded entry by entry like ``read_group``."""
    with bus_errors(r):
        return _entries(raw(r).xread({stream: after_id}, count=count))


def read_group(
    r: redis.Redis,
    streams: str | Sequence[str],
    group: str,
    consumer: str,
    *,
    count: int = 100,
    block_ms: int | None = None,
    pending: bool = False,
) -> list[Entry]:
    """XREADGROUP on one or more streams; returns entries in stream order.

    ``pending=True`` re-reads this consumer's own delivered-but-unacked entries (id ``0``): do that
    once at start so a daemon that crashed mid-batch processes them again. If a group vanished
    (Redis restarted without persistence) it is recreated and the read retried once.
    ``block_ms`` is capped below the connection's socket timeout.
    """
    names = [streams] if isinstance(streams, str) else list(streams)
    start = "0" if pending else ">"
    block = _clamp_block(r, block_ms)
    for attempt in (0, 1):
        try:
            resp = raw(r).xreadgroup(group, consumer, {s: start for s in names}, count=count, block=block)
            return _entries(resp)
        except redis.ResponseError as e:
            if str(e).startswith("NOGROUP") and attempt == 0:
                for s in names:
                    ensure_group(r, s, group)
                continue
            raise translate(e, _describe(r)) from None
        except redis.RedisError as e:
            raise translate(e, _describe(r)) from None
    return []  # pragma: no cover


def ack(r: redis.Redis, stream: str, group: str, *ids: str) -> int:
    """XACK entries once they are fully processed (at-least-once delivery)."""
    if not ids:
        return 0
    with bus_errors(r):
        return int(r.xack(stream, group, *ids))


def autoclaim(
    r: redis.Redis,
    stream: str,
    group: str,
    consumer: str,
    *,
    min_idle_ms: int,
    start_id: str = "0-0",
    count: int = 100,
) -> tuple[str, list[Entry]]:
    """XAUTOCLAIM entries another consumer left pending for ``min_idle_ms`` (it died).

    Returns ``(next_start_id, entries)``; ``next_start_id == "0-0"`` means the scan is complete.
    Entries trimmed from the stream while pending are dropped (Redis 6.2 returns them with no
    fields; Redis >= 7 removes them and lists them separately).
    """
    with bus_errors(r):
        resp = raw(r).xautoclaim(stream, group, consumer, min_idle_time=min_idle_ms, start_id=start_id, count=count)
    next_id, items = _text(resp[0]), resp[1]
    return next_id, [to_entry(stream, eid, f) for eid, f in items if f is not None]


def _to_json(record: Any) -> str:
    if hasattr(record, "to_json"):
        return record.to_json()
    if isinstance(record, (str, bytes)):
        return record.decode() if isinstance(record, bytes) else record
    return json.dumps(record, separators=(",", ":"), allow_nan=True)


def publish(r: redis.Redis, stream: str, record: Any, maxlen: int | None = 100_000, *, secret: bytes | None = None) -> str:
    """XADD ``record`` (a protocol model, dict or JSON text) under field ``json``; returns its id.

    ``maxlen`` trims approximately (``~``), which is O(1) amortised; ``None`` keeps everything.
    With ``secret`` the entry also carries ``mac`` (``protocol.record_mac``): step records and
    acks must, or the sentinel refuses them.
    """
    data = _to_json(record)
    fields = {FIELD: data}
    if secret is not None:
        fields[RECORD_MAC_FIELD] = record_mac(secret, stream, data)
    with bus_errors(r):
        return r.xadd(stream, fields, maxlen=maxlen, approximate=True)


# Every entry id stamped more than a day ahead of the server's clock goes, by copying the rest to a
# new key that replaces the stream (valkey >= 8 will not lower a stream's last id by XSETID once an
# entry above it was deleted). Consumer groups go with the old key: their readers recreate them.
_REPAIR_IDS = """
local t = redis.call('TIME')
local bound = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1]))
local keep = redis.call('XRANGE', KEYS[1], '-', bound)
local n = redis.call('XLEN', KEYS[1])
if #keep == n then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  local last = ''
  for i = 1, #info, 2 do if info[i] == 'last-generated-id' then last = info[i + 1] end end
  if (tonumber(string.match(last, '^(%d+)-')) or 0) <= tonumber(bound) then return -1 end
end
redis.call('DEL', KEYS[2])
for _, e in ipairs(keep) do redis.call('XADD', KEYS[2], e[1], unpack(e[2])) end
if #keep == 0 then redis.call('DEL', KEYS[1]) else redis.call('RENAME', KEYS[2], KEYS[1]) end
return n - #keep
"""
FUTURE_ID_MS = 86_400_000  # an entry id further ahead of the server's clock than this is hostile


def id_exhausted(e: BaseException) -> bool:
    """True for the XADD refusal a stream gets once an entry with a far-future (or the largest) id is in it."""
    text = str(e)
    return "exhausted the last possible ID" in text or "equal or smaller than the target stream top item" in text


def repair_stream_ids(r: redis.Redis, stream: str) -> int:
    """Drop the entries of ``stream`` whose ids are stamped more than a day ahead (anyone with
    bus access can XADD ``18446744073709551615-18446744073709551615``, after which no writer can
    add to the stream, ever). Returns how many went, or -1 when the stream needed no repair."""
    with bus_errors(r):
        return int(r.eval(_REPAIR_IDS, 2, stream, stream + ":repair", FUTURE_ID_MS))


def is_future_id(eid: str, now: float | None = None) -> bool:
    """An entry id stamped more than a day ahead of ``now`` (this machine's clock)."""
    ms, _, _ = eid.partition("-")
    return len(ms) > 15 or (ms.isdigit() and int(ms) > ((time.time() if now is None else now) * 1000 + FUTURE_ID_MS))


def publish_own(r: redis.Redis, stream: str, record: Any, maxlen: int | None = 100_000) -> str:
    """``publish`` to a stream only the sentinel's side writes (directives, approvals, events),
    through what anyone with bus access can do to it: a key of another Redis type there is
    replaced, and entries stamped far ahead (which refuse every XADD after them) are removed."""
    try:
        return publish(r, stream, record, maxlen)
    except BusError as e:
        if "WRONGTYPE" in str(e):
            with bus_errors(r):
                r.delete(stream)
        elif id_exhausted(e):
            repair_stream_ids(r, stream)
        else:
            raise
    return publish(r, stream, record, maxlen)


_BY_SUFFIX = {":directives": Directive, ":acks": Ack, ":events": Event}


def decode(entry: Entry | tuple | dict, model: type | None = None):
    """Parse a stream entry back into its protocol record.

    Accepts an ``Entry``, an ``(id, fields)`` pair or the fields dict. Without ``model`` the type
    follows from the stream name (``Keys(run).steps`` -> ``StepRecord``/``TimelineRecord``,
    ``.directives`` -> ``Directive``, ``.acks`` -> ``Ack``, ``.events`` -> ``Event``).
    Raises ``SchemaError`` for an entry without a ``json`` field or with an invalid record.
    """
    stream = None
    if isinstance(entry, Entry):
        if entry.bad:
            raise SchemaError(f"stream entry {entry.id} could not be decoded ({entry.bad})", entry.bad)
        stream, fields = entry.stream, entry.fields
    elif isinstance(entry, dict):
        fields = entry
    else:
        fields = entry[-1]
    data = (fields or {}).get(FIELD)
    if data is None and fields:
        data = fields.get(FIELD.encode())  # a client without decode_responses
    if data is None:
        eid = entry.id if isinstance(entry, Entry) else (entry[0] if isinstance(entry, tuple) else "?")
        raise SchemaError(f"stream entry {eid} has no '{FIELD}' field")
    if model is None and stream is not None:
        for suffix, m in _BY_SUFFIX.items():
            if stream.endswith(suffix):
                model = m
                break
    if model is None or model in (StepRecord, TimelineRecord):
        return parse_step_line(data)
    return model.from_json(data)


# --------------------------------------------------------------------------------------------
# Run registry
# --------------------------------------------------------------------------------------------


def register_run(r: redis.Redis, run: str, info: dict[str, Any]) -> None:
    """Add ``run`` to ``Keys.RUNS`` and write its metadata hash ``Keys(run).info``.

    Non-string values are stored as JSON so that readers can ``json.loads`` them back.
    """
    keys = Keys(run)
    mapping = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
    with bus_errors(r):
        pipe = r.pipeline(transaction=True)
        pipe.sadd(Keys.RUNS, run)
        if mapping:
            pipe.hset(keys.info, mapping=mapping)
        pipe.execute()


def list_runs(r: redis.Redis) -> list[str]:
    """The registered run ids, sorted. Members that are not valid run ids (not UTF-8, spaces,
    colons: anyone with bus access can SADD) are left out, so they cannot stop discovery."""
    with bus_errors(r):
        members = raw(r).smembers(Keys.RUNS)
    out = []
    for m in members:
        try:
            run = _text(m)
            Keys(run)
        except (UnicodeDecodeError, ValueError):
            continue
        out.append(run)
    return sorted(out)


def ensure_embedded(run_dir: str | os.PathLike) -> str:
    """Start (or reuse) the run's embedded bus; see ``sentinel.embedded``. Returns its URL."""
    from sentinel.embedded import ensure_embedded as _ensure

    return _ensure(run_dir)


def stop_embedded(run_dir: str | os.PathLike) -> bool:
    """Stop the run's embedded bus; see ``sentinel.embedded``."""
    from sentinel.embedded import stop_embedded as _stop

    return _stop(run_dir)
