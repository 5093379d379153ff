"""The bus client's directive intake: read, decode, verify, refuse, repair, and remember the position.

Hostile input: the directives stream is read with a ``bytes`` client and decoded entry by entry, so no
entry (not UTF-8, no ``json`` field, 100,000-deep JSON, ``v`` a string) can fail the pipeline, stall the
reader or crash the trainer: each is rejected, counted by reason (``rejected_by_reason``), acked
``rejected`` and, with ``cursor_file``, never read again after a restart. ``BusClient`` mixes this in;
the state it reads (``_inbox``, ``_lock``, the counters) is the client's.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import redis

from sentinel.bus import FIELD, BusError, id_exhausted, is_future_id, repair_stream_ids
from sentinel.protocol import Ack, Directive, Event, SchemaError, atomic_write_text, read_regular_file

_STREAM_ID = re.compile(r"^\d{1,20}-\d{1,20}$")
INBOX_MAX = 10_000  # directive entries read and not yet handed to the training loop
REJECT_ACK_BURST = 20.0  # rejections acked at once; then one a second (every one is counted)
_BAD_DETAIL = {"not_utf8": "not UTF-8", "future_id": "an entry id stamped more than a day ahead (removed from the stream)"}


def _id_tuple(eid: str) -> tuple[int, int]:
    a, _, b = eid.partition("-")
    return int(a), int(b or 0)


def read_cursor(path: str | os.PathLike | None) -> str | None:
    """The directives-stream id saved in ``path``, or None (missing, unreadable or not an id)."""
    if path is None:
        return None
    try:  # a regular file of at most 1 KiB: a FIFO there would block the trainer's start forever
        text = read_regular_file(path, 1024).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    # a position stamped far ahead would skip every directive written after it
    return text if _STREAM_ID.match(text) and not is_future_id(text) else None


def _directive_text(fields: dict | None) -> tuple[str | None, str | None]:
    """(json text, None) for a decodable entry; (None, "not_utf8") when a name or value is not UTF-8."""
    try:
        decoded = {k.decode(): v.decode() for k, v in (fields or {}).items()}
    except (UnicodeDecodeError, AttributeError):
        return None, "not_utf8"
    return decoded.get(FIELD), None


def _short(e: BaseException) -> str:
    return " ".join(f"{e.__class__.__name__}: {e}".split())[:300]


class DirectiveIntake:
    """The directive side of ``BusClient`` (a mixin: ``BusClient`` holds the state)."""

    def has_news(self, rejected_seen: int | None = None) -> bool:
        """Whether :meth:`poll_directives` has anything to do (or, with ``rejected_seen``, whether the rejected
        count moved past it): a check the loop can afford at every step."""
        return bool(self._inbox) or self._handed_upto is not None or (
            rejected_seen is not None and self.rejected != rejected_seen)

    def poll_directives(self) -> list[Directive]:
        """Verified directives received since the last call, in stream order.

        Forged, unsigned, expired, malformed or other-run directives are not returned: each is
        counted in ``rejected`` and ``rejected_by_reason``, logged in one line, and acked with
        ``status="rejected"``. Never raises on stream content.

        The caller handles what it got before it polls again: that is when the stream position
        covering them is persisted (``cursor_file``).
        """
        if not self.has_news():  # the common case, at every step: nothing arrived
            return []
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        done = self._handed_upto  # everything handed out last time has been handled by now
        out: list[Directive] = []
        for entry_id, data, bad in items:
            d, reason, code = self._check(data, bad)
            if reason is None:
                out.append(d)
            else:
                self._reject(entry_id, d, reason, code)
                if not out and not is_future_id(entry_id):  # nothing before it is still in the caller's hands
                    done = entry_id
        self._handed_upto = items[-1][0] if out else None
        if done is not None:
            self._save_cursor(done)
        return out

    def _check(self, data: str | None, bad: str | None) -> tuple[Directive | None, str | None, str]:
        """(directive, None, "") when authentic and ours, else (directive or None, detail, reason)."""
        if bad:
            return None, _BAD_DETAIL.get(bad, bad), bad
        if data is None:
            return None, f"malformed (no '{FIELD}' field)", "malformed"
        try:
            d = Directive.from_json(data)
            why = d.verify(self._secret)
        except SchemaError as e:
            return None, f"malformed ({e})"[:300], e.reason
        except Exception as e:  # noqa: BLE001 - hostile input must never reach the training loop
            return None, f"malformed ({e.__class__.__name__})", "malformed"
        if why is not None:
            return d, why, why.replace(" ", "_")
        if d.run != self.run:
            return d, f"addressed to run {d.run[:64]!r}", "wrong_run"
        return d, None, ""

    def _save_cursor(self, eid: str) -> None:
        if self._cursor_file is None or (self._cursor and _id_tuple(eid) <= _id_tuple(self._cursor)):
            return
        try:
            atomic_write_text(self._cursor_file, eid + "\n")
            self._cursor = eid
        except OSError as e:  # a full disk must not stop training: we re-read (and dedupe) after a restart
            self._log_limited("cursor", "could not save the directive stream position to %s: %s", self._cursor_file, _short(e))

    def _reject(self, entry_id: str, d: Directive | None, reason: str, code: str = "malformed") -> None:
        with self._lock:  # the I/O thread counts too (_repair)
            self.rejected += 1
            self.rejected_by_reason[code] += 1
        did = d.id[:64] if d is not None else f"stream:{entry_id}"
        kind: Any = d.kind if d is not None else "unknown"
        # a flood of junk must not flood the log: one line per reason every 30 s, all of them counted
        now = time.monotonic()
        if now - self._last_logged.get(f"reject:{code}", -1e9) >= 30.0:
            self._last_logged[f"reject:{code}"] = now
            self._log.warning("rejected directive %s (%s) for run %s: %s (%d rejected so far)", did, kind, self.run,
                              reason, self.rejected)
        # the ack tells whoever sent it (an operator with the wrong secret waits for it), but a flood
        # must not turn into a flood of acks and events: at most REJECT_ACK_BURST, then 1 a second
        self._reject_tokens = min(REJECT_ACK_BURST, self._reject_tokens + (now - self._reject_refill))
        self._reject_refill = now
        if self._reject_tokens < 1.0:
            return
        self._reject_tokens -= 1.0
        step = self._step or 0
        self.ack(Ack(run=self.run, directive_id=did, kind=kind, status="rejected", step=step, timeline=self._timeline, detail=reason,
                     entry_id=entry_id))
        self.publish_event(
            Event(
                run=self.run,
                kind="directive_rejected",
                severity="warning",
                step=step,
                message=f"rejected directive {did} ({kind}): {reason}",
                data={"directive_id": did, "stream_id": entry_id, "reason": reason},
            )
        )

    def _take_directives(self, r: redis.Redis, reply) -> None:
        if isinstance(reply, Exception):
            if "WRONGTYPE" in str(reply) and not self._dir_wrong_type:
                # counted once while it lasts; the sentinel and the CLI replace the key at their next directive
                self._dir_wrong_type = True
                with self._lock:
                    self.rejected += 1
                    self.rejected_by_reason["wrong_type"] += 1
            self._log_limited("xread", "reading directives failed: %s", _short(reply))
            return
        self._dir_wrong_type = False
        entries = [(eid.decode(), fields) for _stream, items in (reply or []) for eid, fields in items]
        future = [eid for eid, _ in entries if is_future_id(eid)]
        if future:
            # refused and removed, and never the read position: nothing written after it would be read
            entries = [(eid, f) for eid, f in entries if not is_future_id(eid)]
            with self._lock:
                self._inbox.extend((eid, None, "future_id") for eid in future if eid not in self._future_seen)
                if len(self._future_seen) > 10_000:
                    self._future_seen.clear()
                self._future_seen.update(future)
            self._repair(r, self.keys.directives)
        if entries:
            with self._lock:
                for eid, fields in entries:
                    self._inbox.append((eid, *_directive_text(fields)))
            self._last_dir_id = entries[-1][0]
            if len(entries) == 100:
                self._wake.set()  # more may be waiting

    def _repair_exhausted(self, r: redis.Redis, failed) -> set[str]:
        """The streams among ``failed`` XADDs that refused because an entry stamped far ahead is in
        them (anyone with bus access can add ``18446744073709551615-18446744073709551615``, and then
        no writer can add to the stream again): repaired, returned for a retry. A stream repaired
        in the last 10 s is not again: what it refuses then is dropped and counted."""
        out: set[str] = set()
        for item, res in failed:
            if item[0] not in out and id_exhausted(res) and self._repair(r, item[0]):
                out.add(item[0])
        return out

    def _repair(self, r: redis.Redis, stream: str) -> bool:
        now = time.monotonic()
        if now - self._repaired_at.get(stream, -1e9) < 10.0:
            return False
        self._repaired_at[stream] = now
        try:
            n = repair_stream_ids(r, stream)
        except BusError as e:
            self._log_limited("repair", "could not remove entries stamped far ahead from %s: %s", stream, _short(e))
            return False
        if n > 0:
            with self._lock:
                self.rejected += n
                self.rejected_by_reason["future_id"] += n
            self._log_limited("repair", "removed %d entries stamped more than a day ahead from %s (%d rejected so far)",
                              n, stream, self.rejected)
        return True
