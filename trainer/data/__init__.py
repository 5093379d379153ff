"""Data pipeline: prepared token shards, the deterministic sample stream, and the skip list.

Prepare once (``python -m trainer.data prepare --out DIR``), then the trainer opens the dataset,
draws global sample ids from a :class:`Sampler` (stepping over ids in the :class:`SkipList`) and
reads their tokens with :meth:`TokenDataset.get_many`. Sample ids are global and stable, so the
sentinel can name bad data by id and a resumed run replays the exact same batches.
No torch here: everything is numpy, so offline tools can use it cheaply.
"""

from .dataset import DataError, TokenDataset, load_tokenizer
from .prepare import default_data_dir, ensure_prepared, prepare_dataset
from .sampler import Sampler, batch_fingerprint
from .skiplist import SkipList

__all__ = [
    "DataError",
    "Sampler",
    "SkipList",
    "TokenDataset",
    "batch_fingerprint",
    "default_data_dir",
    "ensure_prepared",
    "load_tokenizer",
    "prepare_dataset",
]
