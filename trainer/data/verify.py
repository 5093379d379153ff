"""Shard verification at open: every byte hashed against ``meta.json`` and every token id checked
against the vocabulary, once per shard *version*.

Hashing a large dataset at every start would cost minutes, so the result is cached in
``DIR/.sentinel-verified.json`` keyed by each shard's (size, mtime_ns, ctime_ns, inode). Any write
to a shard changes its ctime, which no unprivileged process can set back, so a same-size
in-place corruption is re-hashed at the next open and caught; an unchanged shard costs one stat.
The dataset fingerprint is then recomputed from these *measured* hashes, never just copied from
meta.json. A read-only dataset dir simply gets no cache (hashed at every open).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from sentinel.client.skiplist import DataError

from .fingerprint import compute_fingerprint

CACHE_NAME = ".sentinel-verified.json"
_CHUNK_TOKENS = 1 << 22  # 8-16 MB per read: one pass computes the sha256 and the largest token id


def scan_shard(path: Path, dtype: np.dtype) -> tuple[str, int, int]:
    """(sha256 of the bytes, largest token id, its offset) in one sequential pass."""
    h = hashlib.sha256()
    top, where, offset = -1, -1, 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK_TOKENS * dtype.itemsize):
            h.update(block)
            toks = np.frombuffer(block, dtype=dtype)
            if toks.size:
                i = int(toks.argmax())
                if int(toks[i]) > top:
                    top, where = int(toks[i]), offset + i
            offset += toks.size
    return h.hexdigest(), top, where


def _key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _load_cache(data_dir: Path) -> dict:
    try:
        cache = json.loads((data_dir / CACHE_NAME).read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def _save_cache(data_dir: Path, cache: dict) -> None:
    tmp = data_dir / f".{CACHE_NAME}.tmp-{os.getpid()}"
    try:
        tmp.write_text(json.dumps(cache, sort_keys=True))
        os.replace(tmp, data_dir / CACHE_NAME)
    except OSError:  # read-only or full: verification still happened, it just is not remembered
        tmp.unlink(missing_ok=True)


def verify_shards(data_dir: Path, meta: dict, dtype: np.dtype, *, use_cache: bool = True) -> str:
    """Check every shard of ``meta`` (sha256 and token range); return the fingerprint computed from
    the measured hashes. Raises DataError in one line naming the shard and what is wrong."""
    vocab = int(meta["tokenizer"]["vocab_size"])
    cache = _load_cache(data_dir) if use_cache else {}
    measured, changed = [], False
    for shard in meta["shards"]:
        path = data_dir / shard["name"]
        key = _key(path.stat())
        hit = cache.get(shard["name"])
        if isinstance(hit, dict) and hit.get("key") == key and hit.get("sha256") == shard["sha256"]:
            digest, top, where = hit["sha256"], int(hit["max_token"]), int(hit["max_at"])
        else:
            digest, top, where = scan_shard(path, dtype)
            cache[shard["name"]] = {"key": key, "sha256": digest, "max_token": top, "max_at": where}
            changed = True
        if digest != shard["sha256"]:
            raise DataError(f"shard {path} is corrupt: sha256 differs from meta.json (same size: modified in place?)")
        if top >= vocab:
            raise DataError(f"shard {path} holds token id {top} at token {where}, outside the vocabulary "
                            f"(vocab_size {vocab}): the shard does not belong to this tokenizer or is corrupt")
        measured.append({**shard, "sha256": digest})
    if changed and use_cache:
        _save_cache(data_dir, {k: v for k, v in cache.items() if k in {s["name"] for s in meta["shards"]}})
    return compute_fingerprint(measured, meta["tokenizer"])
