"""The trainer's metrics as docs/metrics.md documents them."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def documented() -> dict[str, dict]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        m = re.match(r"^\| `(training_[a-z_]+)` \| ([^|]+) \| ([^|]+) \| ([^|]+) \|", line)
        if m:
            name, typ, labels, who = (g.strip() for g in m.groups())
            rows[name] = {
                "type": typ.split()[0],
                "labels": {x.strip() for x in labels.split(",")},
                "who": who,
            }
    assert len(rows) >= 30, "could not parse the metrics table in docs/metrics.md"
    return rows


def cuda_only(row: dict) -> bool:
    return "CUDA only" in row["who"]
