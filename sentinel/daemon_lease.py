"""The leader lease of one run: one sentinel acts per run, and everyone can see which one.

The lease is ``Keys.leader`` (the holder's consumer name, SET NX PX, renewed by compare-and-set).
Beside it ``<leader>:holder`` says who that is (host, pid, since, lease length), with the same TTL:
``sentinel status`` and a standby read it, and a sentinel that finds the holder to be a dead
process of its own machine (same host, boot and pid namespace, the pid gone) takes the lease at
once instead of waiting out its TTL: a restarted or standby sentinel on the machine of a crashed
one leads within one probe (``STANDBY_PROBE_S``); across machines, within the lease period.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

# compare-and-renew: only the holder may extend its lease
_RENEW = """
local t = redis.call('TYPE', KEYS[1])['ok']
if t == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if t ~= 'none' and (t ~= 'string' or redis.call('PTTL', KEYS[1]) == -1) then
  -- no sentinel writes a lease without a TTL or of another type: it would hold the run forever
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[2])
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# keep a lease this consumer holds, and its holder key, in one call (pipelined for all the runs a
# daemon leads: ``Lease.queue_keep``); 0 when it is not ours any more (``acquire_or_renew`` then)
_KEEP = """
if redis.call('TYPE', KEYS[1])['ok'] == 'string' and redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  return 1
end
return 0
"""

STANDBY_PROBE_S = 0.25  # a sentinel without the lease tries to take it this often (per run; see standby_probe_s)
STANDBY_PROBES_PER_S = 200  # ... but all of a daemon's standby runs together at most this often


def standby_probe_s(standby_runs: int) -> float:
    """How often a daemon with this many runs led by others tries their leases."""
    return max(STANDBY_PROBE_S, standby_runs / STANDBY_PROBES_PER_S)


def _text(v) -> str | None:
    if v is None:
        return None
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _printable(s: str) -> str:
    """A bus-given name, safe to print (anyone with bus access can write the lease)."""
    return "".join(c if c.isprintable() else "?" for c in s[:200])


def _machine() -> dict:
    """What makes a pid meaningful: the host, this boot, this pid namespace."""
    def read(path: str, link: bool = False) -> str:
        try:
            return os.readlink(path) if link else open(path).read().strip()
        except OSError:
            return ""
    return {"host": socket.gethostname(), "boot": read("/proc/sys/kernel/random/boot_id"),
            "pidns": read("/proc/self/ns/pid", link=True)}


def _pid_alive(pid: int) -> bool:
    try:  # a zombie (killed, not yet reaped by its parent) is dead
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rpartition(b")")[2].split()[:1] == [b"Z"]:
                return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process: alive as far as we can tell
    return True


@dataclass
class Holder:
    consumer: str
    until: float  # Unix time the lease lapses unless renewed
    host: str | None = None
    pid: int | None = None
    since: float | None = None


def holder_key(leader_key: str) -> str:
    return f"{leader_key}:holder"


def read_holder(r: redis.Redis, leader_key: str, now: float | None = None) -> Holder | None:
    """Who holds the lease of a run, and until when (None: nobody)."""
    now = time.time() if now is None else now
    pipe = r.pipeline(transaction=False)
    pipe.get(leader_key)
    pipe.pttl(leader_key)
    pipe.get(holder_key(leader_key))
    try:
        name, pttl, info = pipe.execute(raise_on_error=False)
    except redis.RedisError:
        return None
    name = _text(name) if not isinstance(name, Exception) else None
    if not name:
        return None
    ttl = pttl / 1000.0 if isinstance(pttl, int) and pttl > 0 else 0.0
    h = Holder(consumer=_printable(name), until=now + ttl)
    try:
        d = json.loads(info) if info and not isinstance(info, Exception) else {}
        if isinstance(d, dict) and d.get("consumer") == name:
            h.host = _printable(str(d["host"])) if d.get("host") else None
            h.pid = d["pid"] if type(d.get("pid")) is int else None
            h.since = float(d["since"]) if isinstance(d.get("since"), (int, float)) else None
    except (ValueError, TypeError, RecursionError):
        pass
    return h


class Lease:
    """One run's lease, as held (or waited for) by the consumer ``me``."""

    def __init__(self, r: redis.Redis, key: str, me: str, ttl_ms: int, log: Callable[[str], None]):
        self.r, self.key, self.me, self.ttl_ms, self.log = r, key, me, ttl_ms, log
        self.since: float | None = None
        self._seen: str | None = None  # the other holder last reported (standby log)
        self._machine = _machine()

    def acquire_or_renew(self, on_wrong: Callable[[], None]) -> bool:
        """Take or keep the lease; True while this consumer holds it. ``on_wrong``: the key held no
        lease (no TTL, another type) and was taken over."""
        got = bool(self.r.set(self.key, self.me, nx=True, px=self.ttl_ms))
        if not got:
            renewed = self.r.eval(_RENEW, 1, self.key, self.me, self.ttl_ms)
            if renewed == 2:
                on_wrong()
            got = bool(renewed)
        if not got and self._take_from_dead():
            got = bool(self.r.set(self.key, self.me, nx=True, px=self.ttl_ms))
        if got:
            if self.since is None:
                self.since = time.time()
            self.r.set(holder_key(self.key), self._holder_json(), px=self.ttl_ms)
            self._seen = None
        else:
            self.since = None
        return got

    def _holder_json(self) -> str:
        return json.dumps({"consumer": self.me, "pid": os.getpid(), "since": self.since, "lease_s": self.ttl_ms / 1000.0,
                           **self._machine})

    def queue_keep(self, pipe) -> None:
        """Queue the renewal of a lease this consumer holds (and of its holder key) on ``pipe``: a
        daemon renews all its runs' leases in one round trip. A reply other than 1 means the lease
        is not ours any more: ``acquire_or_renew`` then says what happened."""
        pipe.eval(_KEEP, 2, self.key, holder_key(self.key), self.me, self.ttl_ms, self._holder_json())

    def _take_from_dead(self) -> bool:
        """The holder is a process of this machine that is gone: end its lease now (compare-and-delete)."""
        h = self.r.get(holder_key(self.key))
        try:
            d = json.loads(h) if h else None
        except (ValueError, TypeError, RecursionError):
            return False
        if not isinstance(d, dict) or type(d.get("pid")) is not int or not 0 < d["pid"] < 1 << 22 or d["pid"] == os.getpid():
            return False
        if any(d.get(k) != v for k, v in self._machine.items()) or not self._machine["boot"] or _pid_alive(d["pid"]):
            return False
        name = d.get("consumer")
        if not isinstance(name, str) or _text(self.r.get(self.key)) != name:
            return False
        if self.r.eval(_RELEASE, 2, self.key, holder_key(self.key), name):
            self.log(f"the leader {name} (pid {d['pid']} on this host) is gone: taking over its lease now")
            return True
        return False

    def report_standby(self, run: str) -> None:
        """Say, once per holder, that this sentinel stands by, for whom and until when."""
        h = read_holder(self.r, self.key)
        who = h.consumer if h else None
        if who == self._seen:
            return
        self._seen = who
        if h is None:
            return
        at = f" on {h.host}" + (f" (pid {h.pid})" if h.pid else "") if h.host else ""
        until = time.strftime("%H:%M:%S UTC", time.gmtime(h.until))
        self.log(f"standing by: {h.consumer}{at} leads until {until} (renewed every "
                 f"{self.ttl_ms / 3000:.1f} s); this sentinel takes over within {self.ttl_ms / 1000:g} s of its "
                 "last renewal, at once if it dies on this host")

    def release(self) -> None:
        self.r.eval(_RELEASE, 2, self.key, holder_key(self.key), self.me)
        self.since = None
