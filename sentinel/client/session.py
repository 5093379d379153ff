"""RunSession: everything a training loop in RUN_DIR needs to be watched and steered, in one object.

No torch. The Hugging Face and Lightning callbacks are thin layers over it, and so is a loop of your own::

    session = RunSession("runs/my-run", host=my_host)      # the bus, the step log, the control loop
    session.begin(step)                                     # once the state is loaded (0: fresh)
    for each step:
        session.log_step(step, loss=..., grad_norm=..., lr=..., tokens=..., sample_ids=ids)
        session.poll(step)                                   # directives: applied, logged, acked
        if session.control.stop_requested: break
    session.close()

What it wires (rank 0 only talks to the bus; every rank must call ``begin`` and ``poll``):

- **the bus**: the run's embedded valkey in ``RUN_DIR/bus`` by default (``redis_url="embedded"``, as
  ``--redis-url embedded`` does for our trainer), a Redis URL, or ``None`` (env ``SENTINEL_REDIS_URL``, else
  embedded). The embedded bus, its URL and the directive secret exist from the moment the session is
  constructed, so ``sentinel run RUN_DIR`` can be started any time after that (before, the directory has
  no bus yet and ``sentinel run`` says so); call :func:`prepare` at the top of a script to have it earlier.
- **the run**: its id is the run dir's name (``sentinel.rundir.run_id_of``: what every CLI command and the
  daemon use); the run registry entry names the dir, world size, model and framework.
- **steps.jsonl** in our trainer's layout (``StepLog``), so ``sentinel status / incidents / pages / report /
  backtest RUN_DIR`` read it; a second session in the same dir continues its timelines (``begin`` writes a
  ``start`` or ``resume`` marker with a timeline above every earlier one).
- **the control loop** (:class:`sentinel.client.control.ControlLoop`): dedupe, skip list, markers, acks.
- **Prometheus**: the ``training_*`` metrics the dashboards and alerts read (``metrics_port``: None for
  none, 0 for a free port), and ``RUN_DIR/metrics_targets.json`` for file-based service discovery.
- **checkpoints**: :meth:`checkpoint_saved` gives any directory a manifest and registers it on the bus.

The embedded bus is stopped by :meth:`close` when no other client (a ``sentinel run`` watching the run, a
CLI command) is connected to it: the views (``sentinel status / incidents / report RUN_DIR``) read the run
dir's files when its bus is down. A bus a ``sentinel run`` still reads is left running for it (its
supervisor would only restart it); stop it later with :func:`stop_bus`.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sentinel.client.bus import BusClient
from sentinel.client.checkpoints import (
    checkpoint_info,
    link_into_run_dir,
    unlink_missing,
)
from sentinel.client.control import Applied, ControlHost, ControlLoop
from sentinel.client.held_steps import HeldSteps
from sentinel.client.skiplist import SkipList
from sentinel.client.steplog import StepLog, clean_text, write_and_publish
from sentinel.contract.ranges import batch_fingerprint, id_list
from sentinel.protocol import Keys, StepRecord

EMBEDDED = "embedded"
BUS_ROUND_TRIP_S = 0.5  # the bus client's own round trips (directives read, step records sent). A round trip costs
# its I/O thread 0.2-0.4 ms of CPU beside a tiny model's step, whatever it carries. Every batch of step records
# (every 0.1 s, or 0.25 s when kicked: held_steps) makes a round trip at once, and it reads the directives too


class SessionError(Exception):
    """A one-line reason the session cannot start (a bad run dir, run id or bus)."""


def run_id_for(run_dir: str | os.PathLike) -> str:
    """The run id every sentinel command derives from a run dir (its ``config.yaml`` ``run_id``, else its name)."""
    from sentinel.rundir import run_id_of

    return clean_text(run_id_of(Path(run_dir)))


def _resolve_url(run_dir: Path, redis_url: str | None) -> tuple[str, bool, Callable[[], str] | None]:
    """(url, started_here, reconnect) for ``redis_url`` ("embedded", a URL, or None: env, else embedded)."""
    from sentinel import bus

    url = redis_url if redis_url is not None else (os.environ.get(bus.ENV_URL) or EMBEDDED)
    if url != EMBEDDED:
        return url, False, None
    from sentinel.embedded import ensure_embedded, restart_if_dead

    try:
        url, started = restart_if_dead(run_dir)
    except bus.BusError as e:
        raise SessionError(str(e)) from None

    def reconnect() -> str:  # the embedded bus's supervisor: a dead bus is restarted from its AOF
        return ensure_embedded(run_dir)

    return url, started, reconnect


def prepare(run_dir: str | os.PathLike, redis_url: str | None = EMBEDDED) -> Path:
    """Create ``run_dir`` and, for the embedded bus, start it (URL and secret in ``RUN_DIR/bus``), so that
    ``sentinel run RUN_DIR`` can attach before training starts. Idempotent; returns the run dir."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if (redis_url if redis_url is not None else (os.environ.get("SENTINEL_REDIS_URL") or EMBEDDED)) == EMBEDDED:
        _resolve_url(run_dir, EMBEDDED)
    return run_dir


def other_clients(url: str) -> int:
    """How many connections other than this probe a Redis has (-1: it cannot be asked)."""
    from sentinel import bus

    try:
        r = bus.connect(url, check=False, timeout=2.0, retries=0)
        try:
            return max(0, len(r.client_list()) - 1)
        finally:
            r.close()
    except Exception:  # noqa: BLE001 - a bus that is down or refuses CLIENT LIST: 'unknown'
        return -1


def stop_bus(run_dir: str | os.PathLike) -> bool:
    """Stop the run's embedded bus (it saves its data first); True when one was running."""
    from sentinel.embedded import stop_embedded

    return stop_embedded(run_dir)


class RunSession:
    """Everything a training loop in RUN_DIR needs to be watched and steered (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, *, host: ControlHost, redis_url: str | None = EMBEDDED,
                 run: str | None = None, rank: int = 0, world_size: int = 1, broadcast: Callable[[Any], Any] | None = None,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1", model: str = "custom",
                 framework: str = "custom", device: str = "cpu",
                 log: Callable[[str], None] | None = None):
        self.run_dir = Path(run_dir)
        self.rank, self.world_size = int(rank), int(world_size)
        self.is_main = self.rank == 0
        self.framework = framework
        self._log = log or (lambda m: print(f"[sentinel] {m}", flush=True))
        if self.is_main:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise SessionError(f"cannot create run directory {self.run_dir}: {e.strerror or e}") from None
        self.run = self._run_id(run)
        self.bus: BusClient | None = None  # rank 0 only
        self.steplog: StepLog | None = None
        self.url: str | None = None
        self._embedded = False
        self._closed = False
        self._tokens = 0
        self._last_ckpt: float | None = None
        self._last_time: float | None = None
        self._last_written: StepRecord | None = None
        self._held = HeldSteps(self._write_steps, self._send_soon)  # step records not yet written (log_step)
        if self.is_main:
            self.steplog = StepLog(self.run_dir / "steps.jsonl", log=self._log)
            self._connect(redis_url, model)
        self.metrics = self._serve_metrics(metrics_port, metrics_host, model, device) if metrics_port is not None else None
        self.skip = SkipList.load(self.run_dir / "skiplist.json")
        self.control = ControlLoop(self.run_dir, self.run, host=host, bus=self.bus, steplog=self.steplog,
                                   is_main=self.is_main, broadcast=broadcast, metrics=self.metrics, log=self._log,
                                   skip=self.skip, before_write=self.write_held)

    # ------------------------------------------------------------------ setup
    def _run_id(self, run: str | None) -> str:
        rid = run_id_for(self.run_dir) if self.run_dir.is_dir() else clean_text(self.run_dir.resolve().name)
        if run is not None and run != rid:
            raise SessionError(f"run id {run!r} differs from {rid!r}, the id every sentinel command derives from "
                               f"{self.run_dir}: leave run=None, or name the directory {run!r}")
        try:
            Keys(rid)
        except ValueError as e:
            raise SessionError(f"run directory {self.run_dir}: {e}") from None
        return rid

    def _connect(self, redis_url: str | None, model: str) -> None:
        from sentinel import bus

        self.url, _started, reconnect = _resolve_url(self.run_dir, redis_url)
        self._embedded = reconnect is not None
        try:
            secret = bus.load_secret(self.run_dir)
            self.bus = BusClient(self.url, self.run, secret, start_after_id="0-0",
                                 cursor_file=self.run_dir / "directives.cursor", reconnect=reconnect,
                                 poll_interval_s=BUS_ROUND_TRIP_S)
        except bus.BusError as e:
            raise SessionError(str(e)) from None
        self.bus.register({"run_dir": str(self.run_dir.resolve()), "world_size": self.world_size, "model": model,
                           "framework": self.framework, "started": time.time()})

    def _serve_metrics(self, port: int, host: str, model: str, device: str):
        from sentinel.client.metrics import TrainerMetrics
        from sentinel.client.targets import write_targets

        m = TrainerMetrics(run=self.run, rank=self.rank, world_size=self.world_size, model=model,
                           parallelism="ddp" if self.world_size > 1 else "single", device=device, dtype="fp32")
        bound = m.serve(host, port + self.rank if port else 0)
        if self.is_main:  # with a base port every rank's is known; with 0 only this rank's
            targets = [(host, port + r, r) for r in range(self.world_size)] if port else [(host, bound, 0)]
            write_targets(self.run_dir, self.run, targets)
        return m

    # ------------------------------------------------------------------ the loop's calls
    def begin(self, step: int, *, checkpoint: str | None = None, tokens: int | None = None) -> None:
        """Training state loaded: fresh (``step`` 0) or resumed at ``step`` from ``checkpoint``; writes the
        marker (a pending relaunch rollback becomes the ``rollback`` marker)."""
        self.control.begin(int(step), checkpoint=checkpoint)
        self._tokens = int(tokens or 0)
        self._last_time = None

    def log_step(self, step: int, *, loss: float, grad_norm: float | None = None, lr: float | None = None,
                 tokens: int | None = None, batch_tokens: int | None = None, sample_ids: Iterable[int] = (),
                 step_time_s: float | None = None, loss_max_rank: float | None = None,
                 rank_losses: list[float] | None = None) -> None:
        """One optimizer step done: a ``StepRecord`` to steps.jsonl and the bus, and the metrics (rank 0; other
        ranks only update their own metrics). ``tokens``: cumulative tokens trained (None: the running sum
        of ``batch_tokens``); ``sample_ids``: the global ids of the step's batch (what a rollback skips).

        ``loss``, ``loss_max_rank`` and ``grad_norm`` may be 0-dim tensors and ``sample_ids`` a tensor (or
        anything with ``tolist()``): rank 0 reads them when it builds the record, on its writer thread, so the
        loop's thread never waits for the device at a step (no ``.item()`` sync). With ``metrics_port`` set
        they are read here, for the metrics."""
        now, dt = self._tick()
        if step_time_s is None:
            step_time_s = dt
        if batch_tokens:
            self._tokens += int(batch_tokens)
        total = int(tokens) if tokens is not None else self._tokens
        if self.metrics:
            loss = float(loss)
            grad_norm = float(grad_norm) if grad_norm is not None else None
            self.metrics.on_step(step=step, loss=loss if self.is_main else None, rank_loss=loss,
                                 grad_norm=grad_norm if self.is_main else None, lr=lr, tokens_total=total,
                                 step_seconds=step_time_s or 0.0, phases={}, step_tokens=int(batch_tokens or 0),
                                 grad_clipped=False, skipped_reason=None, skipped_samples=0,
                                 loaded_tokens=int(batch_tokens or 0), useful_tokens=int(batch_tokens or 0), mfu=None)
        if not self.is_main:
            return
        # the loop's thread only keeps the values: the records are built, written (one write) and queued for the
        # bus in a batch, off the loop's time when the integration kicks (sentinel.client.held_steps)
        self._held.add((int(step), self.control.timeline, {
            "loss": loss, "loss_max_rank": loss_max_rank, "rank_losses": rank_losses, "grad_norm": grad_norm, "lr": lr,
            "tokens": total, "batch_tokens": batch_tokens, "step_time_s": step_time_s,
            "sample_ids": sample_ids if hasattr(sample_ids, "tolist") else list(sample_ids)}, now, self._last_ckpt, None), now)

    def log_step_later(self, step: int, values: Callable[[], dict]) -> None:
        """:meth:`log_step`, with the step's values read when its record is built: ``values()`` returns
        log_step's keyword arguments (``loss``, ``sample_ids``, ``batch_tokens``, ``tokens``...). On rank 0 it
        runs on the writer thread, in step order, off the loop's time, so it must only read what it was given
        (the step's outputs and batch) and what no later step changes. With metrics, or on another rank, it
        runs now. The integrations use it: the loop's thread then only keeps references at a step."""
        if self.metrics is not None or not self.is_main:
            self.log_step(step, **values())
            return
        now, dt = self._tick()
        self._held.add((int(step), self.control.timeline, values, now, self._last_ckpt, dt), now)

    def _tick(self) -> tuple[float, float | None]:
        """Now, and the seconds since the last step was logged (None for the first)."""
        now, last = time.time(), self._last_time
        self._last_time = now
        return now, (None if last is None else now - last)

    def kick(self) -> None:
        """The loop is about to run a while without the GIL (a backward pass): the held step records are
        built and sent now on a writer thread, off the loop's time (see ``sentinel.client.held_steps``)."""
        if self.is_main:
            self._held.kick()

    def write_held(self) -> None:
        """Write and queue for the bus every step record :meth:`log_step` holds, now (rank 0)."""
        if self.is_main:
            self._held.drain()

    def _write_steps(self, held: list[tuple]) -> None:
        from sentinel.protocol import finite_or_none

        for step, timeline, v, now, last_ckpt, dt in held:
            if callable(v):  # log_step_later: the values are read now
                v = v()
                if v.get("batch_tokens"):
                    self._tokens += int(v["batch_tokens"])
                if v.get("tokens") is None:
                    v["tokens"] = self._tokens
                if v.get("step_time_s") is None:
                    v["step_time_s"] = dt
            loss, loss_max_rank, grad_norm, lr = v["loss"], v.get("loss_max_rank"), v.get("grad_norm"), v.get("lr")
            total, batch_tokens, step_time_s = v["tokens"], v.get("batch_tokens"), v["step_time_s"]
            ids = id_list([v.get("sample_ids", ())])
            loss_f = float(loss)  # a tensor: one read (its max over ranks is often the same tensor)
            rec = StepRecord(
                run=self.run, step=step, timeline=timeline, loss=loss_f,
                loss_max_rank=loss_f if loss_max_rank is None or loss_max_rank is loss else float(loss_max_rank),
                rank_losses=v.get("rank_losses"),
                grad_norm=float(grad_norm) if grad_norm is not None else 0.0, lr=float(lr or 0.0), tokens=total,
                batch_tokens=int(batch_tokens or 0), batch_fingerprint=batch_fingerprint(ids), sample_ids=ids, time=now,
                step_seconds=finite_or_none(step_time_s),
                tokens_per_second=(batch_tokens / step_time_s) if batch_tokens and step_time_s else None,
                checkpoint_age_seconds=(now - last_ckpt) if last_ckpt else None, world_size=self.world_size,
            )
            self._last_written = rec
            write_and_publish(rec, self.steplog, self.bus, flush=False)
        self.steplog.flush()

    def _send_soon(self) -> None:
        if self.bus is not None:
            self.bus.send_soon()

    def log_eval(self, step: int, *, val_loss: float) -> None:
        """A validation pass at ``step``: the step's record again with ``val_loss`` / ``val_ppl`` (the last
        record of a step is the authoritative one), and the validation metrics."""
        if self.metrics:
            self.metrics.on_validation(val_loss)
        if not self.is_main:
            return
        self.write_held()
        last = self._last_written
        if last is None or last.step != step:
            return
        rec = last.model_copy(update={"val_loss": float(val_loss),
                                      "val_ppl": math.exp(val_loss) if val_loss < 700 else None, "time": time.time()})
        self._last_written = rec
        write_and_publish(rec, self.steplog, self.bus)

    def checkpoint_saved(self, step: int, path: str | os.PathLike, *, seconds: float = 0.0) -> None:
        """The framework finished writing checkpoint ``step`` at ``path`` (any directory of files): a
        manifest (a checksum per file) when it has none, a ``RUN_DIR/checkpoints/step-N`` link to it, and its
        ``CheckpointInfo`` on the bus: from now on a rollback may go there. Rank 0 only (others return)."""
        if not self.is_main:
            return
        self.write_held()  # the steps up to the checkpoint are in steps.jsonl before a rollback may go there
        info = checkpoint_info(self.run, step, path, world_size=self.world_size, timeline=self.control.timeline,
                               tokens=self._tokens, framework=self.framework)
        with contextlib.suppress(OSError):
            link_into_run_dir(self.run_dir, step, path)
        self._last_ckpt = info.created
        if self.metrics:
            self.metrics.on_checkpoint(ok=True, seconds=seconds, size_bytes=info.bytes, timestamp=info.created)
        if self.bus:
            self.bus.register_checkpoint(info)

    def retain_checkpoints(self) -> None:
        """The framework deleted old checkpoints (retention): drop their links, and their entries on the bus
        (a rollback must not be sent to a checkpoint that is gone)."""
        if self.is_main:
            steps = unlink_missing(self.run_dir)
            if self.bus:
                self.bus.retain_checkpoints(steps)

    def poll(self, step: int) -> list[Applied]:
        """At a step boundary, on every rank: apply the directives that arrived (see ``ControlLoop.poll``)."""
        return self.control.poll(int(step))

    def hold_while_paused(self, step: int, *, max_pause_s: float | None = None) -> list[Applied]:
        """Block while paused (until ``resume``, ``stop``, or ``max_pause_s``); returns what was applied."""
        t0 = time.monotonic()
        give_up = (lambda: time.monotonic() - t0 > max_pause_s) if max_pause_s is not None else None
        out = self.control.hold_while_paused(int(step), give_up=give_up)
        if self.control.paused and not self.control.stop_requested:  # max_pause_s passed: go on, and say so
            self.control.paused = False
            if self.bus:
                self.bus.set_paused(False)
            self._log(f"paused for {max_pause_s:.0f}s with no resume (max_pause_s): training goes on")
        return out

    def end(self, step: int, detail: str | None = "completed") -> None:
        """The run ended on purpose at ``step`` (its last step; ``detail``: "completed", "stopped"...): a
        ``run_end`` marker, so that a watching sentinel does not page "trainer hung" once the run's heartbeat
        goes quiet. A crash must not call it. Call before :meth:`close`."""
        if not self._closed:
            self.control.end(step, detail)

    def close(self) -> None:
        """Flush the step log and the bus, stop serving metrics; stop the embedded bus when this session
        started it and nobody else is connected (a ``sentinel run`` still watching keeps it)."""
        if self._closed:
            return
        if self.is_main:
            self._held.close()
        self._closed = True
        if self.steplog:
            self.steplog.close()
        if self.bus:
            self.bus.flush(timeout=5.0)
            self.bus.close()
        if self.metrics:
            self.metrics.close()
        if self._embedded and self.url:
            n = other_clients(self.url)
            if n == 0:
                with contextlib.suppress(Exception):
                    stop_bus(self.run_dir)
                    self._log(f"embedded bus of {self.run_dir} stopped (nobody else was connected)")
            elif n > 0:
                self._log(f"embedded bus of {self.run_dir} left running: {n} other client(s) connected "
                          "(a `sentinel run`?); stop it later with sentinel.client.session.stop_bus(RUN_DIR)")

    def __enter__(self) -> RunSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
