"""How a bench says that a process it started failed: one line, naming the process, the last line it
wrote (its exception, as a rule) and where its whole log is kept."""

from __future__ import annotations

import sys
from pathlib import Path


class Failed(Exception):
    """A process the bench started failed, or never got where the bench waited for it."""

    def __init__(self, what: str, log: Path | None = None):
        super().__init__(what + (f": {last_line(log)} (log: {log})" if log else ""))


def last_line(log: Path) -> str:
    """The last non-blank line of a log, cut to 300 characters."""
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    return (lines[-1] if lines else "(an empty log)")[:300]


def said(prog: str, e: Failed | KeyboardInterrupt, scratch: Path, where: str = "") -> int:
    """Say a failure (or Ctrl-C) in one line on stderr, with the scratch kept for a look; the exit code."""
    at = f"{where}: " if where else ""
    if isinstance(e, KeyboardInterrupt):
        print(f"{prog}: interrupted{' at ' + where if where else ''} (scratch kept: {scratch})", file=sys.stderr)
        return 130
    print(f"{prog}: error: {at}{e} (scratch kept: {scratch})", file=sys.stderr)
    return 1
