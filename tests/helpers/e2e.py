"""Processes of an end-to-end run (trainer, sentinel, buses), started with a clean environment and all stopped at the end."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers.trainer import kill_all

ROOT = Path(__file__).resolve().parents[2]


def clean_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k in ("SENTINEL_REDIS_URL", "SENTINEL_SECRET", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


class Procs:
    """Processes a test started (each in its own session); all killed at exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        with open(log, "ab") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 start_new_session=True, cwd=ROOT)  # fmt: skip
        self.procs.append(p)
        return p

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                kill_all(p)  # with torchrun's workers, which have their own sessions
