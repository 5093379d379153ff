"""``RUN_DIR/steps.jsonl``: one JSON object per optimizer step, append-only.

Floats are written with the shortest repr that round-trips exactly (NaN/Infinity as JSON
constants). After a resume or rollback the re-run steps are appended again behind a
TimelineRecord; the last record for a step number is the authoritative one
(``sentinel.protocol.authoritative_steps``).
"""

from __future__ import annotations

import os
from pathlib import Path

from sentinel.protocol import StepRecord, TimelineRecord, authoritative_steps, parse_step_line


class StepLog:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_torn_tail()
        self._f = open(self.path, "a", buffering=1)

    def _repair_torn_tail(self) -> None:
        """A SIGKILL mid-write can leave a partial last line: cut it so the log stays valid JSONL."""
        if not self.path.is_file() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) == b"\n":
                return
            f.seek(0)
            data = f.read()
            cut = data.rfind(b"\n") + 1
            f.truncate(cut)

    def write(self, rec: StepRecord | TimelineRecord) -> None:
        self._f.write(rec.to_json() + "\n")

    def last_timeline(self) -> int:
        last = -1
        for r in read(self.path):
            last = max(last, r.timeline)
        return last

    def close(self) -> None:
        self._f.close()


def read(path: Path):
    """Yield every record of a steps.jsonl (skipping a torn final line)."""
    p = Path(path)
    if not p.is_file():
        return
    with open(p, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break  # torn tail from a crash
            if line.strip():
                yield parse_step_line(line)


def authoritative(path: Path) -> dict[int, StepRecord]:
    return authoritative_steps(read(path))
