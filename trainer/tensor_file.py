"""A checkpoint's tensor files (``model``, ``optim``, ``rng-rankN``): the safetensors layout, no pickle.

A file is what ``safetensors`` writes and reads::

    8 bytes      N, the header's length (unsigned, little-endian)
    N bytes      the header: a JSON object, padded with spaces to a multiple of 8 bytes
                   {"__metadata__": {"format": FORMAT, "tree": "<JSON>"},
                    "<name>": {"dtype": "F32", "shape": [768, 256], "data_offsets": [begin, end]}, ...}
    the data     every tensor's bytes, back to back in the order of their offsets, no gaps

``tree`` is the object around the tensors (a state dict, the optimizer's flat state, the RNG states), in
JSON with a tag for each value JSON cannot hold as it is: ``{"__tensor__": name}``, ``{"__tuple__": [...]}``,
``{"__dict__": [[key, value], ...]}`` (a dict with a key that is not a string, or that starts with
``__``), ``{"__float__": "nan" | "inf" | "-inf"}``. A tensor stored under several keys (tied weights) is
written once. The tensors go in the order of their element size, largest first, so each starts aligned.

Why not ``torch.save``: ``torch.load(weights_only=True)`` runs a pure-Python unpickler that costs tens of
microseconds per tensor, and ``model.pt`` alone took 1.6 ms of a 1.5 MB checkpoint's 7 ms load
(docs/benchmarks/checkpoint-cost.md). Here a load parses one JSON header and makes each tensor a view
of the file's bytes. Nothing in the file can run code: there is no pickle to refuse, so the
``weights_only`` unpickler, and its history of escapes, is out of the path. The model's file is a
plain safetensors file to every other tool (``safetensors.torch.load_file`` reads it).

``read`` validates the header before it makes any tensor: known dtypes, shapes that match the byte
ranges, ranges that tile the data exactly, a tree whose every tensor is in the header. Each refusal
is one line (``TensorFileError``).
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import torch

from sentinel.contract.fsio import map_file

FORMAT = "sentinel.tensor-tree/1"
SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
MAX_DIMS = 64
_LEN = struct.Struct("<Q")

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
          torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_BY_NAME = {v: k for k, v in DTYPES.items()}
_TAGS = ("__tensor__", "__tuple__", "__dict__", "__float__")


class TensorFileError(ValueError):
    """A tensor file that cannot be read whole: one line, naming what is wrong."""


# ============================================================================ writing
def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor], seen: dict[tuple, str]) -> Any:
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if t.dtype not in DTYPES:
            raise TypeError(f"{path or 'tensor'}: dtype {t.dtype} has no safetensors name")
        # the same memory under a second name: a tied weight (before any copy to the host, which would hide it)
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:  # the same tensor under a second key (tied weights): written once
            return {"__tensor__": seen[key]}
        name = path or "tensor"
        while name in tensors:
            name += "'"
        tensors[name] = t if t.device.type == "cpu" else t.cpu()
        if t.numel():
            seen[key] = name
        return {"__tensor__": name}
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    sub = f"{path}." if path else ""
    if isinstance(obj, list):
        return [_encode(v, f"{sub}{i}", tensors, seen) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{sub}{i}", tensors, seen) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, f"{sub}{k}", tensors, seen) for k, v in obj.items()}
        if not all(k is None or isinstance(k, (bool, int, float, str)) for k in obj):
            raise TypeError(f"{path or 'the object'}: a dict key that is not a plain value")
        return {"__dict__": [[_encode(k, "", tensors, seen), _encode(v, f"{sub}{k}", tensors, seen)] for k, v in obj.items()]}
    raise TypeError(f"{path or 'the object'}: a {type(obj).__name__} cannot be stored in a tensor file")


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of ``t`` (made contiguous first), without a copy when it is."""
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def encode(obj: Any) -> tuple[bytes, list[memoryview]]:
    """The header (length prefix included) and the data, as buffers to write in order."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(obj, "", tensors, {})
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())  # stable: largest elements first, aligned
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "tree": json.dumps(tree, allow_nan=False, separators=(",", ":"))}}
    data, offset = [], 0
    for name in order:
        t = tensors[name]
        raw = _raw(t)
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
        data.append(raw)
    text = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return _LEN.pack(len(text)) + text, data


# ============================================================================ reading
_LEAVES = frozenset((int, str, bool, type(None)))  # as JSON gives them: nothing to decode


def _decode(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if type(node) is list:  # the leaves inline: an optimizer's tree is mostly lists of indices and sizes
        return [v if type(v) in _LEAVES else _decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        if isinstance(node, float) and not math.isfinite(node):
            raise TensorFileError("the tree holds a bare non-finite number")
        return node
    tag = next((k for k in _TAGS if k in node), None)
    if tag is None:
        if any(k.startswith("__") for k in node):
            raise TensorFileError(f"the tree has an unknown tag {next(k for k in node if k.startswith('__'))[:40]!r}")
        return {k: _decode(v, tensors) for k, v in node.items()}
    if len(node) != 1:
        raise TensorFileError(f"the tree's {tag} node has other keys")
    value = node[tag]
    if tag == "__tensor__":
        if not isinstance(value, str) or value not in tensors:
            raise TensorFileError(f"the tree names a tensor the header lacks ({str(value)[:40]!r})")
        return tensors[value]
    if tag == "__tuple__":
        if not isinstance(value, list):
            raise TensorFileError("the tree's __tuple__ is not a list")
        return tuple(_decode(v, tensors) for v in value)
    if tag == "__float__":
        if value not in ("nan", "inf", "-inf"):
            raise TensorFileError(f"the tree's __float__ is {str(value)[:20]!r}")
        return float(value)
    if not isinstance(value, list) or not all(isinstance(kv, list) and len(kv) == 2 for kv in value):
        raise TensorFileError("the tree's __dict__ is not a list of [key, value] pairs")
    out = {}
    for k, v in value:
        key = _decode(k, tensors)
        if isinstance(key, (dict, list, torch.Tensor)):
            raise TensorFileError("the tree's __dict__ has a key that is not a plain value")
        out[key] = _decode(v, tensors)
    return out


def _entry(name: str, e: Any, data_len: int) -> tuple[torch.dtype, list[int], int, int]:
    if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
        raise TensorFileError(f"tensor {name[:60]!r}: expected exactly dtype, shape and data_offsets")
    dtype = _BY_NAME.get(e["dtype"]) if isinstance(e["dtype"], str) else None
    if dtype is None:
        raise TensorFileError(f"tensor {name[:60]!r}: unknown dtype {str(e['dtype'])[:20]!r}")
    shape, offs = e["shape"], e["data_offsets"]
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in shape)):
        raise TensorFileError(f"tensor {name[:60]!r}: shape is not a list of sizes")
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            and 0 <= offs[0] <= offs[1] <= data_len):
        raise TensorFileError(f"tensor {name[:60]!r}: data_offsets out of the file")
    numel = math.prod(shape)
    if numel * dtype.itemsize != offs[1] - offs[0]:
        raise TensorFileError(f"tensor {name[:60]!r}: shape {shape} {e['dtype']} does not fill its {offs[1] - offs[0]} bytes")
    if offs[0] % dtype.itemsize:  # every writer here aligns them (the header is padded to 8 bytes)
        raise TensorFileError(f"tensor {name[:60]!r}: data_offsets not aligned to its {dtype.itemsize}-byte elements")
    return dtype, shape, offs[0], offs[1]


def _parse_header(text: bytes, data_len: int, fmt: str) -> tuple[list[tuple[str, torch.dtype, list[int], int, int]], Any]:
    """The header's tensors (name, dtype, shape, data offsets), in the data's order, and its tree (JSON);
    or ``TensorFileError``. A function of its arguments alone: ``_parsed`` keeps the last few."""
    try:
        header = json.loads(text)
    except (ValueError, RecursionError):
        raise TensorFileError("header is not JSON") from None
    if not isinstance(header, dict):
        raise TensorFileError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict) or meta.get("format") != fmt or not isinstance(meta.get("tree"), str):
        got = meta.get("format") if isinstance(meta, dict) else None
        raise TensorFileError(f"not a {fmt} file (format {str(got)[:40]!r})")
    entries = sorted(((name, *_entry(name, e, data_len)) for name, e in header.items()), key=lambda x: (x[3], x[4]))
    end = 0
    for name, _, _, begin, stop in entries:
        if begin != end:
            raise TensorFileError(f"tensor {name[:60]!r}: data_offsets {'overlap' if begin < end else 'leave a gap'}")
        end = stop
    if end != data_len:
        raise TensorFileError(f"the data is {data_len} bytes, its tensors cover {end}")
    try:
        tree = json.loads(meta["tree"])
    except (ValueError, RecursionError):
        raise TensorFileError("the tree is not JSON") from None
    return entries, tree


# every checkpoint of a run has the same headers (the same tensors, shapes and tree): a load parses and
# checks each once (on ``tiny``, 0.15 of a 2 ms load). Keyed by the header's bytes, so it cannot go
# stale; only headers up to 1 MiB are kept, the last 16. Nothing of it is mutated: ``_decode`` builds anew
_parsed = functools.lru_cache(maxsize=16)(_parse_header)
_PARSED_MAX_BYTES = 1 << 20


def read(buf, *, fmt: str = FORMAT) -> Any:
    """The object stored in ``buf`` (a writable buffer: ``bytearray``, or a copy-on-write ``mmap``), its
    tensors views of ``buf``; or ``TensorFileError``."""
    size = len(buf)
    if size < 8:
        raise TensorFileError("shorter than its length prefix")
    (n,) = _LEN.unpack_from(buf, 0)
    if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
        raise TensorFileError(f"header length {n} does not fit the file ({size} bytes)")
    if n % 8:
        raise TensorFileError(f"header length {n} is not a multiple of 8 (the tensors would be misaligned)")
    base, data_len = 8 + n, size - 8 - n
    entries, tree = (_parsed if n <= _PARSED_MAX_BYTES else _parse_header)(bytes(buf[8:base]), data_len, fmt)
    tensors = {}
    for name, dtype, shape, begin, stop in entries:
        if stop == begin:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(buf, dtype=dtype, count=(stop - begin) // dtype.itemsize, offset=base + begin).view(shape)
    try:
        return _decode(tree, tensors)
    except RecursionError:
        raise TensorFileError("the tree is nested too deeply") from None


def load(path: Path, *, fmt: str = FORMAT, mapped: bool = True, mapping: mmap.mmap | None = None) -> Any:
    """``read`` of the file at ``path``. ``mapped``: its tensors are views of a private (copy-on-write)
    mapping of the file, which lasts as long as one of them does, so the caller copies them into live
    tensors and lets them go; else of one read into fresh memory. ``mapping``: that mapping, made
    already (the one its checksum was computed through: ``sentinel.contract.fsio.map_file``)."""
    if mapped and (mapping := mapping if mapping is not None else map_file(path)) is not None:
        return read(mapping, fmt=fmt)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))  # not mapped, or empty (map_file: None)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size and (k := os.readv(fd, [view[got:]])):
            got += k
        if got != size:
            raise TensorFileError("changed size while it was read")
    finally:
        os.close(fd)
    return read(buf, fmt=fmt)
