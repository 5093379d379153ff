"""The dataset fingerprint: what names a prepared dataset's content, in a checkpoint and on every
step record (so a resume onto other data is refused)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence


def compute_fingerprint(shards: Sequence[dict], tokenizer: dict, sources: Sequence[dict] | None = None) -> str:
    """sha256 over the sorted ``split:name:sha256`` of every shard plus the tokenizer identity
    (and, for a mixture, each source's name and token ranges: they define the sample ids).

    Split and name are included with each content hash so that swapping train and val, or
    reordering shards (which renumbers every sample id), also changes the fingerprint. Source
    weights are not included: they change which ids are drawn, never what an id names.
    """
    h = hashlib.sha256()
    for line in sorted(f"{s['split']}:{s['name']}:{s['sha256']}" for s in shards):
        h.update(line.encode() + b"\n")
    h.update(json.dumps(tokenizer, sort_keys=True, separators=(",", ":")).encode())
    if sources:
        layout = [[s["name"], s["train"]["start"], s["train"]["tokens"], s["val"]["start"], s["val"]["tokens"]] for s in sources]
        h.update(json.dumps(layout, separators=(",", ":")).encode())
    return h.hexdigest()
