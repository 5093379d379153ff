"""``sentinel run --workers K``: K daemon processes, each watching a share of the runs, one supervisor.

One Python process judges a fleet on one core at most (the GIL), and a process at half a core
drains a backlog at half a core: after each stall of the machine (a 2-vCPU VM's CPUs dip for
50-100 ms every ~1.5 s) its verdicts queue for as long. K workers drain their shares at once.
At 300 runs on the project's 2-vCPU VM, 2 workers read a verdict p99 of 43.5 ms (median of 15
runs; <= 50 ms in 10) where one process read 67.8 ms (2 of 15), for ~30 % more CPU in all
(docs/benchmarks/daemon-scale.md).

The supervisor is this process. It starts worker I of K as ``sentinel run ... --worker I/K``
(every option as given, one consumer name for all: a restarted worker's leases and pending entries
are its own at once), forwards their log lines, restarts one that dies (after 1, 2, 4 ... 30 s),
and serves their metrics as one endpoint (``workers_metrics``). It gives up, stopping the others,
when a worker's first start ends at once with the error status (2: a setting it refuses, or a bus
it cannot reach, as one ``sentinel run`` would exit), or a worker dies within ``FAST_DEATH_S`` of
its start ``GIVE_UP_AFTER`` times in a row (a worker that ran a while and then exits 2, such as
after losing its bus, is started again). The first SIGTERM or Ctrl-C is
passed on to every worker (a warm stop: each finishes its batch, saves its state and releases its
leases); a second one too (their cold stop). A worker whose supervisor dies stops itself
(``watch_parent``).
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

FAST_DEATH_S = 10.0  # a worker that dies this soon after its start counts towards giving up
GIVE_UP_AFTER = 5  # ... so many times in a row
BACKOFF_MAX_S = 30.0
ENV_SUPERVISOR = "SENTINEL_SUPERVISOR_PID"  # set for a worker: the supervisor it stops without
_METRICS_LINE = re.compile(r"sentinel metrics on http://127\.0\.0\.1:(\d+)/metrics")


@dataclass
class Worker:
    index: int
    argv: list[str]
    proc: subprocess.Popen | None = None
    started: float = 0.0
    port: int | None = None
    restarts: int = 0
    fast_deaths: int = 0
    next_start: float = 0.0
    backoff: float = 0.0
    pumps: list[threading.Thread] = field(default_factory=list)


class Supervisor:
    """Runs the workers until asked to stop (``stop``), or until one cannot be kept up; ``run``
    returns the exit status for ``sentinel run``."""

    def __init__(self, argvs: dict[int, list[str]], count: int, log: Callable[[str], None],
                 env: dict[str, str] | None = None, *, fast_death_s: float = FAST_DEATH_S,
                 give_up_after: int = GIVE_UP_AFTER, first_backoff_s: float = 1.0):
        self.workers = [Worker(i, argv) for i, argv in sorted(argvs.items())]
        self.count, self.log = count, log
        self.fast_death_s, self.give_up_after, self.first_backoff_s = fast_death_s, give_up_after, first_backoff_s
        self.env = {**(env if env is not None else os.environ), ENV_SUPERVISOR: str(os.getpid())}
        self.stops = 0
        self._failed: str | None = None
        self._out_lock = threading.Lock()

    # ------------------------------------------------------------------ what the metrics endpoint reads
    def ports(self) -> dict[str, int | None]:
        return {str(w.index): (w.port if w.proc is not None and w.proc.poll() is None else None) for w in self.workers}

    def restart_counts(self) -> dict[str, int]:
        return {str(w.index): w.restarts for w in self.workers}

    # ------------------------------------------------------------------ the loop
    def run(self, tick_s: float = 0.2) -> int:
        for w in self.workers:
            if self._failed is None:
                self._start(w)
        while True:
            now = time.monotonic()
            live = 0
            for w in self.workers:
                code = w.proc.poll() if w.proc is not None else None
                if w.proc is not None and code is None:
                    live += 1
                    continue
                if w.proc is not None:  # it exited
                    self._exited(w, code, now)
                if not self.stops and self._failed is None and w.proc is None and now >= w.next_start:
                    self._start(w)
                    live += w.proc is not None
            if self._failed is not None and not self.stops:
                self.stop()
            if self.stops and not live:
                break
            time.sleep(tick_s)
        for w in self.workers:
            for t in w.pumps:
                t.join(timeout=2.0)
        if self._failed is not None:
            self.log(self._failed)
            return 2
        return 130 if self.stops > 1 else 0

    def stop(self) -> None:
        """Pass a stop on to every live worker: the first a warm stop, a second their cold stop."""
        self.stops += 1
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                try:
                    w.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def _start(self, w: Worker) -> None:
        try:
            w.proc = subprocess.Popen(w.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env,
                                      start_new_session=True)  # a terminal's Ctrl-C reaches the supervisor only
        except OSError as e:  # no fork (EAGAIN, ENOMEM) or no interpreter: counted as a death at its start
            w.proc, w.started = None, time.monotonic()
            self.log(f"worker {w.index}/{self.count} could not start ({e.strerror or type(e).__name__})")
            self._exited(w, -1, w.started)
            return
        w.started, w.port = time.monotonic(), None
        w.pumps = [threading.Thread(target=self._pump, args=(w, stream, out), daemon=True, name=f"worker-{w.index}-{name}")
                   for stream, out, name in ((w.proc.stdout, sys.stdout, "out"), (w.proc.stderr, sys.stderr, "err"))]
        for t in w.pumps:
            t.start()
        self.log(f"worker {w.index}/{self.count} started (pid {w.proc.pid})")

    def _pump(self, w: Worker, stream, out) -> None:
        """A worker's lines, on to ours as they are; its metrics address is kept, not shown."""
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            m = _METRICS_LINE.search(line)
            if m and w.port is None:
                w.port = int(m.group(1))
                continue
            with self._out_lock:
                try:
                    out.write(line if line.endswith("\n") else line + "\n")
                    out.flush()
                except (OSError, ValueError):  # our own output closed: the lines are dropped, the worker goes on
                    pass
        stream.close()

    def _exited(self, w: Worker, code: int, now: float) -> None:
        lived = now - w.started
        w.proc, w.port = None, None
        if self.stops:
            return
        fast = lived < self.fast_death_s
        if code == 2 and not w.restarts and fast:  # at its first start: its settings, every time
            self._failed = f"error: worker {w.index}/{self.count} exited with status 2 (an error in its settings, above): stopping"
            return
        w.fast_deaths = w.fast_deaths + 1 if fast else 0
        if w.fast_deaths >= self.give_up_after:
            self._failed = (f"error: worker {w.index}/{self.count} exited {w.fast_deaths} times in a row within "
                            f"{self.fast_death_s:g} s of its start (last status {code}): stopping")
            return
        w.backoff = 0.0 if not fast else min(BACKOFF_MAX_S, self.first_backoff_s * 2 ** (w.fast_deaths - 1))
        w.next_start = now + w.backoff
        w.restarts += 1
        self.log(f"worker {w.index}/{self.count} exited (status {code}) after {lived:.1f} s; starting it again"
                 + (f" in {w.backoff:g} s" if w.backoff else ""))


def watch_parent() -> None:
    """In a worker: stop (SIGTERM: a warm stop) when the supervisor that started it dies, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG). Elsewhere, or when the supervisor is gone already, the
    worker exits at once."""
    expected = os.environ.get(ENV_SUPERVISOR)
    if not expected:
        return
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if str(os.getppid()) != expected:  # it died before the prctl took: nobody would stop us
        sys.exit(0)
