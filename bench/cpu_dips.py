"""A noisy machine on demand: this process and its children get a share of the CPUs for a moment, every so often.

    with CpuDips(DipSpec.parse("25:80:1.5")):   # 25 % of the CPUs for 80 ms, every 1.5 s
        ...                                     # Redis, the daemon and its workers started here dip

The project's VM does this on its own in some hours (both vCPUs at 13-48 % of their pace for 50-100 ms
every ~1.5 s, docs/benchmarks/daemon-scale.md), and then a fleet's verdict p99 is the machine's as
much as the daemon's. Asked for, the same regime can be had at any hour, on any Linux machine where
one may create a cgroup with the CPU controller (root, as the bench runs here), so two arms can be
compared in it rather than in whatever minute the machine gives.

How: a cgroup of its own (v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``) holds this process, so every
process it starts afterwards (Redis, ``sentinel run`` and its workers, the floor consumer) is held
in it; a toggling process outside it sets the quota to DUTY % of every CPU for DIP_MS, then lifts
it, every EVERY_S. The quota is enforced per 10 ms period: a process in the group runs at full speed
until the group has used its share of the period, then waits for the next, as a host's throttling
does. Leaving restores everything: the quota lifted, this process back in its old group, the group
removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PERIOD_US = 10_000  # the quota's period: the throttle's grain


class DipError(RuntimeError):
    """The dips cannot be had here (a one-line reason)."""


@dataclass(frozen=True)
class DipSpec:
    duty_percent: float  # the share of every CPU the group keeps during a dip
    dip_ms: float
    every_s: float

    @classmethod
    def parse(cls, text: str) -> DipSpec:
        """``DUTY:MS:EVERY``, for example ``25:80:1.5``."""
        try:
            duty, ms, every = (float(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"{text!r}: want DUTY:MS:EVERY, for example 25:80:1.5 (25 % of the CPUs for 80 ms every 1.5 s)") from None
        if not 1 <= duty < 100:
            raise ValueError(f"{text!r}: the duty must be 1 to 99 (% of the CPUs kept during a dip)")
        if not 10 <= ms <= 10_000 or not every * 1000 > ms or every > 600:
            raise ValueError(f"{text!r}: a dip must last 10 ms to 10 s, and come back after it ends (EVERY > MS)")
        return cls(duty, ms, every)

    def quota_us(self, cpus: int) -> int:
        """The group's CPU microseconds per period during a dip (over every CPU; the kernel's floor is 1 ms)."""
        return max(1000, round(cpus * PERIOD_US * self.duty_percent / 100))

    def as_dict(self) -> dict:
        return {"duty_percent": self.duty_percent, "dip_ms": self.dip_ms, "every_s": self.every_s}


def _v2_root() -> Path | None:
    root = Path("/sys/fs/cgroup")
    return root if (root / "cgroup.controllers").exists() and "cpu" in (root / "cgroup.controllers").read_text().split() else None


class _Group:
    """One cgroup with a CPU quota: v2 where the unified hierarchy has the controller, else v1's."""

    def __init__(self, name: str):
        v2 = _v2_root()
        if v2 is not None:
            self.version, self.base = 2, v2
        elif Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").exists():
            self.version, self.base = 1, Path("/sys/fs/cgroup/cpu")
        else:
            raise DipError("no cgroup CPU controller here (neither v2's cpu.max nor v1's cpu.cfs_quota_us)")
        self.path = self.base / name
        try:
            if self.version == 2 and "cpu" not in (self.base / "cgroup.subtree_control").read_text().split():
                (self.base / "cgroup.subtree_control").write_text("+cpu")
            self.path.mkdir()
            if self.version == 1:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        except OSError as e:
            raise DipError(f"cannot create the cgroup {self.path} ({e.strerror}): the dips need root") from None
        self.limit(None)

    def limit(self, quota_us: int | None) -> None:
        _set_quota(self.path, self.version, quota_us)

    def procs_file(self, path: Path | None = None) -> Path:
        return (path or self.path) / "cgroup.procs"

    def remove(self, back_to: Path) -> None:
        """Every process still inside moved to ``back_to``, then the group removed."""
        with contextlib.suppress(OSError):
            for pid in self.procs_file().read_text().split():
                with contextlib.suppress(OSError):
                    self.procs_file(back_to).write_text(pid)
            self.path.rmdir()


def _set_quota(group: Path, version: int, quota_us: int | None) -> None:
    """The group's CPU time a period (None: no limit)."""
    if version == 2:
        (group / "cpu.max").write_text(f"{'max' if quota_us is None else quota_us} {PERIOD_US}")
    else:
        (group / "cpu.cfs_quota_us").write_text(str(-1 if quota_us is None else quota_us))


def _toggle(group: Path, version: int, quota: int, dip_s: float, every_s: float) -> None:
    """The toggling process: the quota on for ``dip_s``, off, every ``every_s``; lifted at once on
    SIGTERM (the bench leaving, or dying: ``PR_SET_PDEATHSIG``)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # raised in the sleep: no dip outlives the bench
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    try:
        while os.getppid() == parent:  # (the bench gone before the prctl took: nobody would stop us)
            time.sleep(every_s - dip_s)
            _set_quota(group, version, quota)
            time.sleep(dip_s)
            _set_quota(group, version, None)
    finally:
        _set_quota(group, version, None)


class CpuDips:
    """While inside, this process (and what it starts) dips as ``spec`` says. Raises ``DipError``."""

    def __init__(self, spec: DipSpec):
        self.spec = spec
        self._group: _Group | None = None
        self._toggler = None
        self._home: Path | None = None

    def __enter__(self) -> CpuDips:
        g = self._group = _Group(f"sentinel-bench-dips-{os.getpid()}")
        self._home = self._own_group(g)
        ctx = multiprocessing.get_context("fork")  # started before this process joins the group: it stays outside
        self._toggler = ctx.Process(target=_toggle, daemon=True, args=(
            g.path, g.version, self.spec.quota_us(os.cpu_count() or 1), self.spec.dip_ms / 1000, self.spec.every_s))
        self._toggler.start()
        try:
            g.procs_file().write_text(str(os.getpid()))
        except OSError as e:
            self.__exit__(None, None, None)
            raise DipError(f"cannot move this process into {g.path} ({e.strerror})") from None
        return self

    def __exit__(self, *exc) -> None:
        g = self._group
        if g is None:
            return
        with contextlib.suppress(OSError):
            g.procs_file(self._home).write_text(str(os.getpid()))
        if self._toggler is not None:
            self._toggler.terminate()
            self._toggler.join(5)
        g.limit(None)
        g.remove(self._home)
        self._group = None

    @staticmethod
    def _own_group(g: _Group) -> Path:
        """The group this process is in now, in ``g``'s hierarchy (where it goes back to)."""
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hier, controllers, path = line.split(":", 2)
            if (g.version == 2 and hier == "0") or (g.version == 1 and "cpu" in controllers.split(",")):
                return g.base / path.lstrip("/")
        return g.base
