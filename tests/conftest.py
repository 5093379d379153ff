"""Shared test fixtures: real Redis/valkey servers, no mocks.

* ``embedded_bus``  - the run's embedded valkey (``sentinel.embedded``), stopped at teardown.
* ``redis_server``  - Debian's ``/usr/bin/redis-server`` on a free port, no persistence.
* ``redis_factory`` - start more Debian servers with extra args (AUTH, ACL users, TLS).
* ``redis_url``     - parametrised over both kinds of server: ``params=["embedded", "debian"]``.
* ``unique_run``    - a unique, valid run id per test, so tests never share keys.
* ``require_binary(name)`` - a missing binary fails the test under CI (CI=true), skips otherwise.

Tiers (docs/testing.md): a test that starts a service (a Redis/valkey server, Prometheus, Alertmanager)
or another process (a trainer, torchrun, ``python -m sentinel``) is marked ``slow`` here at collection,
from its fixtures and its own source (and the module functions it calls), so ``-m "not slow"``
(``make check``) is the in-process tier.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from trainer_helpers import dataset, refs  # noqa: F401  (session fixtures every module sees: one dataset, one cache of runs)

DEBIAN_REDIS = "/usr/bin/redis-server"
TESTS = Path(__file__).resolve().parent

# what starts a service or a process, in the source of a test, its fixtures or the module functions it calls
STARTS_PROCESS = re.compile(
    r"\b(subprocess\.(run|Popen|check_output|check_call|call)|Popen\(|run_trainer|make_run|reference_run|trainer_cmd"
    r"|ensure_embedded|embedded_bus|redis_server|redis_factory|redis_url|require_binary|launch_workers|torchrun"
    r"|multiprocessing|mp\.Process|os\.fork|refs\("
    r"|\bTrainer\(|build_trainer\()")  # and what trains a model in-process (seconds a run)


@functools.cache
def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _ours(obj) -> bool:
    """A function or class defined in tests/ (this module's, or imported from a helper or another test module)."""
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return False
    mod = sys.modules.get(getattr(obj, "__module__", "") or "")
    return Path(getattr(mod, "__file__", None) or "/").resolve().parent == TESTS


@functools.cache
def _process_starters(module) -> frozenset[str]:
    """Names of the module's functions that start a service or a process, directly or through one another."""
    funcs = {n: _source(f) for n, f in vars(module).items() if _ours(f)}
    found = {n for n, src in funcs.items() if STARTS_PROCESS.search(src)}
    while True:
        call = re.compile(r"\b(" + "|".join(map(re.escape, found)) + r")\(") if found else None
        more = {n for n, src in funcs.items() if n not in found and call and call.search(src.split("\n", 1)[-1])}
        if not more:
            return frozenset(found)
        found |= more


def _starts_processes(item) -> bool:
    fn = getattr(item, "function", None)
    if fn is None:
        return False
    starters = _process_starters(item.module)
    sources = [_source(fn).split("\n", 1)[-1]]  # the body: not the decorator or the signature's fixture names
    infos = getattr(item, "_fixtureinfo", None)
    for name in (infos.names_closure if infos else ()):
        for fdef in infos.name2fixturedefs.get(name, ()):
            if fdef.baseid == "" and fdef.func.__module__ in ("_pytest.tmpdir", "_pytest.monkeypatch"):
                continue
            if name in ("embedded_bus", "redis_server", "redis_factory", "redis_url", "refs"):
                return True
            sources.append(_source(fdef.func).split("\n", 1)[-1])
    call = re.compile(r"\b(" + "|".join(map(re.escape, starters)) + r")\(") if starters else None
    return any(STARTS_PROCESS.search(src) or (call and call.search(src)) for src in sources)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and _starts_processes(item):
            item.add_marker(pytest.mark.slow)


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


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisProc]]:
    """Start Debian redis-servers with extra args; all are killed at teardown."""
    binary = require_binary(DEBIAN_REDIS)
    procs: list[RedisProc] = []

    def start(args: list[str] | None = None, *, port: int | None = None, listen_port: int | None = None, scheme: str = "redis") -> RedisProc:
        workdir = tmp_path / f"redis-{len(procs)}"
        workdir.mkdir()
        p = RedisProc(binary, workdir, free_port() if port is None else port, list(args or []), listen_port, scheme)
        procs.append(p)
        return p.start()

    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def redis_server(redis_factory) -> RedisProc:
    """Debian redis-server on a free port, no persistence; ``.stop()``/``.start()`` for outages."""
    return redis_factory()


@dataclass
class EmbeddedBus:
    run_dir: Path
    url: str


@pytest.fixture
def embedded_bus(tmp_path: Path) -> Iterator[EmbeddedBus]:
    """The embedded valkey bus of a fresh run dir; shut down (and killed if need be) at teardown."""
    from sentinel.embedded import PID_FILE, bus_dir, ensure_embedded, stop_embedded

    run_dir = tmp_path / "run"
    url = ensure_embedded(run_dir)
    yield EmbeddedBus(run_dir, url)
    try:
        stop_embedded(run_dir)
    finally:
        with contextlib.suppress(ValueError, OSError):
            os.kill(int((bus_dir(run_dir) / PID_FILE).read_text()), signal.SIGKILL)


@pytest.fixture(params=["embedded", "debian"])
def redis_url(request) -> str:
    """A bus URL, once against the embedded valkey and once against Debian's redis-server."""
    if request.param == "embedded":
        return request.getfixturevalue("embedded_bus").url
    return request.getfixturevalue("redis_server").url


@pytest.fixture
def unique_run(request) -> str:
    """A run id unique to this test (valid for ``Keys``), so tests never share keys."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name).strip("-")[:40]
    return f"t-{base}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def numerics_flags() -> Iterator[None]:
    """Restores torch's process-wide switches that ``trainer.determinism.make_deterministic`` flips
    (deterministic algorithms, the attention kernels) after the test."""
    import torch

    b = torch.backends.cuda
    saved = (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.cudnn_sdp_enabled(), b.math_sdp_enabled(),
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    b.enable_flash_sdp(saved[0])
    b.enable_mem_efficient_sdp(saved[1])
    b.enable_cudnn_sdp(saved[2])
    b.enable_math_sdp(saved[3])
    torch.use_deterministic_algorithms(saved[4], warn_only=saved[5])
