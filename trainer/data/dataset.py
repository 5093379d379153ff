"""Reading a prepared dataset: ``meta.json`` plus memory-mapped token shards.

On-disk format (written by ``prepare.py``, version ``FORMAT_VERSION``)::

    DIR/meta.json            format version, tokenizer, shards, token counts, fingerprint
    DIR/train-00000.bin ...  flat little-endian uint16/uint32 token ids, no header (nanoGPT layout)
    DIR/val-00000.bin ...    held-out split: never sampled for training
    DIR/tokenizer.json       (bpe only) the HF tokenizers file

A *sample* is a window of ``seq_len + 1`` tokens over the concatenated train shards, taken with
stride ``seq_len`` (so consecutive samples share one token: the last target of one is the first
input of the next). Sample id ``i`` starts at token ``i * seq_len``. Ids are therefore stable and
global: they depend only on the data and ``seq_len``, never on rank, world size or shuffling,
which is what lets the sentinel name bad data by id and the skip list outlive a restart.
Windows may cross shard boundaries.

A *mixture* dataset (format v2, ``meta.json["sources"]``) is several named sources, each a
contiguous token range of each split (its own shards). Windows never cross a source boundary:
source ``k`` owns the contiguous id range ``[first_k, first_k + n_k)`` with
``n_k = (train_tokens_k - 1) // seq_len``, and id ``first_k + j`` starts at token
``train_start_k + j * seq_len``. A v1 dataset is one source spanning everything, so both formulas
agree. The source of any id is therefore known from the id alone (:meth:`TokenDataset.source_index`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sentinel.client.skiplist import DataError  # one error type for the whole data side (skip lists too)

from .fingerprint import compute_fingerprint
from .tokenizer import Tokenizer, tokenizer_from_info
from .verify import verify_shards

META_NAME = "meta.json"
FORMAT_NAME = "sentinel-token-shards"
FORMAT_VERSION = 1  # a plain dataset
MIXTURE_FORMAT_VERSION = 2  # a dataset with named sources (meta.json["sources"])
SPLITS = ("train", "val")




def not_a_regular_file(path: Path) -> str | None:
    """What keeps ``path`` from being read as a file (it does not exist, it is a directory, a device
    such as /dev/zero that never ends, a FIFO that blocks), or None for a regular file (links followed)."""
    import stat

    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "does not exist" if not path.is_symlink() else "is a broken symbolic link"
    except OSError as e:  # a parent that is a file, no permission on a parent, a name too long
        return f"cannot be opened ({e.strerror or type(e).__name__})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")
    return f"is not a regular file ({kind})"


def read_meta(data_dir: Path | str) -> dict:
    """Load and sanity-check ``meta.json``; DataError with a fix-it hint when absent or unusable."""
    data_dir = Path(data_dir)
    path = data_dir / META_NAME
    hint = f"run `python -m trainer.data prepare --out {data_dir}`"
    if not data_dir.is_dir():  # missing, or a file, a FIFO, a device: said as it is, not as "no meta.json"
        bad = not_a_regular_file(data_dir)
        if bad == "does not exist":
            raise DataError(f"data dir {data_dir} does not exist ({hint})")
        kind = "a regular file" if bad is None else bad.removeprefix("is not a regular file (").rstrip(")")
        raise DataError(f"data dir {data_dir} is {kind}, not a directory" if bad is None or bad.startswith("is not")
                        else f"data dir {data_dir} {bad}")
    bad = not_a_regular_file(path)
    if bad == "does not exist":
        raise DataError(f"data dir {data_dir} has no {META_NAME} ({hint})")
    if bad:
        raise DataError(f"{path} {bad}")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DataError(f"{path} is not a {FORMAT_NAME} meta file")
    if int(meta.get("version", 0)) > MIXTURE_FORMAT_VERSION:
        raise DataError(f"{path} has format v{meta['version']}, newer than this tool's v{MIXTURE_FORMAT_VERSION}; upgrade sentinel")
    try:
        want = compute_fingerprint(meta["shards"], meta["tokenizer"], meta.get("sources"))
    except (KeyError, TypeError):
        raise DataError(f"{path} is missing shard, tokenizer or source entries") from None
    if want != meta.get("dataset_fingerprint"):
        raise DataError(f"{path} is inconsistent: its dataset_fingerprint does not match its shards")
    return meta


def load_tokenizer(data_dir: Path | str) -> Tokenizer:
    """The tokenizer a prepared dataset was encoded with (``encode``/``decode``)."""
    meta = read_meta(data_dir)
    try:
        return tokenizer_from_info(meta["tokenizer"], Path(data_dir))
    except Exception as e:  # tokenizers raises its own exception types for a corrupt file
        raise DataError(f"cannot load the tokenizer of {data_dir}: {e}") from None


class _TokenStream:
    """The shards of one split, read as one concatenated token array."""

    def __init__(self, names: list[str], arrays: list[np.ndarray]) -> None:
        self.names = names
        self.arrays = arrays
        self.starts = np.cumsum([0] + [len(a) for a in arrays], dtype=np.int64)
        self.total = int(self.starts[-1])

    def _shard_of(self, pos: int) -> int:
        return int(np.searchsorted(self.starts, pos, side="right")) - 1

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` as int64, stitched across shard boundaries."""
        out = np.empty(length, dtype=np.int64)
        filled, k = 0, self._shard_of(start)
        while filled < length:
            lo = start + filled - int(self.starts[k])
            piece = self.arrays[k][lo : lo + length - filled]
            out[filled : filled + len(piece)] = piece
            filled += len(piece)
            k += 1
        return out

    def locate(self, pos: int) -> tuple[str, int]:
        k = self._shard_of(pos)
        return self.names[k], pos - int(self.starts[k])


@dataclass(frozen=True)
class Source:
    """One named source (slice) of a dataset: a contiguous token range of each split."""

    name: str
    weight: float  # default sampling weight, from prepare (not normalised)
    train_start: int
    train_tokens: int
    val_start: int
    val_tokens: int


def _sources(meta: dict, streams: dict[str, _TokenStream], where: Path) -> list[Source]:
    """The sources of a dataset; a v1 dataset is one source named after its source kind."""
    entries = meta.get("sources")
    if not entries:
        kind = str((meta.get("source") or {}).get("kind", "data"))
        name = re.sub(r"[^a-z0-9_]", "_", kind.lower())[:32] or "data"
        return [Source(name, 1.0, 0, streams["train"].total, 0, streams["val"].total)]
    try:
        out = [Source(str(e["name"]), float(e["weight"]), int(e["train"]["start"]), int(e["train"]["tokens"]),
                      int(e["val"]["start"]), int(e["val"]["tokens"])) for e in entries]
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{where / META_NAME} has a malformed `sources` entry") from None
    for split in SPLITS:
        pos = 0
        for src in out:
            start, n = (src.train_start, src.train_tokens) if split == "train" else (src.val_start, src.val_tokens)
            if start != pos or n < 0:
                raise DataError(f"{where / META_NAME}: source {src.name} does not tile the {split} split")
            pos += n
        if pos != streams[split].total:
            raise DataError(f"{where / META_NAME}: the sources cover {pos} {split} tokens, the shards hold {streams[split].total}")
    names = [src.name for src in out]
    if len(set(names)) != len(names) or not all(re.fullmatch(r"[a-z0-9_]{1,32}", n) for n in names) or len(out) > 16:
        raise DataError(f"{where / META_NAME}: source names must be unique, [a-z0-9_]{{1,32}}, at most 16")
    return out


class TokenDataset:
    """A prepared dataset: sample windows from train, fixed evaluation windows from val."""

    def __init__(self, data_dir: Path, meta: dict, streams: dict[str, _TokenStream]) -> None:
        self.data_dir = data_dir
        self.meta = meta
        self.fingerprint: str = meta["dataset_fingerprint"]
        self.vocab_size: int = int(meta["tokenizer"]["vocab_size"])
        self.dtype = np.dtype(meta["tokenizer"]["dtype"]).newbyteorder("<")
        self._streams = streams
        self._tokenizer: Tokenizer | None = None
        self.sources: list[Source] = _sources(meta, streams, data_dir)
        self.is_mixture = bool(meta.get("sources"))
        self._firsts: dict[int, np.ndarray] = {}  # seq_len -> first sample id of each source (+ total)

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self.sources]

    @classmethod
    def open(cls, data_dir: Path | str, verify: bool | None = None) -> TokenDataset:
        """Memory-map every shard after verifying it (sha256 against meta.json, token ids inside the
        vocabulary; see ``verify.py``). ``verify=None``: verified once per shard version (cached by
        stat, so an unchanged dataset costs one stat per shard); ``True``: re-hash everything now;
        ``False``: sizes only (tools that must open a damaged dataset)."""
        data_dir = Path(data_dir)
        meta = read_meta(data_dir)
        dtype = np.dtype(meta["tokenizer"]["dtype"]).newbyteorder("<")
        names: dict[str, list[str]] = {s: [] for s in SPLITS}
        arrays: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
        for shard in meta["shards"]:
            path = data_dir / shard["name"]
            bad = not_a_regular_file(path)
            if bad:
                raise DataError(f"shard {path} {'is missing' if bad == 'does not exist' else bad}")
            size = path.stat().st_size
            if size == 0 or size != shard["tokens"] * dtype.itemsize:
                want = shard["tokens"] * dtype.itemsize
                raise DataError(f"shard {path} has {size} bytes, expected {want} (truncated or replaced?)")
            names[shard["split"]].append(shard["name"])
            arrays[shard["split"]].append(np.memmap(path, dtype=dtype, mode="r"))
        streams = {s: _TokenStream(names[s], arrays[s]) for s in SPLITS}
        ds = cls(data_dir, meta, streams)
        if verify is not False:
            ds.fingerprint = verify_shards(data_dir, meta, dtype, use_cache=verify is None)
        return ds

    # ---- train samples -----------------------------------------------------------------------

    def num_samples(self, seq_len: int) -> int:
        """Number of train windows of ``seq_len + 1`` tokens at stride ``seq_len``."""
        return int(self._first_ids(seq_len)[-1])

    def _first_ids(self, seq_len: int) -> np.ndarray:
        """First sample id of each source, then the total: ``len(sources) + 1`` int64 values."""
        _check_seq_len(seq_len)
        firsts = self._firsts.get(seq_len)
        if firsts is None:
            counts = [max(0, (s.train_tokens - 1) // seq_len) for s in self.sources]
            firsts = self._firsts[seq_len] = np.cumsum([0] + counts, dtype=np.int64)
        return firsts

    def source_sample_counts(self, seq_len: int) -> list[int]:
        """Train samples per source at ``seq_len`` (a source shorter than one window has 0)."""
        return np.diff(self._first_ids(seq_len)).tolist()

    def source_id_ranges(self, seq_len: int) -> dict[str, tuple[int, int]]:
        """``{source name: (first id, end id)}``: the [lo, hi) sample-id range of each source."""
        f = self._first_ids(seq_len).tolist()
        return {s.name: (f[k], f[k + 1]) for k, s in enumerate(self.sources)}

    def source_index(self, ids: Sequence[int] | np.ndarray, seq_len: int) -> np.ndarray:
        """Index into ``sources`` of each sample id (int64 array); ids are not range-checked."""
        return np.searchsorted(self._first_ids(seq_len), np.asarray(ids, dtype=np.int64), side="right") - 1

    def source_of(self, sample_id: int, seq_len: int) -> str:
        """Name of the source a sample comes from (replay and incident tooling)."""
        i = self._check_id(sample_id, seq_len)
        return self.sources[int(self.source_index([i], seq_len)[0])].name

    def _token_start(self, sample_id: int, seq_len: int) -> int:
        firsts = self._first_ids(seq_len)
        k = int(np.searchsorted(firsts, sample_id, side="right")) - 1
        return self.sources[k].train_start + (sample_id - int(firsts[k])) * seq_len

    def _check_id(self, sample_id: int, seq_len: int) -> int:
        n = self.num_samples(seq_len)
        if not 0 <= int(sample_id) < n:
            raise DataError(f"sample id {sample_id} out of range: this dataset has {n} samples at seq_len {seq_len}")
        return int(sample_id)

    def get(self, sample_id: int, seq_len: int) -> np.ndarray:
        """Tokens of one sample: int64, shape ``(seq_len + 1,)``; inputs ``[:-1]``, targets ``[1:]``."""
        i = self._check_id(sample_id, seq_len)
        return self._streams["train"].read(self._token_start(i, seq_len), seq_len + 1)

    def get_many(self, ids: Sequence[int], seq_len: int) -> np.ndarray:
        """Samples stacked in the order given: int64, shape ``(len(ids), seq_len + 1)``."""
        out = np.empty((len(ids), seq_len + 1), dtype=np.int64)
        for row, sample_id in enumerate(ids):
            out[row] = self.get(sample_id, seq_len)
        if out.size and int(out.max()) >= self.vocab_size:  # a shard opened unverified, or changed since
            row = int(np.flatnonzero(out.max(axis=1) >= self.vocab_size)[0])
            shard, offset = self.locate(ids[row], seq_len)
            raise DataError(f"sample {ids[row]} ({shard} at token {offset}) holds token id {int(out[row].max())}, "
                            f"outside the vocabulary (vocab_size {self.vocab_size})")
        return out

    def locate(self, sample_id: int, seq_len: int) -> tuple[str, int]:
        """``(shard file name, token offset in that shard)`` where a sample starts."""
        i = self._check_id(sample_id, seq_len)
        return self._streams["train"].locate(self._token_start(i, seq_len))

    # ---- validation --------------------------------------------------------------------------

    def _val_range(self, seq_len: int, source: int | None) -> tuple[int, int]:
        """(first token, number of windows) of the val split, or of one source's part of it."""
        _check_seq_len(seq_len)
        if source is None:
            base, total, what = 0, self._streams["val"].total, "val split"
        else:
            src = self.sources[source]
            base, total, what = src.val_start, src.val_tokens, f"val split of source {src.name}"
        available = max(0, (total - 1) // seq_len)
        if available == 0:
            raise DataError(f"{what} of {self.data_dir} has {total} tokens, fewer than one window of {seq_len + 1}")
        return base, available

    def val_batches(self, seq_len: int, batch_size: int, max_batches: int, source: int | None = None) -> list[np.ndarray]:
        """Fixed ``(B, seq_len + 1)`` int64 windows from the val split only (``source``: from that
        source's part of it, so each slice is evaluated on its own held-out text).

        The windows are spread evenly over the whole val split (not just its head), and depend
        only on the data and the arguments, so every evaluation of every run sees the same tokens
        and val losses are comparable across restarts. The last batch may be smaller when val
        holds fewer than ``batch_size * max_batches`` windows.
        """
        if batch_size < 1 or max_batches < 1:
            raise DataError(f"batch_size and max_batches must be >= 1 (got {batch_size}, {max_batches})")
        base, available = self._val_range(seq_len, source)
        val = self._streams["val"]
        k = min(available, batch_size * max_batches)
        starts = base + (np.arange(k, dtype=np.int64) * available // k) * seq_len
        windows = np.stack([val.read(int(s), seq_len + 1) for s in starts])
        return [windows[i : i + batch_size] for i in range(0, k, batch_size)]

    def probe_windows(self, seq_len: int, n: int, source: int) -> np.ndarray:
        """A source's probe set: ``n`` fixed ``(n, seq_len + 1)`` windows of its val split, spread
        evenly and shifted half a window off the :meth:`val_batches` grid, so the probe is other
        text than the val windows (when the split is long enough) yet equally held out."""
        if n < 1:
            raise DataError(f"probe size must be >= 1 (got {n})")
        base, available = self._val_range(seq_len, source)
        last = base + self.sources[source].val_tokens - (seq_len + 1)  # the last start that fits
        k = min(available, n)
        starts = np.minimum(base + (np.arange(k, dtype=np.int64) * available // k) * seq_len + seq_len // 2, last)
        val = self._streams["val"]
        return np.stack([val.read(int(s), seq_len + 1) for s in starts])

    # ---- text --------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.data_dir)
        return self._tokenizer

    def decode(self, tokens: Sequence[int] | np.ndarray) -> str:
        """Text of token ids (invalid UTF-8 is replaced, never raised)."""
        return self.tokenizer.decode([int(t) for t in np.asarray(tokens).reshape(-1)])


def _check_seq_len(seq_len: int) -> None:
    if int(seq_len) < 1:
        raise DataError(f"seq_len must be >= 1 (got {seq_len})")
