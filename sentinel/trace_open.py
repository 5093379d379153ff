"""Opening a trace file for the backtest: compressed (gzip, bz2, xz) or not, UTF-16/32 transcoded,
its format told from its first bytes (JSON lines, one JSON document, CSV, Hugging Face
``trainer_state.json``, a text log), and its lines read with bounds (a "line" of binary garbage
can be gigabytes; a 1 MiB gzip can hold a billion empty lines)."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

from sentinel.protocol import SchemaError, UnreadableFileError, open_regular
from sentinel.trace_csv import looks_like_csv
from sentinel.trace_hf import MAX_BYTES, trainer_state_history
from sentinel.trace_json import MAX_BYTES as JSON_MAX_BYTES
from sentinel.trace_json import json_document, table_rows
from sentinel.trace_names import LOSS_NAMES, STEP_NAMES
from sentinel.trace_text import looks_like_text_log


class TraceTooLong(SchemaError):
    """A trace of more lines (or blank lines in a row) than any run writes: a decompressed bomb."""


_COMPRESSED = ((b"\x1f\x8b", gzip.open, ".gz"), (b"BZh", bz2.open, ".bz2"), (b"\xfd7zXZ\x00", lzma.open, ".xz"))
_STREAM_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


def _open_trace(p: Path, opened: ExitStack):
    """(a binary file of ``p``'s bytes, decompressed when they are gzip, bzip2 or xz by their magic;
    the name to judge the format and run by, without the compression suffix). ``SchemaError`` (one
    line) for what cannot be opened, and for anything but a regular file: /dev/zero, /dev/urandom
    or a FIFO would be read forever. A trace may be large (hundreds of MB): its size is not capped,
    only its lines' (``_capped_lines``). What is opened is closed with ``opened``."""
    try:
        fh = opened.enter_context(open_regular(p))
    except UnreadableFileError as e:
        raise SchemaError(f"{p}: {e}; a trace is a log file, or a directory of them") from None
    except OSError as e:  # missing, a symlink loop, a name too long, no permission
        raise SchemaError(f"{p}: cannot read: {e.strerror or _one_line(e)}") from None
    try:
        head = fh.read(6)
        fh.seek(0)
    except OSError as e:
        raise SchemaError(f"{p}: cannot read: {e.strerror or _one_line(e)}") from None
    name = p
    for magic, opener, suffix in _COMPRESSED:
        if head.startswith(magic):
            fh, name = opened.enter_context(opener(fh, "rb")), (p.with_suffix("") if p.suffix.lower() == suffix else p)
            break
    return _as_utf8(p, fh), name


# UTF-32 first: its little-endian mark starts with UTF-16's
_WIDE_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"), (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))
MAX_WIDE_BYTES = 256 << 20  # a UTF-16/32 log is transcoded in memory: at most this much of it


def _as_utf8(p: Path, fh):
    """``fh``, or its text re-encoded as UTF-8 when it starts with a UTF-16 or UTF-32 byte-order
    mark (what Windows PowerShell's ``>`` writes): every reader splits lines on UTF-8 bytes, and
    would otherwise reject every line of such a file and judge nothing."""
    try:
        head = fh.read(4)
        fh.seek(0)
    except _STREAM_ERRORS:  # a broken compressed stream: its readers say so, as they always did
        with suppress(_STREAM_ERRORS):
            fh.seek(0)
        return fh
    enc = next((e for bom, e in _WIDE_BOMS if head.startswith(bom)), None)
    if enc is None:
        return fh
    raw = fh.read(MAX_WIDE_BYTES + 1)
    if len(raw) > MAX_WIDE_BYTES:
        raise SchemaError(f"{p}: a {enc.upper()} file over {MAX_WIDE_BYTES >> 20} MiB; convert it to UTF-8 "
                          f"(iconv -f {enc.upper()} -t UTF-8)")
    try:
        text = raw.decode(enc)
    except UnicodeDecodeError as e:
        raise SchemaError(f"{p}: starts as {enc.upper()} but is not: {e.reason} at byte {e.start}") from None
    return io.BytesIO(text.encode("utf-8"))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def _trace_format(p: Path, fh, fmt: str) -> tuple[str, Any]:
    """The format to read ``fh`` as ("jsonl", "json", "csv", "hf" or "text"), and a trainer state's
    log history or a history document's rows; ``fh`` is left at its start."""
    history: Any = None
    suffix = p.suffix.lower()
    if fmt == "hf" or (fmt == "auto" and suffix == ".json" and b'"log_history"' in fh.read(65536)):
        fh.seek(0)  # the key comes within the first lines of a trainer state: only then is the whole file read
        history = trainer_state_history(fh.read(MAX_BYTES + 1))
        if history is None and fmt == "hf":
            raise SchemaError(f"{p}: not a trainer_state.json (one JSON object with a log_history list)")
        if history is not None:
            fmt = "hf"
    fh.seek(0)
    if fmt == "json" or (fmt == "auto" and history is None and _may_be_document(p, fh)):
        fh.seek(0)  # one JSON list, or a .json file that is one object: only then is the whole file read
        doc = json_document(fh.read(JSON_MAX_BYTES + 1))
        rows = table_rows(doc, str(p)) if doc is not None else None
        if rows is None and fmt == "json":
            raise SchemaError(f"{p}: not a history document (one JSON list of step objects, or a table as "
                              f"pandas to_json writes one, with a step and a loss column)")
        if rows is not None:
            fmt, history = "json", rows
    fh.seek(0)
    if fmt == "auto":
        if suffix in (".csv", ".tsv"):
            fmt = "csv"
        elif suffix in (".jsonl", ".json", ".ndjson"):
            fmt = "jsonl"  # a hostile first line must not turn a JSON-lines file into a CSV one
        else:
            first = _first_line(fh)
            fh.seek(0)
            if first.lstrip(b"\xef\xbb\xbf \t").startswith(b"{") or _mostly_json_objects(fh):
                fmt = "jsonl"
            elif looks_like_csv(first) and not looks_like_text_log(first):  # "iter 1: loss 4.2, time 9ms" has commas too
                fmt = "csv"
            else:
                # a job's stdout (.log, .out; the banner, config or code some trainers print come first),
                # or a file of another name whose first line is no JSON object and no CSV header
                fmt = "text"
    return fmt, history


MAX_LINE_BYTES = 16 << 20  # a step line is ~1 KB; a "line" of binary garbage (no newline) can be gigabytes
MAX_TRACE_LINES = 20_000_000  # lines of one trace: 20M steps; a 1 MiB gzip can hold a billion empty ones
MAX_BLANK_RUN = 1_000_000  # blank lines in a row


def _capped_lines(fh, limit: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """The lines of a binary file, as iterating it gives them, but never more than ``limit + 1``
    bytes of one: a file without newlines (zeros, random bytes, a decompressed bomb) would
    otherwise be held whole in memory as one line. The rest of an over-long line is read past in
    1 MiB pieces; what is yielded for it (``limit + 1`` bytes) is rejected by every reader
    (``_overlong``)."""
    n = blank = 0
    while True:
        line = fh.readline(limit + 1)
        if not line:
            return
        n += 1
        blank = blank + 1 if not line.strip() else 0
        if n > MAX_TRACE_LINES or blank > MAX_BLANK_RUN:  # a decompressed bomb: gigabytes of newlines
            raise TraceTooLong(f"more than {MAX_BLANK_RUN:,} blank lines in a row: not a step log" if blank > MAX_BLANK_RUN
                               else f"more than {MAX_TRACE_LINES:,} lines: split the log (no run logs that many steps)")
        if len(line) > limit and not line.endswith(b"\n"):
            while True:
                rest = fh.readline(1 << 20)
                if not rest or rest.endswith(b"\n"):
                    break
        yield line


def _overlong(line: bytes) -> bool:
    return len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES


def _json_entries(fh, path: str) -> Iterator[tuple[str, bytes | str]]:
    """(where, line) for each non-blank line of a JSON-lines file; (where, the reason) for a line
    too long to be a step line."""
    for n, raw in enumerate(_capped_lines(fh), 1):
        if len(raw) > MAX_LINE_BYTES and _overlong(raw):
            yield f"{path}:{n}", f"{path}:{n}: a line of more than {MAX_LINE_BYTES:,} bytes, too long for a step line"
            continue
        line = raw.strip()
        if line:
            yield f"{path}:{n}", line


def json_file_is_trace(path: str | Path) -> bool:
    """Does a ``.json`` file (a directory's member, compressed or not) hold a run's steps: a step
    or trainer-state key (``log_history``) and a loss key, by name, within its first MiB? A
    directory of curves keeps its index (``INDEX.json``: files and step counts, no loss) and configs
    beside them; those are no traces and must not be judged as failed ones."""
    try:
        with ExitStack() as opened:
            fh, _ = _open_trace(Path(path), opened)
            head = fh.read(1 << 20).lower()
    except (SchemaError, *_STREAM_ERRORS):
        return False
    if b'"log_history"' in head:
        return True
    return (any(b'"%s"' % n.encode() in head for n in STEP_NAMES)
            and any(b'"%s"' % n.encode() in head for n in LOSS_NAMES))


def _may_be_document(p: Path, fh) -> bool:
    """Could ``fh`` be one JSON document of a run's history: its first byte opens a list (whatever
    its name), or one object in a ``.json`` file (JSON lines named .json are read as such when the
    whole is no single document)? ``fh`` is read from where it stands."""
    head = _first_line(fh).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head[:1] == b"[":  # a list of objects (or of lists), not a log line's "[rank0]:" or "[step=100/...]"
        return head[1:].lstrip(b" \t\r\n")[:1] in (b"{", b"[", b"]", b"")
    return head[:1] == b"{" and p.suffix.lower() == ".json"


SNIFF_LINES = 32  # non-blank lines read to tell JSON lines behind a banner from a text log


def _mostly_json_objects(fh) -> bool:
    """Are most of the first ``SNIFF_LINES`` non-blank lines JSON objects (JSON lines under a
    banner, a comment or a shell prompt: ``train.log`` of a script that prints one first)? A text
    log that prints its config as one JSON line still reads as text. ``fh`` is left at its start."""
    objects = lines = 0
    for raw in _capped_lines(fh):
        line = raw.strip().lstrip(b"\xef\xbb\xbf")
        if not line:
            continue
        lines += 1
        if line[:1] == b"{" and len(line) <= 65536:
            with suppress(ValueError, RecursionError):
                objects += isinstance(json.loads(line), dict)
        if lines >= SNIFF_LINES:
            break
    fh.seek(0)
    return objects >= 2 and 2 * objects > lines


def _first_line(fh) -> bytes:
    """The first non-blank line of a binary file (at most 64 KiB of it)."""
    for raw in _capped_lines(fh):
        if raw.strip():
            return raw[:65536]
    return b""
