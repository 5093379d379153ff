"""Shared test helpers; this module: running a Python snippet in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def python_c(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c CODE`` from the repository's root (so that ``trainer`` and ``sentinel`` import), its
    output captured as text."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=REPO)
