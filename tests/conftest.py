"""The fixtures every component's tests share: real Redis/valkey servers, trained runs, no mocks.

* ``embedded_bus``  - the run's embedded valkey (``sentinel.embedded``), stopped at teardown.
* ``redis_server``  - Debian's ``/usr/bin/redis-server`` on a free port, no persistence.
* ``redis_factory`` - start more Debian servers with extra args (AUTH, ACL users, TLS).
* ``redis_url``     - parametrised over both kinds of server: ``params=["embedded", "debian"]``.
* ``unique_run``    - a unique, valid run id per test, so tests never share keys.
* ``dataset``, ``refs``  - the prepared corpus and the session's cache of trained runs (tests/helpers/trainer.py).
* ``base_run``, ``run_copy`` - the finished 30-step run the CLI and offline tests read, and a copy of it
  (tests/helpers/cli.py).

Plain functions and classes (``require_binary``, ``free_port``, ``make_daemon`` ...) live in tests/helpers/;
no test module imports another.

Tiers (docs/testing.md): a test that starts a service (a Redis/valkey server, Prometheus, Alertmanager)
or another process (a trainer, torchrun, ``python -m sentinel``) is marked ``slow`` here at collection,
from its fixtures and its own source (and the functions of its module or of tests/helpers it calls), so ``-m "not slow"``
(``make check``) is the in-process tier.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

# One intra-op thread in every process the suite starts, before anything imports torch: the trained runs a test
# compares bitwise (tests/helpers/offline.py's, the in-process replays of verify-resume and replay-batch, and
# tests/helpers/trainer.py's, which set it already) must all have it. With torch's default (a thread per core) a
# loaded machine gave a tiny run's step 1 another param digest in about 1 run of 8, at d46b457 as here, so
# test_the_initial_checkpoint_is_equivalent failed now and then; with one thread, 6 of 6 runs agreed.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from tests.helpers.cli import base_run, run_copy  # noqa: F401  (the 30-step run the CLI and offline tests share)
from tests.helpers.services import DEBIAN_REDIS, RedisProc, free_port, require_binary
from tests.helpers.trainer import dataset, refs  # noqa: F401  (session fixtures every module sees: one dataset, one cache of runs)
from tests.helpers.xdist_modules import module_scheduler, spreads

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
    """A function or class defined under tests/ (the test module's own, or imported from tests/helpers)."""
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return False
    mod = sys.modules.get(getattr(obj, "__module__", "") or "")
    return TESTS in Path(getattr(mod, "__file__", None) or "/").resolve().parents


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


def pytest_configure(config) -> None:
    # a suite started in the background by a script (`make test &`) inherits SIGINT ignored, and so would every
    # process a test starts: a `sentinel status --watch` would then stay up on Ctrl-C, as under nohup. The
    # tests send SIGINT as a person's Ctrl-C does, so the suite takes SIGINT back (children get the default)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.get_closest_marker("slow") is None and _starts_processes(item):
            item.add_marker(pytest.mark.slow)
    # under `make test` (xdist sets ``loadgroup`` on its workers) the units of a module that spreads
    # its tests go last (tests/helpers/xdist_modules.py); the order is the same on every worker
    if getattr(config.option, "loadgroup", False):
        items.sort(key=lambda item: spreads(Path(str(item.path))))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: one work unit per test module (tests/helpers/xdist_modules.py)."""
    if config.getvalue("dist") == "loadgroup":
        return module_scheduler(config, log)
    return None


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
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.utils.deterministic.fill_uninitialized_memory)
    yield
    torch.utils.deterministic.fill_uninitialized_memory = saved[6]
    b.enable_flash_sdp(saved[0])
    b.enable_mem_efficient_sdp(saved[1])
    b.enable_cudnn_sdp(saved[2])
    b.enable_math_sdp(saved[3])
    torch.use_deterministic_algorithms(saved[4], warn_only=saved[5])
