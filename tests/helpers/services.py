"""Real services for the tests: free ports, binaries that must exist under CI, a Debian redis-server we own,
the small process helpers the Prometheus / Alertmanager tests share, and ``talker``: a TCP server that
answers whatever it is sent with what a test says. No pytest fixtures here (those are in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

DEBIAN_REDIS = "/usr/bin/redis-server"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def skip_or_fail(reason: str) -> None:
    """A missing prerequisite fails under CI (so CI can't go green by skipping) and skips locally."""
    if in_ci():
        pytest.fail(f"{reason} (required under CI)")
    pytest.skip(reason)


def require_binary(name: str) -> str:
    """Path of executable ``name`` (a bare name on PATH or an absolute path), else skip/fail."""
    path = name if os.path.isabs(name) else shutil.which(name)
    if not path or not os.access(path, os.X_OK):
        skip_or_fail(f"binary {name!r} not found")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before listening on {port}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


@dataclass
class RedisProc:
    """A foreground Debian redis-server we own: ``stop()`` and ``start()`` again on the same port."""

    binary: str
    workdir: Path
    port: int
    args: list[str] = field(default_factory=list)
    listen_port: int | None = None  # the port to wait on (the TLS port when --port 0)
    scheme: str = "redis"
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.listen_port or self.port}/0"

    @property
    def log(self) -> Path:
        return self.workdir / "redis.log"

    def start(self) -> RedisProc:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(self.log), *self.args]  # fmt: skip
        self.proc = subprocess.Popen(argv, cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_port(self.listen_port or self.port, proc=self.proc)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}: {self.log_tail()}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)
            if self.proc.stderr:
                self.proc.stderr.close()
        self.proc = None

    def log_tail(self, n: int = 5) -> str:
        text = ""
        with contextlib.suppress(OSError):
            text = self.log.read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-n:])


def find_binary(name: str) -> str:
    return require_binary(shutil.which(name) or f"/usr/bin/{name}")


class Webhook:
    """A tiny Alertmanager webhook receiver: records every notification body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server API)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with contextlib.suppress(ValueError):
                    outer.bodies.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def alerts(self) -> list[dict]:
        return [a for b in list(self.bodies) for a in b.get("alerts", [])]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_logged(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def stop_process(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def wait_http_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args[0]} exited {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1):
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready after {timeout}s: {log.read_text()[-2000:]}")


def talker(first: bytes | None, then: bytes = b"", *, pause: float = 0.0, got: list[bytes] | None = None,
           sent: list[int] | None = None) -> tuple[int, threading.Event]:
    """A TCP server on 127.0.0.1 that reads a connection's first bytes (into ``got``), answers ``first``
    (None: nothing, until stopped), then sends ``then`` for ever, ``pause`` seconds apart, until
    stopped; ``sent`` gets the bytes each connection got out. (Its port, the event that stops it.)"""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    stop = threading.Event()

    def one(c: socket.socket) -> None:
        n = 0
        if sent is not None:
            sent.append(0)
        try:
            data = c.recv(65536)
            if got is not None:
                got.append(data)
            if first is None:
                stop.wait()
                return
            c.sendall(first)
            while then and not stop.is_set():
                c.sendall(then)
                n += len(then)
                if pause:
                    stop.wait(pause)
                if sent is not None:
                    sent[-1] = max(sent[-1], n)
        except OSError:
            pass
        finally:
            c.close()

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=one, args=(c,), daemon=True).start()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], stop
