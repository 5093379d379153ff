"""A training loop's side of the control bus: publish steps, receive signed directives, send acks.

Our trainer's rank 0 uses it, and so can any other loop (docs/integrate.md): it needs no torch.

The one rule this module exists to keep: **Redis must never stall a training step.** Every
method the training loop calls only touches in-memory queues (a lock held for microseconds);
all network I/O happens in one background thread. If Redis is slow, the thread waits, not the
step. If Redis is down, the thread backs off (0.5 s doubling to 5 s) while the queue buffers up
to ``queue_max`` telemetry records; beyond that the oldest are dropped and counted in
``dropped`` (exported as ``training_telemetry_dropped_total``). When Redis returns, the
buffered records are delivered in order and directives resume.

Delivery is at-least-once: a batch whose reply was lost (timeout mid-pipeline) is sent again.
That is harmless by design: the last step record for a step number is authoritative, acks are
keyed by directive id, and the trainer dedupes directives by id.

Each I/O iteration is ONE pipelined round trip: XADD the queued records, HSET/SET pending
checkpoint and skip-list updates, refresh the heartbeat, and XREAD new directives (non-blocking).

Hostile input: the directives stream is read with a ``bytes`` client and decoded entry by entry,
so no entry (not UTF-8, no ``json`` field, 100,000-deep JSON, ``v`` a string) can fail the
pipeline, stall the reader or crash the trainer: each is rejected, counted by reason
(``rejected_by_reason``), acked ``rejected`` and, with ``cursor_file``, never read again after
a restart. Step records and acks carry an HMAC (``protocol.record_mac``) so that only a holder
of the run's secret can feed the sentinel.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

try:  # the C packer of redis[hiredis]; redis-py's own otherwise
    from hiredis import pack_command as _pack
except ImportError:  # pragma: no cover - hiredis is a dependency
    _pack = None

from sentinel.bus import FIELD, BusError, check_is_redis, connect, redact_url
from sentinel.client.bus_intake import INBOX_MAX, REJECT_ACK_BURST, DirectiveIntake, _id_tuple, _short, read_cursor
from sentinel.protocol import (
    RECORD_MAC_FIELD,
    Keys,
    TimelineRecord,
    record_mac,
)

_CONN_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, OSError)
RECONNECT_EVERY_S = 5.0  # how often an unreachable bus may be restarted (``reconnect``)


HB_STEP_GAP_S = 0.5  # a heartbeat for a new step at most this often (the same step: every _hb_every)
MAC_ON_SEND = "mac-on-send"  # a queued record's MAC slot: the I/O thread computes it as it sends the record

def round_trip(r: redis.Redis, conn, cmds: list[tuple]) -> list:
    """Send ``cmds`` on ``conn`` (a connection of ``r``'s pool) in one write and read their replies (a reply is
    the exception for a command Redis refused).

    What ``r.pipeline(transaction=False).execute(raise_on_error=False)`` does, at a fraction of its Python cost
    per command and per round trip: the commands are packed by hiredis in C, each reply is read as it is
    (the ``XREAD``'s gets redis-py's own parsing: entries as ``(id, {field: value})``), and the connection
    is not checked out of the pool and back each time. A tiny model's loop publishes ~100 records a second,
    and the I/O thread's Python competes with it for the GIL (bench/callback_overhead.py). On a connection
    error the connection is closed (it connects again at its next use); the caller retries."""
    try:
        conn.send_packed_command([b"".join(_pack(c) for c in cmds)] if _pack is not None else conn.pack_commands(cmds))
        out: list = []
        for c in cmds:
            try:
                out.append(r.parse_response(conn, c[0]) if c[0] == "XREAD" else conn.read_response())
            except redis.ResponseError as e:
                out.append(e)
        return out
    except BaseException:
        conn.disconnect()  # a reply half read must not be read by the next command on this connection
        raise


class BusClient(DirectiveIntake):
    """Non-blocking bus client for a training loop (its rank 0 only): ours, or any other (docs/integrate.md).

    ``start_after_id`` is the directives-stream id after which to start reading: ``"0-0"``
    (default) re-reads every directive still in the stream, so a restarted trainer also sees
    the ones issued while it was down (it dedupes by directive id against its own
    ``directives.jsonl``); ``"$"`` starts after whatever is in the stream when the client first
    connects. The heartbeat key (TTL ``heartbeat_ttl_s``) exists while this process is alive and
    connected; its JSON ``{"step", "time", "sent", "pid"}`` carries the last *published step* and
    when it was published, so a hung step loop shows as a stale ``time`` under a fresh ``sent``.

    ``cursor_file``: where the directives-stream position is persisted once every entry up to it
    has been handled (rejected here, or returned by ``poll_directives`` and then handled by the
    caller before its next poll). A restart resumes after it instead of re-reading the stream.

    ``reconnect``: called from the I/O thread (at most every ``RECONNECT_EVERY_S``) while the bus
    is unreachable; it may restart the bus and returns the URL to use (the embedded bus's
    supervisor: ``lambda: ensure_embedded(run_dir)``).

    A malformed ``url`` raises ``BusError`` here (misconfiguration); an unreachable Redis never does.
    """

    def __init__(
        self,
        url: str,
        run: str,
        secret: bytes,
        *,
        queue_max: int = 10000,
        heartbeat_ttl_s: float = 30.0,
        logger: logging.Logger | None = None,
        start_after_id: str = "0-0",
        steps_maxlen: int = 100_000,
        events_maxlen: int = 10_000,
        poll_interval_s: float = 0.1,
        io_timeout_s: float = 2.0,
        max_batch: int = 500,
        cursor_file: str | os.PathLike | None = None,
        reconnect: Callable[[], str] | None = None,
    ):
        if not secret:
            raise ValueError("BusClient needs a non-empty directive secret")
        self.run = run
        self.keys = Keys(run)
        self.dropped = 0
        self.rejected = 0
        self.rejected_by_reason: Counter[str] = Counter()
        self.bus_restarts = 0
        self.connected = False
        self._secret = secret
        self._url = redact_url(url)
        self._full_url = url
        self._log = logger or logging.getLogger("sentinel.client.bus")
        self._queue_max = max(1, int(queue_max))
        self._hb_ttl_ms = max(1000, int(heartbeat_ttl_s * 1000))
        self._hb_every = min(1.0, heartbeat_ttl_s / 3)
        self._steps_maxlen = steps_maxlen
        self._events_maxlen = events_maxlen
        self._poll = poll_interval_s
        self._max_batch = max_batch
        self._cursor_file = Path(cursor_file) if cursor_file is not None else None
        saved = read_cursor(self._cursor_file)
        if saved and (start_after_id == "$" or _id_tuple(saved) > _id_tuple(start_after_id)):
            start_after_id = saved
        self._last_dir_id = start_after_id
        self._resolve_tail = start_after_id == "$"
        self._cursor = saved  # persisted position
        self._handed_upto: str | None = None  # newest id returned by the previous poll_directives
        self._reconnect = reconnect
        self._next_reconnect = 0.0
        self._io_timeout = io_timeout_s
        self._retain: set[int] | None = None  # checkpoint steps on disk (retention ran)

        self._lock = threading.Lock()
        self._telemetry: deque[tuple[str, str, int]] = deque()  # (stream, json, maxlen): droppable
        self._control: deque[tuple[str, str, int]] = deque()  # acks: delivered or counted, never silently lost
        self._checkpoints: dict[str, str] = {}  # step -> CheckpointInfo json (coalesced)
        self._skiplist: str | None = None  # latest value only
        # (stream id, directive json or None, reject reason when it could not be decoded)
        # never capped by dropping: a flood of junk must not push a genuine directive out. Reading the
        # stream pauses instead while it holds INBOX_MAX (the training loop drains it at every poll)
        self._inbox: deque[tuple[str, str | None, str | None]] = deque()
        self._inflight = 0
        self._step: int | None = None
        self._timeline = 0
        self._step_time = 0.0
        self._hb_sent = 0.0
        self._hb_step: int | None = None
        self._hb_paused = False  # the paused flag the last heartbeat written carried
        self._paused = False
        self._closed = False
        self._last_logged: dict[str, float] = {}
        self._reject_tokens, self._reject_refill = float(REJECT_ACK_BURST), time.monotonic()
        self._info: dict[str, str] | None = None  # the run's registry metadata (register)
        self._info_sent = False
        self._ckpt_known: dict[str, str] = {}  # every checkpoint entry registered and not retired: re-sent
        self._skip_known: str | None = None  # ... and the skip list, when the registry lost the run
        self._dir_wrong_type = False  # the directives key holds another Redis type (counted once)
        self._repaired_at: dict[str, float] = {}  # stream -> when its far-future entries were last removed
        self._future_seen: set[str] = set()  # far-future directive entries refused already (until removed)

        self._r = connect(url, check=False, timeout=io_timeout_s, retries=0, decode=False)
        self._conn, self._conn_of = None, None  # the I/O thread's round-trip connection (from self._r's pool)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"bus-io-{run}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ main-thread API (no I/O)

    def _mac(self, stream: str, data: str) -> str:
        return record_mac(self._secret, stream, data)

    def publish_step(self, rec, data: str | None = None) -> None:
        """Queue a ``StepRecord``, ``TimelineRecord`` or ``MarkerRecord``; ``data``: its JSON text when the
        caller has it already (the step log's line). Never blocks; drops the oldest when full. The MAC is
        computed by the I/O thread when it sends (``MAC_ON_SEND``): off the training loop's time."""
        if data is None:
            data = rec.to_json()
        mac = MAC_ON_SEND
        with self._lock:
            if isinstance(rec, TimelineRecord):
                self._step, self._timeline = rec.from_step, rec.timeline
            else:
                self._step, self._timeline = rec.step, getattr(rec, "timeline", 0)
            self._step_time = time.time()
            self._push(self._telemetry, (self.keys.steps, data, self._steps_maxlen, mac))
        # no wake-up: the I/O thread sends what is queued every poll interval (0.1 s), many records in one
        # round trip. Waking it per step made it compete with the training loop for the GIL at every step
        # (0.34 ms a step on a tiny CPU model: bench/callback_overhead.py)

    def send_soon(self) -> None:
        """Wake the I/O thread: what is queued goes out now, not at the next poll interval (for a batch of
        records queued at a moment the loop leaves the GIL free, ``sentinel.client.held_steps``)."""
        self._wake.set()

    def publish_event(self, ev) -> None:
        """Queue an ``Event`` (droppable telemetry, like steps)."""
        data = ev.to_json()
        with self._lock:
            self._push(self._telemetry, (self.keys.events, data, self._events_maxlen, None))

    def register(self, info: dict[str, Any]) -> None:
        """Add the run to the bus's run registry (``Keys.RUNS``) with its metadata hash, and keep it
        there: every heartbeat re-adds it, and when it was missing (Redis came back without its data,
        or someone removed it) the metadata, checkpoints and skip list are written again, or a
        restarted sentinel would not find the run, nor its rollback targets."""
        mapping = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
        with self._lock:
            self._info = mapping
            self._info_sent = False
        self._wake.set()

    def register_checkpoint(self, info) -> None:
        """Queue ``HSET Keys(run).checkpoints step -> CheckpointInfo``."""
        data = info.to_json()
        with self._lock:
            self._checkpoints[str(info.step)] = data
            self._ckpt_known[str(info.step)] = data
        self._wake.set()

    def retain_checkpoints(self, steps) -> None:
        """The checkpoint steps still on disk after retention: the bus forgets older ones.

        Entries newer than the newest of ``steps`` are kept (a registration may be in flight).
        """
        with self._lock:
            self._retain = {int(s) for s in steps}
        self._wake.set()

    def set_skiplist(self, ranges) -> None:
        """Queue ``SET Keys(run).skiplist`` (JSON list of [lo, hi)); only the latest value is sent."""
        data = json.dumps([[int(lo), int(hi)] for lo, hi in ranges])
        with self._lock:
            self._skiplist = self._skip_known = data
        self._wake.set()

    def ack(self, ack) -> None:
        """Queue an ``Ack`` (MAC'd) for the sentinel."""
        data = ack.to_json()
        mac = self._mac(self.keys.acks, data)
        with self._lock:
            self._push(self._control, (self.keys.acks, data, self._events_maxlen, mac))
        self._wake.set()

    def set_paused(self, paused: bool) -> None:
        """Say on the heartbeat that the run is paused on purpose: no new step is then not a hang."""
        with self._lock:
            changed = self._paused != bool(paused)
            self._paused = bool(paused)
            if changed:  # the next I/O iteration sees the flag differ from the one last written, and writes it
                # the pause/resume is progress of a kind: the time a pause lasted is no hang after a resume
                self._step_time = time.time()
        self._wake.set()

    @property
    def pending(self) -> int:
        """Records queued but not yet confirmed written."""
        with self._lock:
            return self._pending_locked()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait (up to ``timeout``) until everything queued is written, the heartbeat of the newest step
        included. For shutdown and tests."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                n = self._pending_locked()
                if self._step is not None and self._hb_step != self._step:
                    n += 1
                    self._hb_step = None  # the next iteration refreshes it, whatever its rate limit
            if n == 0:
                return True
            if time.monotonic() >= deadline or not self._thread.is_alive():
                return False
            self._wake.set()
            time.sleep(0.005)

    def close(self, timeout: float = 2.0) -> None:
        """Best-effort flush, then stop the I/O thread. Bounded by ``timeout`` (x2 at worst). What the
        bus did not take by then is lost to it: one warning says how much."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        lost = self.pending
        if lost:
            self._log.warning("control bus %s: %d record(s) not delivered at shutdown: the sentinel may never see them",
                              self._url, lost)
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing a dead connection must not fail shutdown
            pass

    def __enter__(self) -> BusClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers (lock held)

    def _push(self, q: deque, item: tuple[str, str, int, str | None]) -> None:
        if self._closed:
            self.dropped += 1
            return
        q.append(item)
        while len(q) > self._queue_max:
            q.popleft()
            self.dropped += 1

    def _pending_locked(self) -> int:
        return (len(self._telemetry) + len(self._control) + len(self._checkpoints) + (self._skiplist is not None)
                + (self._retain is not None) + self._inflight)

    # ------------------------------------------------------------------ I/O thread

    def _log_limited(self, key: str, msg: str, *args: Any) -> None:
        """Log a repeated I/O-thread error at most every 30 s (it may recur 10 times a second)."""
        now = time.monotonic()
        if now - self._last_logged.get(key, -1e9) >= 30.0:
            self._last_logged[key] = now
            self._log.error(msg, *args)

    def _run(self) -> None:
        """The I/O loop: one pipelined round trip per iteration; backoff while Redis is away."""
        backoff = 0.5
        while not self._stop.is_set():
            self._wake.wait(self._poll)
            self._wake.clear()
            if not self.connected:
                # before the client library reads a reply: a server that is no Redis could announce a
                # gigabyte and the trainer would hold it in memory (3.2 GB measured), at every retry
                try:
                    check_is_redis(self._full_url, self._io_timeout)
                except BusError as e:
                    self._log_limited("not_redis", "control bus: %s; retrying in the background", _short(e))
                    self._maybe_restart_bus()  # a dead embedded bus whose port a stranger took: restart it elsewhere
                    self._stop.wait(backoff * random.uniform(0.8, 1.2))
                    backoff = min(backoff * 2, 5.0)
                    continue
            try:
                self._iteration()
            except _CONN_ERRORS as e:
                self._maybe_restart_bus()
                if self.connected:
                    self._log.warning("control bus %s unreachable (%s); buffering up to %d records", self._url, _short(e), self._queue_max)
                elif backoff == 0.5:
                    self._log.warning("control bus %s not reachable yet (%s); retrying in the background", self._url, _short(e))
                self.connected = False
                self._stop.wait(backoff * random.uniform(0.8, 1.2))
                backoff = min(backoff * 2, 5.0)
                continue
            except Exception as e:  # noqa: BLE001 - the I/O thread must survive anything
                if not self._stop.is_set():  # else close() shut the connection under a stalled read
                    self._log_limited("io", "control bus I/O error: %s", _short(e))
                self._stop.wait(0.5)
                continue
            if backoff > 0.5:  # there were failures since the last round trip that worked
                self._log.info("control bus %s reachable again", self._url)
            self.connected = True
            backoff = 0.5

    def _maybe_restart_bus(self) -> None:
        """Let the supervisor (``reconnect``) restart a dead bus; switch over if its URL changed."""
        now = time.monotonic()
        if self._reconnect is None or now < self._next_reconnect:
            return
        self._next_reconnect = now + RECONNECT_EVERY_S
        try:
            url = self._reconnect()
        except Exception as e:  # noqa: BLE001 - a failed restart is retried later, never fatal
            self._log_limited("restart", "could not restart the control bus: %s", _short(e))
            return
        self.bus_restarts += 1
        if url != self._full_url:
            self._log.warning("control bus restarted at %s", redact_url(url))
            old, self._r = self._r, connect(url, check=False, timeout=self._io_timeout, retries=0, decode=False)
            self._url = redact_url(url)
            self._full_url = url
            try:
                old.close()
            except Exception:  # noqa: BLE001
                pass

    def _take(self) -> tuple[list[tuple[str, str, int, str | None]], dict[str, str], str | None]:
        with self._lock:
            # acks first: control traffic must not wait behind a backlog of step records
            batch = [self._control.popleft() for _ in range(min(len(self._control), self._max_batch))]
            room = self._max_batch - len(batch)
            batch += [self._telemetry.popleft() for _ in range(min(len(self._telemetry), room))]
            ckpts, self._checkpoints = self._checkpoints, {}
            skip, self._skiplist = self._skiplist, None
            self._inflight = len(batch) + len(ckpts) + (skip is not None)
            return batch, ckpts, skip

    def _apply_retention(self, r: redis.Redis) -> None:
        """HDEL checkpoint entries whose checkpoint retention deleted (older than the newest kept)."""
        with self._lock:
            keep, self._retain = self._retain, None
        if not keep:
            return
        try:
            # field names are anyone's to write: only plain step numbers count (int() refuses >4300 digits)
            steps = {f: int(f) for f in r.hkeys(self.keys.checkpoints) if f.isdigit() and len(f) <= 20}
            gone = [f for f, s in steps.items() if s < max(keep) and s not in keep]
            if gone:
                r.hdel(self.keys.checkpoints, *gone)
            with self._lock:
                for f in [f for f in self._ckpt_known if int(f) < max(keep) and int(f) not in keep]:
                    del self._ckpt_known[f]
        except redis.ResponseError as e:
            # e.g. WRONGTYPE: retrying cannot fix it, and must not hold back the step records behind it
            self._log_limited("retention", "checkpoint retention on the bus skipped: %s", _short(e))
        except BaseException:
            with self._lock:
                if self._retain is None:
                    self._retain = keep
            raise

    def _requeue(self, batch, ckpts, skip) -> None:
        """Put a failed batch back at the front, keeping order; overflow drops the oldest."""
        with self._lock:
            tele = [b for b in batch if b[0] != self.keys.acks]
            ctrl = [b for b in batch if b[0] == self.keys.acks]
            self._telemetry.extendleft(reversed(tele))
            self._control.extendleft(reversed(ctrl))
            for q in (self._telemetry, self._control):
                while len(q) > self._queue_max:
                    q.popleft()
                    self.dropped += 1
            self._checkpoints = {**ckpts, **self._checkpoints}
            if self._skiplist is None:
                self._skiplist = skip
            self._inflight = 0

    def _iteration(self) -> None:
        r, k = self._r, self.keys
        if self._resolve_tail:
            last = r.xrevrange(k.directives, count=1)
            self._last_dir_id = last[0][0].decode() if last else "0-0"
            self._resolve_tail = False
        self._apply_retention(r)
        batch, ckpts, skip = self._take()
        try:
            cmds: list[tuple] = []
            for stream, data, maxlen, mac in batch:
                if mac is MAC_ON_SEND:
                    mac = self._mac(stream, data)
                trim = ("MAXLEN", "~", maxlen) if maxlen is not None else ()
                cmds.append(("XADD", stream, *trim, "*", FIELD, data) if mac is None else
                            ("XADD", stream, *trim, "*", FIELD, data, RECORD_MAC_FIELD, mac))
            if ckpts:
                cmds.append(("HSET", k.checkpoints, *(x for kv in ckpts.items() for x in kv)))
            if skip is not None:
                cmds.append(("SET", k.skiplist, skip))
            now = time.time()
            with self._lock:
                step, step_time, paused = self._step, self._step_time, self._paused
            # a new step refreshes the heartbeat at most every HB_STEP_GAP_S (not at every iteration: one SET
            # less per round trip); a forced refresh (flush: _hb_step None) goes out at once, and so does a
            # pause or resume: compared with the flag last written, not flagged by set_paused, which a round
            # trip in flight when it was called would clear (the ack then landed before the paused heartbeat)
            hb = step is not None and (self._hb_step is None or paused != self._hb_paused or now - self._hb_sent >= (
                min(HB_STEP_GAP_S, self._hb_every) if step != self._hb_step else self._hb_every))
            if hb:
                beat = {"step": step, "time": step_time, "sent": now, "pid": os.getpid(), "paused": paused}
                cmds.append(("SET", k.heartbeat, json.dumps(beat), "PX", self._hb_ttl_ms))
            with self._lock:
                info, info_sent = self._info, self._info_sent
                read_dirs = len(self._inbox) < INBOX_MAX
            registering = info is not None and (hb or not info_sent)
            if registering:
                cmds.append(("SADD", Keys.RUNS, self.run))
            if registering and not info_sent:
                cmds.append(("HSET", k.info, *(x for kv in info.items() for x in kv)))
            if read_dirs:
                cmds.append(("XREAD", "COUNT", 100, "STREAMS", k.directives, self._last_dir_id))
            if self._conn_of is not r:  # the I/O thread's own connection, kept (a restarted bus: a new one)
                self._conn, self._conn_of = r.connection_pool.get_connection(), r
            results = round_trip(r, self._conn, cmds)
        except BaseException:
            self._requeue(batch, ckpts, skip)
            raise
        self.connected = True  # before the records count as written: flush() returning True implies it
        with self._lock:
            self._inflight = 0
        failed = [(item, res) for item, res in zip(batch, results[: len(batch)]) if isinstance(res, Exception)]
        retry = self._repair_exhausted(r, failed)
        failed = [(item, res) for item, res in failed if item[0] not in retry]
        if retry:  # their stream is repaired: sent again, in order, at the next iteration
            self._requeue([item for item, res in zip(batch, results[: len(batch)])
                           if isinstance(res, Exception) and item[0] in retry], {}, None)
        if failed:
            # a record Redis refused (OOM, ACL, wrong type) will not succeed by retrying: count it
            with self._lock:
                self.dropped += len(failed)
            self._log_limited("refused", "control bus refused %d record(s): %s", len(failed), _short(failed[0][1]))
        for res in results[len(batch) : len(results) - read_dirs]:
            if isinstance(res, Exception):
                self._log_limited("state", "control bus refused a checkpoint/skip-list/heartbeat write: %s", _short(res))
        if hb:
            self._hb_sent, self._hb_step, self._hb_paused = now, step, paused
        if registering:
            self._registered(results[len(results) - read_dirs - (not info_sent) - 1], info, info_sent)
        if read_dirs:
            self._take_directives(r, results[-1])
        with self._lock:
            if self._control or len(self._telemetry) >= self._max_batch:
                # acks waiting, or a full batch of records: go again at once. Not for the record or two the
                # loop published while this round trip was in flight: they wait for the next poll interval
                # (going again for them made 3x the round trips of a fast loop, each with its fixed cost)
                self._wake.set()

    def _registered(self, added, info: dict[str, str], info_sent: bool) -> None:
        """The SADD's reply: 1 when the registry did not hold the run. After the first time that
        means the bus lost it: the metadata, checkpoints and skip list go out again."""
        if isinstance(added, Exception):
            self._log_limited("register", "could not register the run on the bus: %s", _short(added))
            return
        with self._lock:
            if not info_sent:
                self._info_sent = self._info is info
            elif added:
                self._info_sent = False
                self._checkpoints = {**self._ckpt_known, **self._checkpoints}
                if self._skiplist is None:
                    self._skiplist = self._skip_known
        if info_sent and added:
            self._log.warning("the bus had lost run %s from its registry (a Redis restart without its data?): "
                              "registered again, with its checkpoints and skip list", self.run)
            self._wake.set()




__all__ = ["BusClient", "BusError"]
