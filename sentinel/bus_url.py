"""Where the control bus is and how to authenticate to it: URLs (checked, printed only redacted),
the one error type, and the run's directive secret.

Nothing here opens a connection (``sentinel.bus_connect``) or knows the embedded bus's files
(``sentinel.embedded_files``).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sentinel.contract.fsio import UnreadableFileError, open_regular

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
