"""Tokenizers: text <-> token ids, and how a tokenizer is described in ``meta.json``.

Three kinds, all with ``encode(str) -> list[int]`` and ``decode(list[int]) -> str``:

* ``byte`` (default): UTF-8 bytes, vocab 256. Needs no training and no file, so a fresh machine
  can prepare and train offline. It has no spare id for an end-of-text marker, so documents are
  separated by token 0 (the NUL byte, which does not occur in real text); a NUL inside input text
  is therefore indistinguishable from a document boundary.
* ``bpe``: byte-level BPE trained locally with HF ``tokenizers`` and saved as ``tokenizer.json``
  next to the shards. Id 0 is the special ``<|endoftext|>`` token; a literal ``<|endoftext|>``
  in input text is encoded as that special token.
* ``external``: shards imported from nanoGPT ``.bin`` files whose tokenizer we do not have.
  ``decode`` renders ids as ``<id>`` so replay tooling still shows something; ``encode`` refuses.

This module knows nothing about data directories beyond the BPE file name; ``dataset.py`` reads
``meta.json`` and calls :func:`tokenizer_from_info`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

BPE_FILE = "tokenizer.json"
EOT_TEXT = "<|endoftext|>"
BYTE_VOCAB = 256
# byte-level BPE needs the 256 byte symbols plus <|endoftext|>
MIN_BPE_VOCAB = BYTE_VOCAB + 1
MAX_BPE_VOCAB = 1 << 24
MAX_VOCAB = 1 << 32


class Tokenizer(Protocol):
    kind: str
    vocab_size: int
    eot: int | None  # the end-of-text id inserted at document boundaries (None: no marker)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest little-endian dtype nanoGPT-style readers use for this vocab."""
    if not 0 < vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab size must be between 1 and {MAX_VOCAB} (got {vocab_size})")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def dtype_name(dtype: np.dtype) -> str:
    """``uint16``/``uint32``: the spelling used in meta.json and on the CLI."""
    return np.dtype(dtype).name


class ByteTokenizer:
    kind = "byte"
    vocab_size = BYTE_VOCAB
    eot = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class BpeTokenizer:
    kind = "bpe"

    def __init__(self, tok) -> None:
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size()
        self.eot: int | None = tok.token_to_id(EOT_TEXT)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
        """Train byte-level BPE; deterministic for the same texts in the same order."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if not MIN_BPE_VOCAB <= vocab_size <= MAX_BPE_VOCAB:
            raise ValueError(f"--vocab-size must be between {MIN_BPE_VOCAB} and {MAX_BPE_VOCAB} for bpe (got {vocab_size})")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TEXT],  # first special token -> id 0
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable: no <unk>
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> BpeTokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        return cls(HFTokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        path.write_text(self.to_str(), encoding="utf-8")

    def to_str(self) -> str:
        return self._tok.to_str()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, tokens: Sequence[int]) -> str:
        return self._tok.decode([int(t) for t in tokens], skip_special_tokens=False)


class ExternalTokenizer:
    """Stand-in for shards imported from ``.bin`` files: ids are known, text is not."""

    kind = "external"
    eot = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        raise ValueError("this dataset was imported from .bin shards; its tokenizer is unknown, so it cannot encode text")

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(f"<{int(t)}>" for t in tokens)


def tokenizer_info(tok: Tokenizer, dtype: np.dtype) -> dict:
    """The ``meta.json["tokenizer"]`` entry; also the tokenizer's identity in the dataset fingerprint."""
    info: dict = {"kind": tok.kind, "vocab_size": tok.vocab_size, "dtype": dtype_name(dtype), "eot": tok.eot}
    if isinstance(tok, BpeTokenizer):
        info["file"] = BPE_FILE
        info["sha256"] = hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
    return info


def tokenizer_from_info(info: dict, data_dir: Path) -> Tokenizer:
    """Rebuild the tokenizer described by a ``meta.json["tokenizer"]`` entry; ValueError/OSError if not possible."""
    kind = info.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        path = Path(data_dir) / info.get("file", BPE_FILE)
        if not path.is_file():
            raise ValueError(f"{path} is missing")
        if "sha256" in info and hashlib.sha256(path.read_bytes()).hexdigest() != info["sha256"]:
            raise ValueError(f"{path} does not match the tokenizer this dataset was encoded with (sha256 differs)")
        tok = BpeTokenizer.load(path)
        if tok.vocab_size != info.get("vocab_size"):
            raise ValueError(f"{path} has vocab {tok.vocab_size}, meta.json says {info.get('vocab_size')}")
        return tok
    if kind == "external":
        return ExternalTokenizer(int(info["vocab_size"]))
    raise ValueError(f"unknown tokenizer kind {kind!r}")
