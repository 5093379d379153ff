"""A throwaway Debian ``redis-server`` on loopback for the benches that need a real bus."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(work: Path) -> tuple[subprocess.Popen, str]:
    """Start ``redis-server`` (no persistence) on a free port; return the process and its URL."""
    exe = shutil.which("redis-server")
    if not exe:
        raise SystemExit("error: redis-server not found (Debian: apt-get install redis-server)")
    port = free_port()
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(work)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return p, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    p.kill()
    raise SystemExit("error: redis-server did not start")


def redis_version() -> str:
    out = subprocess.run([shutil.which("redis-server") or "redis-server", "--version"], capture_output=True, text=True).stdout
    return (out.split()[2] if len(out.split()) > 2 else out.strip()).removeprefix("v=")
