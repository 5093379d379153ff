"""TensorBoard event files (``events.out.tfevents.*``) read as trace lines, without TensorBoard.

A PyTorch run that logs with ``torch.utils.tensorboard`` leaves event files, not CSVs. This reads
their scalars directly, so ``sentinel backtest runs/tb/`` judges a run as logged:

- **Framing** (TFRecord): ``[uint64 length][uint32 masked CRC-32C of the length][data][uint32
  masked CRC-32C of the data]``. Both checksums are checked (in pure Python, ~9 MB/s). A length
  that fails its checksum, or a file cut short, ends that file's read there: what was read stays,
  and the damage is counted as one rejected entry. An event whose data fails its checksum is
  rejected and counted, and the read goes on (its frame's length was sound).
- **Events**: ``Event.wall_time`` (the clock), ``Event.step`` and ``Event.summary``, whose values
  carry a ``tag`` and a scalar, as ``simple_value`` (``add_scalar``) or as a one-element float or
  double tensor (TensorFlow 2's summaries). Images, histograms, graphs and text are skipped unread.
- **Tags**: the training loss is the first tag among ``trace_names.LOSS_NAMES`` (case-insensitive;
  also ``loss/train`` and ``Loss/train``, TensorBoard's own convention) unless ``--loss-column``
  names one; the grad norm, the first among ``GRAD_NAMES`` (``add_scalar`` writes one event per
  tag: it is matched to the loss by step). Each loss event is one step line, in file order (a
  resumed run's steps going back read as a restart, as in any log).
- **Several files**: a directory is read as all its event files (not its subdirectories: those are
  other runs), in the order of the time TensorBoard wrote into their names.

Bounds: a frame over ``MAX_FRAME`` bytes is skipped unread (a large image); only the values of the
tags that can be the loss or the grad norm are kept, at most ``MAX_SCALARS`` of them per read.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from sentinel.protocol import UnreadableFileError, open_regular
from sentinel.trace_names import GRAD_NAMES, LOSS_NAMES, find_name, shown_names

TB_LOSS_NAMES = LOSS_NAMES + ("loss/train", "losses/train_loss", "train/loss_epoch")
MAX_FRAME = 1 << 24  # 16 MiB: a scalar event is ~50 bytes
MAX_SCALARS = 20_000_000  # loss and grad-norm values kept per read (~100 bytes each)
MAX_TAGS = 10_000  # tag names kept for the choice and the error message
_NAME = re.compile(r"tfevents\.(\d+)")


class TbError(ValueError):
    """An event file or directory that cannot be read as a trace (one line, for the CLI)."""


def is_dir(p: Path) -> bool:
    """``p.is_dir()``, False where the name itself is an error (too long: ``Path.is_dir`` raises
    for that one): opening it then says why, in one line."""
    try:
        return p.is_dir()
    except OSError:
        return False


def is_event_path(p: Path) -> bool:
    """An event file by its name, or a directory that holds one."""
    if is_dir(p):
        try:
            return any(_event_files(p))
        except OSError:  # unreadable: reading it as a trace says so in one line
            return False
    return ".tfevents." in p.name


def event_subdirs(d: Path, limit: int = 2000) -> list[Path]:
    """Directories below ``d`` that hold event files (a TensorBoard log root holds one per run), in
    name order; at most ``limit`` directories are looked at (``sentinel backtest /`` stays quick)."""
    out = []
    for n, (root, _dirs, files) in enumerate(os.walk(d)):
        if n >= limit:
            break
        if n and any(".tfevents." in f for f in files):
            out.append(Path(root))
    return sorted(out)


def _event_files(d: Path) -> list[Path]:
    files = [f for f in d.iterdir() if ".tfevents." in f.name and f.is_file()]
    return sorted(files, key=lambda f: (int(m.group(1)) if (m := _NAME.search(f.name)) else 0, f.name))


# -------------------------------------------------------------- CRC-32C (Castagnoli), for the length


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    c ^= 0xFFFFFFFF
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _frames(fh: BinaryIO, name: str) -> Iterator[bytes | str | None]:
    """Each record's data (None for one whose data fails its checksum), or (once, last) the
    one-line reason the file's read ended early."""
    while True:
        head = fh.read(12)
        if not head:
            return
        if len(head) < 12:
            yield f"{name}: cut short inside a record header"
            return
        length, crc = struct.unpack("<QI", head)
        if _masked_crc32c(head[:8]) != crc:
            yield f"{name}: a damaged record header (its length fails its checksum); the rest of the file is not read"
            return
        if length > MAX_FRAME:
            fh.seek(length + 4, 1)  # a large image or histogram: not a scalar
            continue
        data = fh.read(length)
        tail = fh.read(4)
        if len(data) < length or len(tail) < 4:
            yield f"{name}: cut short inside a record"
            return
        yield data if _masked_crc32c(data) == struct.unpack("<I", tail)[0] else None  # None: damaged


# -------------------------------------------------------------- protobuf wire format, the fields we read


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("a malformed varint")
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        if not b & 0x80:
            return v, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a serialized message: an int for varints, bytes otherwise."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        fn, wt = key >> 3, key & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt in (1, 5):
            size = 8 if wt == 1 else 4
            v, i = buf[i:i + size], i + size
        elif wt == 2:
            size, i = _varint(buf, i)
            v, i = buf[i:i + size], i + size
        else:
            raise ValueError(f"wire type {wt}")
        if i > n:
            raise ValueError("a truncated field")
        yield fn, wt, v


def _tensor_scalar(buf: bytes) -> float | None:
    """The value of a one-element DT_FLOAT (1) or DT_DOUBLE (2) TensorProto, else None."""
    dtype, vals = 0, []
    for fn, wt, v in _fields(buf):
        if fn == 1 and wt == 0:
            dtype = v
        elif fn == 4 and wt == 2:  # tensor_content: raw little-endian values
            fmt = "<f" if dtype == 1 else "<d" if dtype == 2 else None
            if fmt and len(v) == struct.calcsize(fmt):
                vals.append(struct.unpack(fmt, v)[0])
        elif fn == 5:  # float_val, packed (2) or not (5)
            vals += [x for (x,) in struct.iter_unpack("<f", v)] if wt == 2 and len(v) % 4 == 0 else \
                [struct.unpack("<f", v)[0]] if wt == 5 else []
        elif fn == 6:  # double_val, packed (2) or not (1)
            vals += [x for (x,) in struct.iter_unpack("<d", v)] if wt == 2 and len(v) % 8 == 0 else \
                [struct.unpack("<d", v)[0]] if wt == 1 else []
    return vals[0] if len(vals) == 1 else None


def _scalars(event: bytes) -> tuple[float | None, int, list[tuple[str, float]]]:
    """(wall time, step, [(tag, value)]) of one serialized Event. proto3 leaves fields at their
    default out: no step field is step 0, no wall time is none."""
    wall, step, out = None, 0, []
    for fn, wt, v in _fields(event):
        if fn == 1 and wt == 1:
            wall = struct.unpack("<d", v)[0]
        elif fn == 2 and wt == 0:
            step = v - (1 << 64) if v >= 1 << 63 else v  # int64
        elif fn == 5 and wt == 2:  # Summary
            for sfn, swt, value in _fields(v):
                if sfn != 1 or swt != 2:
                    continue
                tag, x = None, None
                for vfn, vwt, vv in _fields(value):
                    if vfn == 1 and vwt == 2:
                        tag = vv.decode("utf-8", errors="replace")
                    elif vfn == 2 and vwt == 5:
                        x = struct.unpack("<f", vv)[0]
                    elif vfn == 8 and vwt == 2:
                        x = _tensor_scalar(vv)
                if tag is not None and x is not None:
                    out.append((tag, x))
    return wall, step, out


# -------------------------------------------------------------- rows


def _pick(tags: list[str], names: tuple[str, ...], chosen: str | None, what: str, path: str) -> str | None:
    tag = find_name(tags, names, chosen)
    if tag is None and chosen is not None:
        raise TbError(f"{path}: no tag {chosen[:60]!r} (tags: {_shown(tags)})")
    if tag is None and what == "loss":
        raise TbError(f"{path}: no training-loss tag among {_shown(tags)}; name it with --loss-column")
    return tag


def _shown(tags: list[str], limit: int = 12) -> str:
    if not tags:
        return "none (no scalar summaries)"
    return shown_names(tags, limit)


def tb_rows(path: Path, *, loss_tag: str | None = None, source: dict[str, Any] | None = None
            ) -> Iterator[tuple[str, dict[str, Any] | str]]:
    """(where, trace-line dict) for each training-loss event of the event file or directory
    ``path``, or (where, the one-line reason) for an event or file that cannot give one.
    ``TbError`` when there is no event file, or no loss tag. ``source`` (a dict) gets the loss tag,
    the grad-norm tag (or None) and the number of files read."""
    files = _event_files(path) if is_dir(path) else [path]
    if not files:
        raise TbError(f"{path}: a directory without TensorBoard event files (events.out.tfevents.*)")
    # Only the scalars of the tags that can be the loss or the grad norm are kept (a run logs dozens
    # of others); every tag's name is, for the choice and for the error that lists them.
    wanted = {n.lower() for n in TB_LOSS_NAMES + GRAD_NAMES} | ({loss_tag.strip().lower()} if loss_tag else set())
    kept: list[tuple[int, int, float | None, int, str, float] | str] = []  # (file, record, wall time, step, tag, value), or a reason
    tags: dict[str, None] = {}
    frames_read = 0  # records whose length passed its checksum: none means no event file at all
    for fi, f in enumerate(files):
        try:
            fh = open_regular(f)  # an event file named by hand may be a FIFO or a device: never read forever
        except UnreadableFileError as e:
            raise TbError(f"{f}: {e}; an event file is a regular file") from None
        with fh:
            for n, data in enumerate(_frames(fh, str(f)), 1):
                if isinstance(data, str):
                    kept.append(data)
                    continue
                frames_read += 1
                if data is None:
                    kept.append(f"{f}: record {n}: its data fails its checksum")
                    continue
                try:
                    wall, step, scalars = _scalars(data)
                except (ValueError, struct.error) as e:
                    kept.append(f"{f}: record {n}: not a readable event ({e})")
                    continue
                for tag, x in scalars:
                    if tag not in tags and len(tags) < MAX_TAGS:
                        tags[tag] = None
                    if tag.lower() in wanted and len(kept) < MAX_SCALARS:
                        kept.append((fi, n, wall, step, tag, x))
    if frames_read == 0:
        raise TbError(f"{path}: not a TensorBoard event file (no record in it passes its checksum)")
    loss = _pick(list(tags), TB_LOSS_NAMES, loss_tag, "loss", str(path))
    grad = _pick(list(tags), GRAD_NAMES, None, "grad norm", str(path))
    if source is not None:
        source.update(loss=loss[:80], grad_norm=grad[:80] if grad else None, files=len(files))
    # ``add_scalar`` writes one event per tag: a step's grad norm is an event of its own
    grads = {e[3]: e[5] for e in kept if not isinstance(e, str) and e[4] == grad} if grad else {}
    for e in kept:
        if isinstance(e, str):
            yield str(path), e
            continue
        fi, n, wall, step, tag, x = e
        if tag != loss:
            continue
        where = f"{files[fi]}: record {n}"
        obj: dict[str, Any] = {"step": step, "loss": x}
        if step in grads:
            obj["grad_norm"] = grads[step]
        if wall is not None and wall - wall == 0.0:
            obj["time"] = wall
        yield where, obj
