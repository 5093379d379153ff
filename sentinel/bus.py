"""The control bus: one API over its connection, URL/secret resolution and stream helpers.

Used by the daemon, the CLI and the trainer's bus client. Everything here is deliberately thin:
the value is in the error handling (one-line ``BusError`` messages that never leak a password,
``ensure_group`` that swallows *only* BUSYGROUP, ``read_group`` that survives a Redis restarted
without persistence) and in one consistent convention:

* clients are created with ``decode_responses=True``: every value on the bus is UTF-8 JSON text,
  so callers always get ``str`` keys, ids and values, never ``bytes``;
* every stream entry carries the record JSON under the single field ``json``.

Redis exceptions raised by the helpers are translated into ``BusError`` (``BusUnavailable`` for
connection problems, so daemons can back off and retry on exactly that).

The pieces, each with one job: ``sentinel.bus_url`` (URLs, the error type, the secret),
``sentinel.bus_connect`` (connections and error translation) and ``sentinel.bus_streams``
(publish, read, decode). This module re-exports them, and resolves a run's bus (which may be its
embedded bus, ``sentinel.embedded``: it sits above both).
"""

from __future__ import annotations

import os
from pathlib import Path

from sentinel.bus_connect import (
    _OWNER_CHECKS,
    bus_errors,
    check_is_redis,
    connect,
    guard_port,
    translate,
)
from sentinel.bus_streams import (
    FUTURE_ID_MS,
    Entry,
    ack,
    autoclaim,
    decode,
    ensure_group,
    future_after_ms,
    id_exhausted,
    is_future_id,
    list_runs,
    publish,
    publish_own,
    raw,
    read_group,
    read_group_with_hashes,
    read_stream,
    register_run,
    repair_stream_ids,
    to_entry,
)
from sentinel.bus_url import (
    ENV_PASSWORD,
    ENV_SECRET,
    ENV_URL,
    FIELD,
    MAX_SECRET_BYTES,
    URL_OPTIONS,
    BusError,
    BusUnavailable,
    load_secret,
    redact_url,
    url_problem,
)
from sentinel.contract.fsio import UnreadableFileError, read_regular_file
from sentinel.embedded import ensure_embedded as _ensure_embedded
from sentinel.embedded import stop_embedded as _stop_embedded
from sentinel.embedded import with_password
from sentinel.embedded_files import URL_FILE

__all__ = [
    "ENV_PASSWORD",
    "ENV_SECRET",
    "ENV_URL",
    "FIELD",
    "FUTURE_ID_MS",
    "MAX_SECRET_BYTES",
    "URL_OPTIONS",
    "_OWNER_CHECKS",
    "BusError",
    "BusUnavailable",
    "Entry",
    "ack",
    "autoclaim",
    "bus_errors",
    "check_is_redis",
    "connect",
    "decode",
    "ensure_embedded",
    "ensure_group",
    "future_after_ms",
    "guard_port",
    "id_exhausted",
    "is_future_id",
    "list_runs",
    "load_secret",
    "publish",
    "publish_own",
    "raw",
    "read_group",
    "read_group_with_hashes",
    "read_stream",
    "redact_url",
    "register_run",
    "repair_stream_ids",
    "resolve_url",
    "stop_embedded",
    "to_entry",
    "translate",
    "url_problem",
]


def bus_dir_of(run_dir: str | os.PathLike) -> Path:
    """``RUN_DIR/bus``, as given (not resolved: the message names the path the user passed)."""
    return Path(run_dir) / "bus"


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
        f = bus_dir_of(run_dir) / URL_FILE
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
        return with_password(url, f.parent)  # the embedded bus's password sits beside its url
    raise BusError(f"no control bus: pass --redis-url, set {ENV_URL}, or give a run directory")


def ensure_embedded(run_dir: str | os.PathLike) -> str:
    """Start (or reuse) the run's embedded bus; see ``sentinel.embedded``. Returns its URL."""
    return _ensure_embedded(run_dir)


def stop_embedded(run_dir: str | os.PathLike) -> bool:
    """Stop the run's embedded bus; see ``sentinel.embedded``."""
    return _stop_embedded(run_dir)
