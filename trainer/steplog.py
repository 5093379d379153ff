"""``RUN_DIR/steps.jsonl``: one JSON object per optimizer step, append-only.

Floats are written with the shortest repr that round-trips exactly (NaN/Infinity as JSON
constants). After a resume or rollback the re-run steps are appended again behind a
TimelineRecord; the last record for a step number is the authoritative one
(``sentinel.protocol.authoritative_steps``).
"""

from __future__ import annotations

import errno
import os
from collections import deque
from pathlib import Path
from typing import Callable

from sentinel.protocol import StepRecord, TimelineRecord, authoritative_steps, parse_step_line

# Records held in memory while the disk refuses writes (ENOSPC, EFBIG, EDQUOT, EIO). A record is
# 1-5 KB, so the buffer is at most a few tens of MB; past it the oldest records are dropped and counted.
MAX_BUFFERED = 10_000


def clean_text(value):
    """``value`` as text that UTF-8 (and so JSON, Redis, Prometheus) can carry; None stays None.

    Free-form strings reach the records from files and the bus (a rollback reason, a directive id,
    a run dir's name), and one read from a non-UTF-8 source holds lone surrogates (``"\\udcff"``
    from JSON, ``os.fsdecode`` of a byte name): serialising that raises, and a record the trainer
    cannot write would stop every later start. Such characters become visible ``\\udcff`` escapes;
    a non-string (a number where a reason was expected) becomes its text."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _clean_all(obj):
    """``obj`` (a record's ``model_dump``) with every string passed through ``clean_text``."""
    if isinstance(obj, str):
        return clean_text(obj)
    if isinstance(obj, dict):
        return {clean_text(k) if isinstance(k, str) else k: _clean_all(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clean_all(v) for v in obj)
    return obj


def _record_line(rec: StepRecord | TimelineRecord) -> bytes:
    """The record as one JSONL line. A string field that UTF-8 cannot encode (lone surrogates) is
    escaped rather than failing the write: the step log must never be what stops a run."""
    try:
        text = rec.to_json()
    except ValueError:  # PydanticSerializationError: "surrogates not allowed"
        text = rec.model_copy(update=_clean_all(rec.model_dump())).to_json()
    return (text + "\n").encode()


class StepLog:
    """Append-only writer that survives a full disk: a failed write is cut back to the last whole
    record (so the file stays valid JSONL), the record is kept in a bounded buffer and retried on the
    next write; nothing is lost unless the buffer overflows, and then the loss is counted."""

    def __init__(self, path: Path, *, max_buffered: int = MAX_BUFFERED, log: Callable[[str], None] = print):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and not self.path.is_file():
            # a FIFO would block the open below forever, /dev/null or /dev/zero would swallow every record
            raise OSError(errno.EINVAL, "not a regular file (the step log must be one)", str(self.path))
        self._repair_torn_tail()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size  # end of the last whole record
        self._pending: deque[bytes] = deque()
        self.max_buffered = max_buffered
        self.log = log
        self.write_failures = 0  # write attempts the disk refused
        self.lost = 0  # records dropped because the buffer overflowed
        self.last_error: str | None = None
        self._failing_since: int | None = None  # write_failures when the current outage began

    def _repair_torn_tail(self) -> None:
        """A SIGKILL mid-write can leave a partial last line: cut it so the log stays valid JSONL."""
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
            cut = data.rfind(b"\n") + 1
            f.truncate(cut)

    @property
    def buffered(self) -> int:
        return len(self._pending)

    def write(self, rec: StepRecord | TimelineRecord) -> None:
        self._pending.append(_record_line(rec))
        if len(self._pending) > self.max_buffered:
            self._pending.popleft()
            self.lost += 1
        self.flush()

    def flush(self) -> bool:
        """Write every buffered record; False (and the records kept) while the disk refuses."""
        while self._pending:
            line = self._pending[0]
            try:
                n = os.write(self._fd, line)
                if n != len(line):  # a short write: the disk filled up inside this record
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as e:
                self._failed(e)
                return False
            self._size += n
            self._pending.popleft()
        if self._failing_since is not None:
            self.log(f"warning: steps.jsonl writable again after {self.write_failures - self._failing_since} failed "
                     f"write(s); {self.lost} record(s) lost in all")
            self._failing_since = None
        return True

    def _failed(self, e: OSError) -> None:
        with_tail = os.fstat(self._fd).st_size if self._fd >= 0 else self._size
        if with_tail > self._size:  # cut the partial record; truncating never needs free space
            try:
                os.ftruncate(self._fd, self._size)
            except OSError:
                pass
        self.write_failures += 1
        self.last_error = e.strerror or str(e)
        if self._failing_since is None:
            self._failing_since = self.write_failures - 1
            self.log(f"warning: cannot write steps.jsonl ({self.last_error}); holding up to "
                     f"{self.max_buffered} records in memory and retrying at every step")

    def last_timeline(self) -> int:
        last = -1
        for r in read(self.path):
            last = max(last, r.timeline)
        return last

    def close(self) -> int:
        """Flush what can be flushed and close; returns the records lost (overflowed or never written)."""
        if self._fd < 0:
            return self.lost
        self.flush()
        self.lost += len(self._pending)
        self._pending.clear()
        os.close(self._fd)
        self._fd = -1
        return self.lost


def read(path: Path):
    """Yield every record of a steps.jsonl (skipping a torn final line)."""
    p = Path(path)
    if not p.is_file():
        return
    with open(p, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn tail from a crash
            if line.strip():
                yield parse_step_line(line)


def authoritative(path: Path) -> dict[int, StepRecord]:
    return authoritative_steps(read(path))
