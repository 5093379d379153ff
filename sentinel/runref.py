"""Resolve the ``RUN`` argument of the on-call commands.

``RUN`` is either a run directory (``runs/demo``, ``/data/runs/x``, ``.``) or a run id registered on
the control bus. Either way the commands get a :class:`RunRef`: the run id, the run directory when it
is on this machine, and a Redis client when a bus is reachable.

Bus resolution follows the project rule: ``--redis-url`` > ``SENTINEL_REDIS_URL`` > ``RUN_DIR/bus/url``.
An *explicitly* given URL that cannot be reached is an error; a run directory's own embedded bus that
is down just means the run is offline (its trainer has stopped), and the commands fall back to files.
"""

from __future__ import annotations

import functools
import getpass
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sentinel import bus
from sentinel.acks import last_ack_id, wait_ack  # noqa: F401  (re-exported: the CLI's commands use them here)
from sentinel.cli.common import WRONG_TYPE, SentinelError, looks_like_run_dir, read_unless_wrong_type
from sentinel.protocol import Keys
from sentinel.rundir import RunDirError, require_run_dir, run_id_of

# the trainer refreshes the heartbeat about every second (TTL 30 s); older than this is "stale"
HEARTBEAT_STALE_S = 15.0
# an unknown run id's error lists at most this many registered ids, each cut to SHOWN_ID_CHARS: anyone
# with bus access can register ids, and a line of 5000 ids (or one id of 5000 characters) is a flood
SHOWN_RUN_IDS = 10
SHOWN_ID_CHARS = 64


def printable(text: str, limit: int = SHOWN_ID_CHARS) -> str:
    """``text`` for one line of a terminal: control and other unprintable characters escaped
    (``\\x1b``, ``\\n``), at most ``limit`` characters, ``...`` when cut."""
    text = str(text)
    head = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    cut = len(text) > limit or len(head) > limit
    return head[:limit] + ("..." if cut else "")


def known_runs_hint(known: list[str]) -> str:
    """`` (known runs: a, b, ... and N more)`` for an error about a run id the bus does not know."""
    if not known:
        return " (no runs registered)"
    more = len(known) - SHOWN_RUN_IDS
    return (f" (known runs: {', '.join(printable(k) for k in known[:SHOWN_RUN_IDS])}"
            + (f", and {more} more" if more > 0 else "") + ")")


class RunRefError(Exception):
    """A RUN that cannot be resolved (one line, safe to print)."""


@dataclass
class RunRef:
    run: str
    run_dir: Path | None = None
    r: Any = None  # redis.Redis | None
    url: str | None = None
    bus_note: str | None = None  # why there is no bus (offline), for the operator
    bus_down: bool = False  # a bus was configured (flag, env, the run's own) but could not be reached
    info: dict[str, str] = field(default_factory=dict)

    @property
    def keys(self) -> Keys:
        return Keys(self.run)

    def heartbeat(self) -> dict | None:
        """The trainer's heartbeat ({"step", "time", "sent", "pid"}) if the key exists, else None."""
        if self.r is None:
            return None
        raw = read_unless_wrong_type(self.r, lambda: self.r.get(self.keys.heartbeat))
        if raw is WRONG_TYPE:
            return {}  # a key of another type is there: a heartbeat nobody can read, not an absent one
        if not raw:
            return None
        try:
            hb = json.loads(raw)
            return hb if isinstance(hb, dict) else {}
        except (ValueError, RecursionError):  # anyone with bus access can write it: nested 100,000 deep too
            return {}

    def trainer_attached(self) -> bool:
        """A trainer is live on the bus: its heartbeat key (30 s TTL) exists."""
        return self.heartbeat() is not None

    def secret(self, secret_file: str | None = None) -> bytes:
        return bus.load_secret(self.run_dir, secret_file)

    def describe_bus(self) -> str:
        return bus.redact_url(self.url) if self.url else "no bus"


def _explicit_url(redis_url: str | None) -> str | None:
    return redis_url or os.environ.get(bus.ENV_URL) or None


def connect_explicit(redis_url: str | None) -> tuple[Any, str]:
    url = _explicit_url(redis_url)
    if not url:
        raise RunRefError(f"no control bus: pass --redis-url, set {bus.ENV_URL}, or give a run directory")
    return bus.connect(url), url


def resolve(run: str, redis_url: str | None = None, *, need_bus: bool = False, view: bool = False) -> RunRef:
    """Turn RUN (a run dir or a run id) into a :class:`RunRef`.

    ``need_bus``: fail when no bus can be reached (commands that only work live). ``view``: a
    command that only shows (status, incidents, pages, checkpoints, report): a run directory is
    read from its files when even an explicit bus (--redis-url, SENTINEL_REDIS_URL) is down, with
    a note, as when its embedded bus is: that is when the on-call engineer needs the views.
    Commands that act keep "an explicit bus must work".
    """
    explicit = _explicit_url(redis_url)
    if looks_like_run_dir(run):
        try:
            run_dir = require_run_dir(run)
        except RunDirError as e:
            raise RunRefError(str(e)) from None
        rid = run_id_of(run_dir)
        ref = RunRef(rid, run_dir)
        if explicit and not view:
            ref.r, ref.url = bus.connect(explicit), explicit  # an explicit bus must work
        elif explicit:
            try:
                ref.r, ref.url = bus.connect(explicit, timeout=2.0, retries=0), explicit
            except bus.BusError as e:
                ref.bus_note, ref.bus_down = f"the control bus is unreachable ({e})", True
        else:
            try:
                url = bus.resolve_url(run_dir, None)
            except bus.BusError as e:
                if os.path.lexists(run_dir / "bus" / "url"):  # there, but unreadable: said as a bus that is down
                    ref.bus_note, ref.bus_down = str(e), True
                else:
                    ref.bus_note = "no control bus for this run dir (it was never started with one)"
            else:
                try:
                    ref.r, ref.url = bus.connect(url, timeout=1.0, retries=0), url
                except bus.BusError as e:
                    ref.bus_note, ref.bus_down = f"the run's embedded bus is down ({e})", True
        if need_bus and ref.r is None:
            raise RunRefError(f"run {rid}: {ref.bus_note}; start it or pass --redis-url")
        if ref.r is not None:
            ref.info = _info(ref.r, rid)
        return ref
    # a run id: look it up on the bus
    if not explicit:
        raise RunRefError(
            f"{run!r} is not a run directory, and no control bus was given to look it up as a run id "
            f"(pass --redis-url or set {bus.ENV_URL})"
        )
    try:
        Keys(run)
    except ValueError as e:  # its words, cut short: they quote the id
        raise RunRefError(printable(str(e), 300)) from None
    r = bus.connect(explicit)
    known = bus.list_runs(r)
    if run not in known:
        raise RunRefError(f"run '{printable(run)}' is not known to the control bus at {bus.redact_url(explicit)}"
                          f"{known_runs_hint(known)}")
    info = _info(r, run)
    return RunRef(run, local_dir(info.get("run_dir")), r, explicit, info=info)


def all_runs(redis_url: str | None) -> list[RunRef]:
    """Every run registered on the (explicit) bus."""
    r, url = connect_explicit(redis_url)
    out = []
    for rid in bus.list_runs(r):
        try:
            Keys(rid)
        except ValueError:
            continue
        info = _info(r, rid)
        out.append(RunRef(rid, local_dir(info.get("run_dir")), r, url, info=info))
    return out


def resolve_many(runs: tuple[str, ...] | list[str], redis_url: str | None, *, view: bool = False) -> list[RunRef]:
    if not runs:
        return all_runs(redis_url)
    return [resolve(x, redis_url, view=view) for x in runs]


def local_dir(path: str | None) -> Path | None:
    """The trainer-registered run dir as a local directory, else None. The info hash is anyone's to
    write: a path too long for the OS, or with a NUL byte, is just not a directory here."""
    if not path:
        return None
    try:
        return Path(path) if Path(path).is_dir() else None
    except (OSError, ValueError):
        return None


def _info(r, run: str) -> dict[str, str]:
    info = read_unless_wrong_type(r, lambda: r.hgetall(Keys(run).info))
    # not a hash: metadata nobody can read; the run's other keys still are what they are
    return {} if info is WRONG_TYPE else dict(info or {})


def issuer() -> str:
    """``cli:USER@HOST``: who issued a directive by hand (goes into the signed body and the audit log)."""
    try:
        user = os.environ.get("USER") or getpass.getuser()
    except Exception:
        user = f"uid{os.getuid()}"
    return f"cli:{user}@{socket.gethostname()}"


def ops_errors(fn):
    """Turn the expected failures of the on-call commands into one-line ``error: ...`` messages."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (bus.BusError, RunRefError, RunDirError) as e:
            raise SentinelError(str(e)) from None
        except KeyboardInterrupt:
            raise SentinelError("interrupted", exit_code=130) from None

    return wrapper


def ago(ts: float | None, now: float | None = None) -> str:
    if ts is None:
        return "-"
    return fmt_duration((time.time() if now is None else now) - ts)


def fmt_duration(sec: float | None) -> str:
    if sec is None:
        return "-"
    sec = max(0.0, float(sec))
    if sec < 90:
        return f"{sec:.0f}s"
    if sec < 90 * 60:
        return f"{sec / 60:.0f}m"
    if sec < 48 * 3600:
        return f"{sec / 3600:.1f}h"
    return f"{sec / 86400:.1f}d"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    try:
        x = float(n)
    except (OverflowError, TypeError, ValueError):  # a bus entry's size of 400 digits
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000 or unit == "TB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{n} B"


def publish_event(ref: RunRef, ev) -> str | None:
    if ref.r is None:
        return None
    return bus.publish_own(ref.r, ref.keys.events, ev)
