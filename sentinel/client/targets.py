"""``RUN_DIR/metrics_targets.json``: the Prometheus file-SD list of this run's per-rank endpoints.

Prometheus re-reads the file when it changes, so a resumed run with new ports (or a different
world size) is picked up without touching Prometheus. The file is replaced atomically: Prometheus
must never read half a JSON document.

Target labels are ``run`` and ``rank``. They equal the ``run``/``rank`` labels the endpoint itself
exports, so with ``honor_labels: true`` (see docs/metrics.md) they never clash: the exported value
wins and is the same anyway. Rank 0's global series carry no ``rank`` in the exposition and pick up
the target's ``rank="0"``; the recommended scrape config removes it again.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path

TARGETS_FILE = "metrics_targets.json"
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def rank_port(base_port: int, local_rank: int) -> int:
    """The port rank ``local_rank`` serves on: ``base_port + local_rank``; 0 stays 0 (pick a free one)."""
    return 0 if base_port == 0 else base_port + local_rank


def _address(host: str, port: int) -> str:
    """``host:port`` as Prometheus wants it: brackets around IPv6, no wildcard bind addresses."""
    if host in _WILDCARD_HOSTS:  # a bind-all address is not somewhere a scraper can connect to
        host = socket.gethostname()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{int(port)}"


def target_groups(run: str, targets: list[tuple[str, int, int]]) -> list[dict]:
    """One file-SD group per rank (each needs its own ``rank`` label), sorted by rank."""
    seen: set[int] = set()
    groups = []
    for host, port, rank in sorted(targets, key=lambda t: t[2]):
        if rank in seen:
            raise ValueError(f"rank {rank} listed twice")
        if not 0 < int(port) < 65536:
            raise ValueError(f"rank {rank}: invalid port {port}")
        seen.add(rank)
        groups.append({"targets": [_address(host, port)], "labels": {"run": run, "rank": str(rank)}})
    return groups


def write_targets(run_dir: str | os.PathLike, run: str, targets: list[tuple[str, int, int]]) -> Path:
    """Atomically write ``RUN_DIR/metrics_targets.json`` for ``targets`` = [(host, port, rank), ...].

    Call it on global rank 0 after gathering every rank's bound port. Returns the file's path.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / TARGETS_FILE
    data = json.dumps(target_groups(run, targets), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{TARGETS_FILE}.", dir=run_dir)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a Prometheus under another user must read it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path
