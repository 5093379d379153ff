"""One sentinel process, several runs, each on its own bus with its own secret.

``sentinel run runs/A runs/B`` gives each distinct (bus, secret) pair its own ``Daemon`` and
round-robins them in one loop. A failure of one bus (down, restarting, refusing) backs off that
member only; the others keep being watched. For a run on its embedded bus the fleet is also the
bus's supervisor: a bus found dead is restarted from its AOF (``embedded.restart_if_dead``) and
counted in ``sentinel_bus_restarts_total``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import redis

from sentinel import bus
from sentinel.daemon import Daemon
from sentinel.metrics import SentinelMetrics


@dataclass
class Member:
    daemon: Daemon
    url: str  # with the password, if any: never log it unredacted
    run_dir: Path | None = None  # the run whose embedded bus this is (supervised), else None
    backoff: float = 0.5
    next_try: float = 0.0
    label: str = field(init=False)

    def __post_init__(self) -> None:
        self.label = bus.redact_url(self.url)

    def reconnect(self, url: str) -> None:
        """Point the daemon and its watchers at a bus that came back on another URL."""
        r = bus.connect(url, check=False)
        self.daemon.r = r
        for w in self.daemon.watchers.values():
            w.r = r
        self.url, self.label = url, bus.redact_url(url)


class Fleet:
    def __init__(self, members: list[Member], metrics: SentinelMetrics, log: Callable[[str], None] = print):
        self.members, self.m, self.log = members, metrics, log
        self.stop_requested = False
        self._settled = 0  # watchers there were at the last full collection (``_settle``)

    def iterate(self) -> None:
        """One pass over every member that is not backing off or paced; sleeps briefly when all are."""
        now = time.monotonic()
        block_ms = max(10, 100 // max(1, len(self.members)))
        ready = [m for m in self.members if now >= m.next_try and now >= m.daemon.next_read_at]
        for m in ready:
            try:
                m.daemon.iterate(block_ms=block_ms)
                m.backoff = 0.5
            except (bus.BusError, redis.RedisError) as e:
                self._failed(m, e)
            except Exception as e:  # noqa: BLE001 - one run's bug must not stop the watch over the others
                self.log(f"internal error on {m.label} ({e.__class__.__name__}: {str(e)[:200]}); retrying in {m.backoff:.1f}s")
                m.next_try = time.monotonic() + m.backoff
                m.backoff = min(m.backoff * 2, 10.0)
        self._settle()
        if not ready:  # each member backing off, or paced (``Options.pace_per_run_s``)
            time.sleep(min(0.1, max(0.0, min(max(m.next_try, m.daemon.next_read_at) for m in self.members) - now)))

    def _settle(self) -> None:
        """After a pass that added watchers (a tenth more than at the last time, and 16 or more): one
        full collection at once. A new watcher's objects (~200 a run: its policy, detectors and
        windows) are young, and the collections of the young generations walk them again and again
        until they age: at 300 runs a pass over the middle generation took 47 ms in the middle of
        judging (docs/benchmarks/daemon-scale.md). Collected here, they are old from the start."""
        n = sum(len(m.daemon.watchers) for m in self.members)
        if n >= 1.1 * self._settled + 16:
            gc.collect()
            self._settled = n
        elif n < self._settled:
            self._settled = n

    def _failed(self, m: Member, e: BaseException) -> None:
        self.m.bus_errors.inc()
        self.log(f"control bus {m.label} error ({e.__class__.__name__}): {bus.redact_url(str(e))}; retrying in {m.backoff:.1f}s")
        m.next_try = time.monotonic() + m.backoff
        m.backoff = min(m.backoff * 2, 10.0)
        for w in m.daemon.watchers.values():
            w._recovered = False  # re-read pending entries once the bus is back
        self._supervise(m)

    def _supervise(self, m: Member) -> None:
        if m.run_dir is None:
            return
        from sentinel.embedded import restart_if_dead

        try:
            url, restarted = restart_if_dead(m.run_dir)
        except bus.BusError as e:
            self.log(f"could not restart the embedded bus of {m.run_dir}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - a full disk, a file of the bus dir gone bad: retried, never fatal
            self.log(f"could not restart the embedded bus of {m.run_dir} ({e.__class__.__name__}: "
                     f"{bus.redact_url(str(e))[:200]}); retrying in {m.backoff:.1f}s")
            return
        if restarted:
            for run in m.daemon.watchers or {m.run_dir.name: None}:
                self.m.bus_restarts.labels(run).inc()
            self.log(f"embedded bus of {m.run_dir} was down: restarted it from its AOF at {bus.redact_url(url)}")
            m.next_try = 0.0
        if url != m.url:
            m.reconnect(url)

    def run_forever(self) -> None:
        try:
            while not self.stop_requested:
                self.iterate()
        finally:
            for m in self.members:
                for w in m.daemon.watchers.values():
                    try:
                        w.release()
                    except (bus.BusError, redis.RedisError):
                        pass
