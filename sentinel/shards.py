"""Which worker of ``sentinel run --workers K`` watches a run: a stable hash of its run id.

The same run id lands on the same worker whatever the order the runs were named in, in a
discovery pass or on the command line, and after a worker's restart: its consumer name and its
leases stay its own. ``K`` workers share the runs about evenly (CRC-32; 300 runs over 2 workers
split 150 +- ~9).
"""

from __future__ import annotations

import zlib

MAX_WORKERS = 64


def shard_of(run: str, count: int) -> int:
    """The worker (0 .. count-1) that watches ``run``; 0 when there is one."""
    if count <= 1:
        return 0
    return zlib.crc32(run.encode("utf-8", "surrogateescape")) % count


def in_shard(run: str, shard: tuple[int, int]) -> bool:
    """Whether worker ``shard`` = (index, count) watches ``run``."""
    index, count = shard
    return count <= 1 or shard_of(run, count) == index


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/K"`` (worker I of K, 0 <= I < K <= MAX_WORKERS) as (I, K); ValueError with the reason."""
    index, sep, count = text.partition("/")
    if not sep or not index.isdigit() or not count.isdigit():
        raise ValueError(f"{text[:40]!r}: expected I/K, as 0/2")
    i, k = int(index), int(count)
    if not 1 <= k <= MAX_WORKERS or not 0 <= i < k:
        raise ValueError(f"{text[:40]!r}: need 0 <= I < K <= {MAX_WORKERS}")
    return i, k
