"""``RUN_DIR/steps.jsonl``: one JSON object per optimizer step, append-only.

Floats are written with the shortest repr that round-trips exactly (NaN/Infinity as JSON
constants). After a resume or rollback the re-run steps are appended again behind a
TimelineRecord; the last record for a step number is the authoritative one
(``sentinel.protocol.authoritative_steps``).

At open, a log whose last line lacks its newline (a crash mid-write) is repaired without losing a
byte: a whole record keeps its line (the newline is appended), a torn write is moved to
``steps.jsonl.torn-<unix time>`` beside the log. A log no reader can parse is refused, untouched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from sentinel.contract.fsio import fsync_dir
from sentinel.protocol import (
    MAX_RECORD_BYTES,
    SchemaError,
    StepRecord,
    TimelineRecord,
    authoritative_steps,
    parse_step_line,
)

# Records held in memory while the disk refuses writes (ENOSPC, EFBIG, EDQUOT, EIO). A record is
# 1-5 KB, so the buffer is at most a few tens of MB; past it the oldest records are dropped and counted.
MAX_BUFFERED = 10_000
RECENT_STEPS = 256  # steps whose sample ids are kept in memory for a rollback's skip_after

# The most a last line without a newline may hold and still be handled at start (kept, or moved to a
# side file): a torn write is a prefix of one record (<= MAX_RECORD_BYTES), or a few blocks of zeros a
# crash left past the end. Anything longer is no torn write, and the start is refused.
TAIL_LIMIT = 16 << 20
_LINE_CAP = MAX_RECORD_BYTES + 1  # bytes of one line held in memory; a longer line is never a record



def write_and_publish(rec, steplog: StepLog | None, bus, *, flush: bool = True) -> None:
    """``rec`` to ``steps.jsonl`` and onto the bus (a ``BusClient``, or None), rendered to JSON once;
    ``flush=False``: the step log keeps the line for its next flush (a batch)."""
    text = render(rec)
    if steplog is not None:
        steplog.write(rec, text, flush=flush)
    if bus is not None:
        bus.publish_step(rec, text)  # on the bus within the client's poll interval (0.1 s), batched

class StepLogError(SchemaError):
    """A steps.jsonl the trainer cannot continue (a line no reader can parse); its one-line message
    names the file and the 1-based line. Raised before anything in the file is changed."""


def _lines(f):
    """``(line number, offset, bytes, complete)`` for every line of the binary file ``f`` from its
    current position, in bounded memory: a line over ``_LINE_CAP`` bytes is returned cut to its first
    ``_LINE_CAP`` bytes (so parsing it fails as too large). ``complete``: it ends in a newline."""
    n, pos = 0, f.tell()
    while True:
        line = f.readline(_LINE_CAP)
        if not line:
            return
        n += 1
        start = pos
        pos += len(line)
        if line.endswith(b"\n") or len(line) < _LINE_CAP:
            yield n, start, line, line.endswith(b"\n")
            continue
        while True:  # an overlong line: skip to its end
            more = f.readline(1 << 20)
            pos += len(more)
            if not more or more.endswith(b"\n"):
                break
        yield n, start, line, bool(more)


def _reason(e: SchemaError) -> str:
    msg = str(e)
    for prefix in ("steps.jsonl line: ", "steps.jsonl: "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg


def _parse_at(path: Path, n: int, line: bytes):
    """One line of ``path`` (line ``n``, 1-based) as a record; a StepLogError naming both if it is none."""
    try:
        return parse_step_line(line)
    except SchemaError as e:
        raise StepLogError(f"{path}: line {n}: {_reason(e)}", e.reason) from None


def _fsync_dir(d: Path) -> None:
    """Best effort: a directory that cannot be fsynced (gone, a filesystem without it) is no error here."""
    with contextlib.suppress(OSError):
        fsync_dir(d)


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


def render(rec: StepRecord | TimelineRecord) -> str:
    """The record's JSON text (one line). A string field that UTF-8 cannot encode (lone surrogates) is
    escaped rather than failing the write: the step log must never be what stops a run. The step log
    and the bus take the same text (``StepLog.write(rec, text)``, ``BusClient.publish_step(rec, text)``)."""
    try:
        return rec.to_json()
    except ValueError:  # PydanticSerializationError: "surrogates not allowed"
        return rec.model_copy(update=_clean_all(rec.model_dump())).to_json()


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
        self.log = log
        self._repair_torn_tail()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size  # end of the last whole record
        self._pending: deque[bytes] = deque()
        self._recent: deque[tuple[int, int, list[int]]] = deque(maxlen=RECENT_STEPS)  # (timeline, step, sample ids)
        self.max_buffered = max_buffered
        self.write_failures = 0  # write attempts the disk refused
        self.lost = 0  # records dropped because the buffer overflowed
        self.last_error: str | None = None
        self._failing_since: int | None = None  # write_failures when the current outage began

    def _repair_torn_tail(self) -> None:
        """Make the log end in a newline, so the next record starts a line of its own, losing nothing.

        A last line without its newline is either a whole record (kept: the newline is appended) or a
        torn write, the prefix of a record a crash cut short (its bytes are moved to a side file
        ``steps.jsonl.torn-<unix time>`` and the log cut back to its last whole line: appending behind
        it would glue two records into one unreadable line). Either way every whole line is checked
        first, with the reader's parser: a log that cannot be read (a line that is not UTF-8, not JSON,
        not a record) is a StepLogError naming the line, and the file is left exactly as it was.
        A log that already ends in a newline is not read here at all."""
        p = self.path
        if not p.is_file():
            return
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            cut = tail_no = None
            for n, start, line, complete in _lines(f):
                if not complete:
                    cut, tail_no = start, n
                    break
                if line.strip():
                    _parse_at(p, n, line)
            if cut is None:  # the file changed under us (it cannot, with the run dir locked): touch nothing
                return
            if size - cut > TAIL_LIMIT:
                raise StepLogError(f"{p}: line {tail_no}: the last line has no newline and holds {size - cut} bytes, "
                                   f"more than a torn record could ({TAIL_LIMIT}); left unchanged: repair it or move "
                                   "the file aside", "too_large")
            f.seek(cut)
            tail = f.read(size - cut)
        try:  # exactly the line the reader will see once the newline is there
            whole = bool(tail.strip()) and parse_step_line(tail + b"\n") is not None
        except SchemaError:
            whole = False
        if whole:
            fd = os.open(p, os.O_WRONLY | os.O_APPEND)
            try:
                if os.write(fd, b"\n") != 1:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(p))
                os.fsync(fd)
            finally:
                os.close(fd)
            self.log(f"note: {p}: line {tail_no}, the last, is a whole record without its newline; kept, "
                     "newline appended")
            return
        side = self._side_file(tail)
        fd = os.open(p, os.O_WRONLY)
        try:
            os.ftruncate(fd, cut)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.log(f"warning: {p}: line {tail_no}, the last, is a torn write ({len(tail)} bytes, no newline); "
                 f"moved to {side} and the log cut back to its last whole line")

    def _side_file(self, data: bytes) -> Path:
        """Write ``data`` durably to a new ``steps.jsonl.torn-<unix time>[-k]`` beside the log."""
        base = f"{self.path.name}.torn-{int(time.time())}"
        for k in range(1000):
            side = self.path.with_name(base if k == 0 else f"{base}-{k}")
            try:
                fd = os.open(side, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                continue
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                os.close(fd)
                try:
                    side.unlink()
                except OSError:
                    pass
                raise
            os.close(fd)
            _fsync_dir(self.path.parent)
            return side
        raise OSError(errno.EEXIST, "no free name for the torn tail's side file", str(self.path.with_name(base)))

    @property
    def buffered(self) -> int:
        return len(self._pending)

    def write(self, rec: StepRecord | TimelineRecord, text: str | None = None, *, flush: bool = True) -> None:
        """Append ``rec`` (``text``: its ``render``, when the caller has it already); ``flush=False``: leave
        it buffered for the next :meth:`flush` (a batch of records, one write)."""
        if isinstance(rec, StepRecord) and rec.sample_ids:  # what a rollback's skip_after names (recent_ids)
            self._recent.append((rec.timeline, rec.step, rec.sample_ids))
        self._pending.append(((render(rec) if text is None else text) + "\n").encode())
        if len(self._pending) > self.max_buffered:
            self._pending.popleft()
            self.lost += 1
        if flush:
            self.flush()

    def recent_ids(self, timeline: int, after_step: int) -> list[int]:
        """The sample ids of the steps after ``after_step`` on ``timeline`` written lately (the last
        ``RECENT_STEPS`` steps; the last record of a step wins)."""
        by_step = {step: ids for t, step, ids in self._recent if t == timeline and step > after_step}
        return [i for step in sorted(by_step) for i in by_step[step]]

    def flush(self) -> bool:
        """Write every buffered record; False (and the records kept) while the disk refuses."""
        # a batch (RunSession writes a fast loop's records in batches): one write. While the disk refuses,
        # one line at a time, so that as much lands as the disk takes
        if len(self._pending) > 1 and self._failing_since is None and self._write(b"".join(self._pending)):
            self._pending.clear()
        while self._pending:
            if not self._write(self._pending[0]):
                return False
            self._pending.popleft()
        if self._failing_since is not None:
            self.log(f"warning: steps.jsonl writable again after {self.write_failures - self._failing_since} failed "
                     f"write(s); {self.lost} record(s) lost in all")
            self._failing_since = None
        return True

    def _write(self, blob: bytes) -> bool:
        """One write of whole records; on failure the file is cut back to its last whole record."""
        try:
            n = os.write(self._fd, blob)
            if n != len(blob):  # a short write: the disk filled up inside a record
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as e:
            self._failed(e)
            return False
        self._size += n
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

    # bytes read from the end of the log for its newest timeline: hundreds of records
    TAIL_BYTES = 1 << 20

    def _tail_records(self) -> list:
        """The readable records in the log's last ``TAIL_BYTES`` (a line that is none is left out)."""
        p = self.path
        if not p.is_file():
            return []
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = max(0, size - self.TAIL_BYTES)
            f.seek(start)
            lines = f.read(size - start).split(b"\n")
        if start:
            lines = lines[1:]  # the first is the end of a line that began before the tail
        out = []
        for line in lines:
            if line.strip():
                with contextlib.suppress(SchemaError):
                    out.append(parse_step_line(line + b"\n"))
        return out

    def last_step(self) -> int:
        """The largest step number of the step records in the log's last MiB (-1: none there)."""
        return max((r.step for r in self._tail_records() if isinstance(r, StepRecord)), default=-1)

    def last_timeline(self) -> int:
        """The newest timeline in the log (-1: none), the one a resume numbers its own after. The
        trainer only ever writes a timeline after the ones before it, so it is the largest timeline
        of the records at the log's end: read from there. Reading (and checking) every line instead
        took every start of a long run 10 s per 300,000 records, with every rank waiting; a line
        that cannot be read in the middle of the log is now left to the log's readers, which skip
        and count it. Only a tail that holds no readable record is read from the start."""
        tail = self._tail_records()
        if tail:
            return max(r.timeline for r in tail)
        if not self.path.is_file():
            return -1
        return max((r.timeline for r in read(self.path)), default=-1)

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


def read(path: Path, rejected: list[str] | None = None):
    """Yield every record of a steps.jsonl (skipping a torn final line). A line that is no record is a
    StepLogError (a SchemaError) naming the file and the line; with ``rejected`` (a list) its
    message goes there and the read goes on."""
    p = Path(path)
    if not p.is_file():
        return
    with open(p, "rb") as f:
        for n, _, line, complete in _lines(f):
            if not complete:
                break  # torn tail from a crash
            if not line.strip():
                continue
            try:
                yield _parse_at(p, n, line)
            except StepLogError as e:
                if rejected is None:
                    raise
                rejected.append(str(e))


def authoritative(path: Path) -> dict[int, StepRecord]:
    return authoritative_steps(read(path))


class LogScan:
    """What one streamed pass over a steps.jsonl leaves (``scan``): the authoritative records of the
    steps asked for, and the few facts about the rest that the offline tools need. A long run's log
    is millions of records; held whole as ``authoritative`` holds it, it was gigabytes."""

    def __init__(self) -> None:
        self.records: dict[int, StepRecord] = {}  # authoritative, only the kept steps
        self.first: int | None = None  # the first and last authoritative step of the whole log
        self.last: int | None = None
        self.last_record: StepRecord | None = None  # the last step record read (world size, run id)
        self.applied_upto: int | None = None
        self._present = bytearray()  # steps 1..applied_upto: authoritative record present / skipped
        self._skipped = bytearray()

    def applied(self) -> int | None:
        """Authoritative steps 1..applied_upto whose update was applied (not skipped by the guard);
        None when one of those steps has no authoritative record (or ``scan`` was not asked)."""
        if self.applied_upto is None:
            return None
        if not all(self._present[1:]):
            return None
        return self.applied_upto - sum(self._skipped[1:])


def scan(path: Path, keep: Callable[[int], bool] = lambda step: True, applied_upto: int | None = None,
         rejected: list[str] | None = None) -> LogScan:
    """One pass over a steps.jsonl in bounded memory: ``LogScan.records`` holds the authoritative
    record of each step ``keep`` says yes to (exactly what ``authoritative`` would give for those
    steps), plus the whole log's first and last authoritative step, its last step record, and
    (``applied_upto``) how many of steps 1..applied_upto were applied. Errors (and ``rejected``)
    as ``read``."""
    out = LogScan()
    n = max(0, applied_upto) if applied_upto is not None else 0
    if applied_upto is not None:
        out.applied_upto = n
        out._present, out._skipped = bytearray(n + 1), bytearray(n + 1)
    recs = out.records
    for r in read(path, rejected):
        if isinstance(r, StepRecord):
            if keep(r.step):
                recs[r.step] = r
            if out.first is None:
                out.first = r.step
            out.last, out.last_record = r.step, r
            if 0 < r.step <= n:
                out._present[r.step], out._skipped[r.step] = 1, 1 if r.skipped else 0
        elif isinstance(r, TimelineRecord):
            s = r.from_step  # a rollback/resume invalidates every record after the restored step
            for k in [k for k in recs if k > s]:
                del recs[k]
            if s < n:
                out._present[s + 1:] = bytes(n - s)
            if out.last is not None and out.last > s:
                out.last = s if out.first is not None and out.first <= s else None
            if out.first is not None and out.first > s:
                out.first = None
    if out.last is None:
        out.first = None
    return out
