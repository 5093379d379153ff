"""The daemon's settings (``Options``), its limits, and the small readers its parts share."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from sentinel.protocol import Event
from sentinel.rules import RuleSet

DIRECTIVE_TTL_S = 600.0  # a directive nobody applied within 10 minutes is stale: the trainer rejects it
DISCOVER_PER_PASS = 2000  # registered names looked at per discovery pass (every 2 s)
LIVE_PROBE = 16  # newest steps entries looked at for one the trainer signed
SENT_KEPT = 1024  # directives this sentinel sent, remembered (id -> stream entry) to tell their acks apart
EVENT_KEYS_KEPT = 4096  # keys of the newest events on the bus, remembered to publish each event once
SENT_SAVED = 256  # ... and how many of them the persisted state carries to a successor
PACE_MAX_S = 0.02  # ``Options.pace_per_run_s`` adds at most this much to a verdict's latency
POLL_IDLE_S = 0.1  # a run with no new step record is still polled (acks, approvals, the clock) this often


def _is_file(p: Path) -> bool:
    try:  # a bus-given path may be too long for the OS (ENAMETOOLONG is not swallowed by is_file)
        return p.is_file()
    except (OSError, ValueError):
        return False


_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")  # a Redis stream entry id, as the state saves them


def _count(v: object, none: bool = False) -> int | None:
    """A non-negative int from a saved state (a bool, float or text there is corruption)."""
    if v is None and none:
        return None
    if type(v) is not int or v < 0:
        raise ValueError("not a count")
    return v


def _finite(v: object) -> float | None:
    """A finite time from a saved state, or None (absent: a state saved before it was kept)."""
    if v is None:
        return None
    if type(v) not in (int, float) or not math.isfinite(v):
        raise ValueError("not a time")
    return float(v)


def event_key(ev: Event) -> str:
    """An event's idempotency key: what it says, about what (a replay of the same records derives the
    same key; the time it was derived at is left out)."""
    data = {k: v for k, v in ev.data.items() if k not in ("key", "history")}
    what = json.dumps([ev.kind, ev.incident_id, ev.step, ev.message, data], default=str, sort_keys=True)
    return f"{ev.kind}:{ev.step}:{hashlib.sha256(what.encode()).hexdigest()[:16]}"


def _id_seconds(eid: str) -> float:
    """The Unix time a stream entry id is stamped with."""
    return int(eid.partition("-")[0]) / 1000.0


@functools.lru_cache(maxsize=4096)
def _stream_id_tuple(eid: str) -> tuple[int, int]:
    """A stream id as numbers, for comparing. Cached: each record's id is compared at its poll and,
    as the position the state covers, at the next ones (~5 times a record; 1.3 µs a parse)."""
    a, _, b = eid.partition("-")
    return int(a), int(b or 0)


@dataclass
class Options:
    rules: RuleSet
    secret: bytes
    consumer: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    dry_run: bool = False
    require_approval: bool | None = None
    lease_ms: int = 10_000
    batch: int = 500
    alertmanager_url: str | None = None
    # records older than this, already on the stream when the lease was taken, are history: they
    # rebuild the detectors' state, but the sentinel does not act on incidents that are long over
    backlog_age_s: float = 120.0
    # with no run named: how many registered runs to watch at most, and after how long without a
    # step record (and no heartbeat) a run counts as over
    max_runs: int = 1024
    idle_s: float = 86_400.0
    # run id -> its run directory, where incidents and pages are mirrored (else the dir the trainer
    # registered on the bus, when it exists on this machine)
    run_dirs: dict[str, Path] = field(default_factory=dict)
    # a run's state save and the XACK of what it covers, when only step records moved it: at most
    # this often (0: every poll). Unacknowledged entries are delivered again after a crash or a
    # failover and judged again from the saved state; an event, an ack, an approval or a checkpoint
    # saves at the end of the poll, and every directive and page is preceded by a save of its own
    state_save_s: float = 0.0
    # the least time from one step read to the next, per run this daemon leads, up to ``PACE_MAX_S``
    # (0: read again at once). A read that names N streams costs Redis and this process O(N) however
    # little it returns: with records always waiting (a fleet of 300 runs), back-to-back reads took ~18
    # records each, and the read and the side reads ~2 ms of each ~5.5 ms iteration
    # (docs/benchmarks/daemon-scale.md). Not after a full batch: a backlog is read at once
    pace_per_run_s: float = 0.0
    # a healthy run's acks and approvals read, and its clock rules run, at most this often (0: at
    # every poll). A run polled for each step record it sends read both streams at each record;
    # neither is awaited while nothing is going on. A run with an incident open, or that was just
    # sent a directive or page, reads them at every poll; its checkpoints are read at every poll
    side_read_s: float = 0.0
    # (index, count) of ``sentinel run --workers``: this daemon discovers only the runs whose id hashes
    # to its index (``sentinel.shards``); (0, 1): every run
    shard: tuple[int, int] = (0, 1)
