"""Data pipeline: prepared token shards, the deterministic sample stream, and the skip list.

Prepare once (``python -m trainer.data prepare --out DIR``), then the trainer opens the dataset,
draws global sample ids from a :class:`Sampler` (stepping over ids in the :class:`SkipList`) and
reads their tokens with :meth:`TokenDataset.get_many`. Sample ids are global and stable, so the
sentinel can name bad data by id and a resumed run replays the exact same batches.
A dataset may be a mixture of named sources with weights (``--source NAME=KIND:WEIGHT``): every
sample id belongs to exactly one source, and a :class:`MixtureSampler` keeps one cursor per source.
No torch here: everything is numpy, so offline tools can use it cheaply.
"""

from sentinel.client.skiplist import SkipList

from .dataset import DataError, Source, TokenDataset, load_tokenizer
from .mixture import MixtureSampler, sampler_for
from .prepare import default_data_dir, ensure_prepared, prepare_dataset
from .sampler import Sampler, batch_fingerprint
from .sources import SourceSpec, load_mixture_file, parse_source

__all__ = [
    "DataError",
    "MixtureSampler",
    "Sampler",
    "SkipList",
    "Source",
    "SourceSpec",
    "TokenDataset",
    "batch_fingerprint",
    "default_data_dir",
    "ensure_prepared",
    "load_mixture_file",
    "load_tokenizer",
    "parse_source",
    "prepare_dataset",
    "sampler_for",
]
