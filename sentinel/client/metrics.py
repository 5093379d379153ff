"""The trainer's Prometheus metrics: one registry and one ``/metrics`` endpoint per rank.

Why this shape:

* **No duplicate series.** Quantities that are the same on every rank (loss, lr, step, tokens,
  checkpoints, skips, ...) are *global* and exported by rank 0 only, labelled ``run``. Quantities
  that differ per rank (its own loss, step time, phase times, memory, heartbeat, ...) are
  *per-rank*, exported by every rank and labelled ``run`` and ``rank``. Summing or averaging a
  global metric over ranks is therefore never possible by accident. docs/metrics.md lists which is
  which; tests/client/test_metrics.py keeps the two in step.
* **Cheap on the hot path.** Every labelled child is resolved once in ``__init__``; ``on_step`` is a
  handful of locked float stores and a 20-element sum. Nothing here touches the GPU: values arrive
  as host floats (the trainer copies them one step late, non-blocking). CUDA memory is read by
  callbacks at scrape time, so it costs nothing per step and is always fresh; the process's own
  RSS, CPU time, open files and start time come from prometheus-client's ``ProcessCollector``
  (``process_*``), registered on the same registry.
* **Global series need no relabel rule.** A global series carries ``rank=""``: with
  ``honor_labels: true`` an exported empty label wins over the scrape target's ``rank="0"`` and
  Prometheus then stores the series without ``rank`` (docs/metrics.md, "Scrape configuration").
* **Our own registry.** Never the process-global one, so tests and several trainers in one
  process never collide. It leaves out the ``<name>_created`` series of counters, histograms and
  summaries (:class:`MetricsRegistry`): a second series per counter that no panel or alert reads.
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
import typing
from collections import deque
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    Summary,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

from sentinel.protocol import MARKER_KINDS, MAX_SLICES, REJECT_REASONS, SLICE_NAME_RE, DirectiveKind

# 10 ms .. 60 s: from a tiny CPU smoke model to a large model with heavy grad accumulation.
STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)
# checkpoint saves: sub-second (small model, local disk) .. 20 min (sharded, network storage).
CHECKPOINT_SECONDS_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)

PHASES = ("data_wait", "forward_backward", "allreduce_wait", "optimizer", "telemetry", "control")
SKIP_REASONS = ("nonfinite", "loss_spike", "grad_spike", "directive", "fault")
DIRECTIVE_KINDS: tuple[str, ...] = typing.get_args(DirectiveKind)

# timeline events counted by training_timeline_events_total{event}: the schedule/data markers plus restarts
TIMELINE_EVENTS: tuple[str, ...] = MARKER_KINDS + ("resume", "rollback")

RUN_RANK = ("run", "rank")
GLOBAL_RANK = ""  # the `rank` of a global series: empty, so Prometheus stores none (honor_labels)


class MetricsRegistry(CollectorRegistry):
    """A ``CollectorRegistry`` that never exposes ``<name>_created`` samples.

    Per registry, unlike ``prometheus_client.disable_created_metrics()``, which would change every
    other registry of the process (an integration must not change its host's metrics)."""

    def collect(self) -> Iterable[Metric]:
        return _without_created(super().collect())

    def restricted_registry(self, names: Iterable[str]):  # a scrape with ?name[]=...
        inner = super().restricted_registry(names)

        class _Restricted:
            def collect(self) -> Iterable[Metric]:
                return _without_created(inner.collect())

        return _Restricted()


def _without_created(families: Iterable[Metric]) -> Iterable[Metric]:
    for fam in families:
        if fam.type in ("counter", "histogram", "summary", "gaugehistogram"):
            fam.samples = [s for s in fam.samples if not s.name.endswith(("_created", "_gcreated"))]
        yield fam


def _pod_name() -> str:
    """``$POD_NAME`` (the Downward API), else on Kubernetes ``$HOSTNAME`` (a pod's host name is its
    name unless the spec sets another), else ``""``."""
    if os.environ.get("POD_NAME"):
        return os.environ["POD_NAME"]
    return os.environ.get("HOSTNAME", "") if os.environ.get("KUBERNETES_SERVICE_HOST") else ""


def gpu_uuid_label(uuid: object | None) -> str:
    """A GPU UUID as nvidia-smi and the DCGM exporter's ``UUID`` label print it (``GPU-<uuid>``);
    ``torch.cuda.get_device_properties(i).uuid`` has no prefix. ``""`` when there is none."""
    text = str(uuid or "").strip()
    if not text:
        return ""
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("sentinel-train")
    except Exception:  # not installed as a distribution (e.g. a source checkout on sys.path)
        import sentinel

        return getattr(sentinel, "__version__", "unknown")


class TrainerMetrics:
    """All Prometheus metrics of one trainer rank. Build once per process; call ``on_*`` per event."""

    def __init__(
        self,
        *,
        run: str,
        rank: int,
        world_size: int,
        model: str,
        parallelism: str,
        device: str,
        dtype: str,
        registry: CollectorRegistry | None = None,
        tokens_per_second_window: int = 20,
        host: str | None = None,
        pod: str | None = None,
        gpu_uuid: object | None = None,
    ) -> None:
        """``host`` defaults to ``socket.gethostname()``, ``pod`` to ``$POD_NAME`` (set it from the
        Downward API), else ``$HOSTNAME`` on Kubernetes, else ``""``; ``gpu_uuid`` is this rank's GPU, e.g.
        ``torch.cuda.get_device_properties(i).uuid`` (``""`` on CPU). They label ``training_info``
        so that DCGM exporter series (``Hostname``, ``pod``, ``UUID``) join a run's ranks.
        ``registry`` defaults to a new :class:`MetricsRegistry`."""
        if tokens_per_second_window < 1:
            raise ValueError("tokens_per_second_window must be >= 1")
        self.registry: CollectorRegistry = registry if registry is not None else MetricsRegistry()
        self.run = run
        self.rank = int(rank)
        self.is_global_exporter = self.rank == 0
        self._server = None
        self._port: int | None = None
        self._started = time.time()
        self._checkpoint_ref = self._started  # age counts from process start until the first save
        self._dropped_seen = 0
        # (step_tokens, step_seconds, loaded_tokens, useful_tokens) of the last N steps
        self._window: deque[tuple[int, float, int, int]] = deque(maxlen=tokens_per_second_window)

        self._build_per_rank(device)
        Info("training", "Static facts about the run and where this rank runs (value is always 1).", RUN_RANK,
             registry=self.registry).labels(self.run, str(self.rank)).info({
                 "model": str(model), "world_size": str(world_size), "parallelism": str(parallelism),
                 "device": str(device), "dtype": str(dtype), "version": _version(),
                 "host": socket.gethostname() if host is None else str(host),
                 "pod": _pod_name() if pod is None else str(pod),
                 "gpu_uuid": gpu_uuid_label(gpu_uuid),
             })  # fmt: skip
        if self.is_global_exporter:
            self._build_global()

    # ------------------------------------------------------------------------------------------
    # construction
    # ------------------------------------------------------------------------------------------

    def _build_per_rank(self, device: str) -> None:
        r, lv = self.registry, (self.run, str(self.rank))
        self._rank_loss = Gauge(
            "training_rank_loss", "This rank's loss for the last step (before the cross-rank mean).", RUN_RANK, registry=r
        ).labels(*lv)
        self._step_duration = Histogram(
            "training_step_duration_seconds", "Wall time of one optimizer step on this rank.", RUN_RANK,
            buckets=STEP_SECONDS_BUCKETS, registry=r,
        ).labels(*lv)
        phase = Summary(
            "training_step_phase_seconds",
            "Time spent per step in each phase on this rank; rate(_sum) is the share of wall time.",
            RUN_RANK + ("phase",), registry=r,
        )
        self._phase = {p: phase.labels(*lv, p) for p in PHASES}
        self._effective_ratio = Gauge(
            "training_effective_token_ratio",
            "Useful tokens / loaded tokens on this rank over the recent-step window (padding and skipped samples lower it).",
            RUN_RANK, registry=r,
        ).labels(*lv)
        self._skipped_samples = Counter(
            "training_skipped_samples", "Samples this rank's loader dropped (skip list).", RUN_RANK, registry=r
        ).labels(*lv)
        self._heartbeat = Gauge(
            "training_heartbeat_timestamp_seconds", "Unix time this rank last reported being alive.", RUN_RANK, registry=r
        ).labels(*lv)
        self._heartbeat.set(self._started)
        # process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds, ... (Linux /proc);
        # they carry no labels of their own: run and rank come from the scrape target
        try:
            ProcessCollector(registry=r)
        except ValueError:  # a caller's registry that has one already (the process-global one does)
            pass
        self._dropped = Counter(
            "training_telemetry_dropped", "Telemetry records this rank could not deliver to the control bus.",
            RUN_RANK, registry=r,
        ).labels(*lv)
        self._build_cuda_memory(device)

    def _build_cuda_memory(self, device: str) -> None:
        """CUDA allocator gauges, read at scrape time; absent unless this rank runs on a CUDA device."""
        if not str(device).startswith("cuda"):
            return
        import torch  # lazy: only CUDA ranks pay for it

        if not torch.cuda.is_available():
            return
        index = torch.device(device).index
        if index is None:  # resolve now, on the training thread: the scrape thread's current device is 0
            index = torch.cuda.current_device()

        def reader(fn):
            def read() -> float:
                try:
                    return float(fn(index))
                except Exception:  # a scrape must never take the trainer down
                    return math.nan

            return read

        r, lv = self.registry, (self.run, str(self.rank))
        Gauge(
            "training_cuda_memory_allocated_bytes", "Bytes held by live tensors on this rank's GPU.", RUN_RANK, registry=r
        ).labels(*lv).set_function(reader(torch.cuda.memory_allocated))
        Gauge(
            "training_cuda_memory_reserved_bytes", "Bytes reserved by the caching allocator on this rank's GPU.",
            RUN_RANK, registry=r,
        ).labels(*lv).set_function(reader(torch.cuda.memory_reserved))

    def _build_global(self) -> None:
        r, lv = self.registry, (self.run, GLOBAL_RANK)

        def gauge(name: str, doc: str):
            return Gauge(name, doc, RUN_RANK, registry=r).labels(*lv)

        def counter(name: str, doc: str):
            return Counter(name, doc, RUN_RANK, registry=r).labels(*lv)

        self._loss = gauge("training_loss", "Global mean training loss of the last step.")
        self._val_loss = gauge("training_validation_loss", "Mean loss of the last validation pass.")
        self._grad_norm = gauge("training_grad_norm", "Global L2 norm of the gradient before clipping.")
        self._clipped = counter("training_grad_clipped_steps", "Steps whose gradient was clipped.")
        self._lr = gauge("training_learning_rate", "Learning rate used by the last step.")
        self._step = gauge("training_step", "Last completed optimizer step.")
        self._tokens = counter(
            "training_tokens", "Tokens trained by this process (non-skipped steps); rate() is training throughput."
        )
        self._trained_tokens = gauge(
            "training_trained_tokens", "The run's cumulative trained-token position (goes back on rollback)."
        )
        self._tps = gauge("training_tokens_per_second", "Global tokens/s over the recent-step window.")
        self._seq_len = gauge(
            "training_sequence_length_tokens",
            "Tokens per training sequence of the last step: model.seq_len, or the data.seq_len_schedule length in effect.",
        )
        self._mfu_family = None  # created on the first known MFU: absent when no peak is known
        self._mfu = None
        skipped = Counter("training_skipped_steps", "Steps whose update was dropped, by reason.", RUN_RANK + ("reason",),
                          registry=r)
        self._skipped_family = skipped
        self._skipped = {reason: skipped.labels(*lv, reason) for reason in SKIP_REASONS}
        self._resumes = counter("training_resumes", "Resumes from a checkpoint (process starts included).")
        self._rollbacks = counter("training_rollbacks", "In-process rollbacks to an earlier checkpoint.")

        self._ckpt_last = gauge(
            "training_checkpoint_last_success_timestamp_seconds", "Unix time of the last successful checkpoint."
        )
        Gauge(
            "training_checkpoint_age_seconds",
            "Seconds since the last successful checkpoint (since process start before the first one).",
            RUN_RANK, registry=r,
        ).labels(*lv).set_function(lambda: time.time() - self._checkpoint_ref)
        self._ckpt_seconds = Histogram(
            "training_checkpoint_save_duration_seconds", "Wall time of successful checkpoint saves.", RUN_RANK,
            buckets=CHECKPOINT_SECONDS_BUCKETS, registry=r,
        ).labels(*lv)
        self._ckpt_bytes = gauge("training_checkpoint_size_bytes", "Size on disk of the last successful checkpoint.")
        self._ckpt_failures = counter("training_checkpoint_failures", "Checkpoint saves that failed.")
        self._steplog_failures = counter(
            "training_step_log_write_failures", "Writes of steps.jsonl the disk refused (full, quota, file size limit)."
        )
        self._steplog_lost = counter(
            "training_step_log_records_lost", "Step records never written to steps.jsonl (buffer overflow or exit)."
        )
        self._steplog_buffered = gauge(
            "training_step_log_buffered_records", "Step records held in memory until steps.jsonl is writable again."
        )
        self._steplog_seen = (0, 0)

        # reason: sentinel.protocol.REJECT_REASONS (a small fixed set)
        self._directives_rejected = Counter(
            "training_directives_rejected", "Directives refused, by reason (bad_signature, unsigned, expired, malformed, ...).",
            RUN_RANK + ("reason",), registry=r,
        )
        self._rejected_seen: dict[str, int] = {}
        for reason in REJECT_REASONS:  # every series exists from the start, so increase() sees the first one
            self._directives_rejected.labels(*lv, reason)
        applied = Counter(
            "training_directives_applied", "Directives applied, by kind.", RUN_RANK + ("kind",), registry=r
        )
        self._applied_family = applied
        self._applied = {kind: applied.labels(*lv, kind) for kind in DIRECTIVE_KINDS}

        events = Counter(
            "training_timeline_events",
            "Changes of training conditions (LR phase, mixture, seq len) and restarts, by event.",
            RUN_RANK + ("event",), registry=r,
        )
        self._timeline_events = {e: events.labels(*lv, e) for e in TIMELINE_EVENTS}
        self._build_slices()

    def _build_slices(self) -> None:
        """Per-slice (data source) families. ``slice`` is bounded: at most ``MAX_SLICES`` names
        matching ``SLICE_NAME_RE``, fixed when the dataset is prepared (``set_slices``)."""
        r = self.registry

        def family(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, RUN_RANK + ("slice",), registry=r)

        self._slice_families = {
            "train": family("training_slice_loss", "Mean training loss of the last step over the samples of each slice."),
            "val": family("training_validation_slice_loss", "Held-out validation loss of each slice at the last eval."),
            "probe": family("training_probe_loss", "Loss on each slice's small fixed probe set at the last eval."),
            "weight": family(
                "training_mixture_weight_ratio", "Sampling weight of each slice in the data mixture (weights sum to 1)."
            ),
        }
        self._slices: dict[str, dict[str, Gauge]] = {}

    # ------------------------------------------------------------------------------------------
    # serving
    # ------------------------------------------------------------------------------------------

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve this registry on ``http://host:port/metrics`` from a daemon thread.

        ``port=0`` lets the OS pick a free port; the bound port is returned (write it to the
        Prometheus targets file). The trainer passes ``base_port + local_rank``.
        """
        if self._server is not None:
            raise RuntimeError(f"already serving on port {self._port}")
        from sentinel.metrics_http import serve  # a timeout per connection and a cap on them

        self._server, self._port = serve(self.registry, host, port)
        return self._port

    @property
    def port(self) -> int | None:
        """The bound port, once :meth:`serve` ran."""
        return self._port

    def close(self) -> None:
        """Stop the HTTP endpoint (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def exposition(self) -> bytes:
        """The text exposition a scrape would return."""
        return generate_latest(self.registry)

    # ------------------------------------------------------------------------------------------
    # events
    # ------------------------------------------------------------------------------------------

    def on_step(
        self,
        *,
        step: int,
        loss: float | None,
        rank_loss: float,
        grad_norm: float | None,
        lr: float | None,
        tokens_total: int | None,
        step_seconds: float,
        phases: dict[str, float],
        step_tokens: int,
        grad_clipped: bool,
        skipped_reason: str | None,
        skipped_samples: int,
        loaded_tokens: int,
        useful_tokens: int,
        mfu: float | None,
    ) -> None:
        """Record one optimizer step.

        Per-rank inputs (every rank): ``rank_loss``, ``step_seconds``, ``phases`` (names outside
        ``PHASES`` are ignored, to bound label cardinality), ``skipped_samples``, ``loaded_tokens``
        and ``useful_tokens`` (this rank's loader, this step).
        Global inputs (read on rank 0 only; ``None`` elsewhere is fine): ``step``, ``loss``,
        ``grad_norm`` (pre-clip), ``lr``, ``tokens_total`` (the run's cumulative token position),
        ``step_tokens`` (tokens of the whole global batch of this step), ``grad_clipped``,
        ``skipped_reason`` (``None`` when the update was applied), ``mfu`` (``None`` when no peak
        is known: the metric then never appears).
        """
        now = time.time()
        self._heartbeat.set(now)
        self._rank_loss.set(rank_loss)
        self._step_duration.observe(step_seconds)
        for name, seconds in phases.items():
            child = self._phase.get(name)
            if child is not None:
                child.observe(seconds)
        if skipped_samples:
            self._skipped_samples.inc(skipped_samples)
        self._window.append((int(step_tokens), float(step_seconds), int(loaded_tokens), int(useful_tokens)))
        loaded = sum(w[2] for w in self._window)
        if loaded > 0:
            self._effective_ratio.set(sum(w[3] for w in self._window) / loaded)

        if not self.is_global_exporter:
            return
        self._step.set(step)
        if loss is not None:
            self._loss.set(loss)
        if grad_norm is not None:
            self._grad_norm.set(grad_norm)
        if lr is not None:
            self._lr.set(lr)
        if tokens_total is not None:
            self._trained_tokens.set(tokens_total)
        seconds = sum(w[1] for w in self._window)
        if seconds > 0:
            self._tps.set(sum(w[0] for w in self._window) / seconds)
        if grad_clipped:
            self._clipped.inc()
        if skipped_reason:
            child = self._skipped.get(skipped_reason)
            if child is None:
                child = self._skipped[skipped_reason] = self._skipped_family.labels(self.run, GLOBAL_RANK, skipped_reason)
            child.inc()
        elif step_tokens > 0:
            self._tokens.inc(step_tokens)
        if mfu is not None:
            if self._mfu is None:
                self._mfu_family = Gauge(
                    "training_mfu_ratio", "Model FLOPs utilisation: achieved model FLOP/s / peak FLOP/s of all devices.",
                    RUN_RANK, registry=self.registry,
                )
                self._mfu = self._mfu_family.labels(self.run, GLOBAL_RANK)
            self._mfu.set(mfu)

    def on_validation(self, loss: float) -> None:
        """Record a validation pass's loss (perplexity is ``exp()`` of it in PromQL). Rank 0 only."""
        if not self.is_global_exporter:
            return
        self._val_loss.set(loss)

    def set_slices(self, names: typing.Sequence[str]) -> None:
        """Declare the run's slices (data sources); only these ever become ``slice`` label values.
        Raises ValueError for more than ``MAX_SLICES`` or a name outside ``SLICE_NAME_RE``."""
        if len(names) > MAX_SLICES:
            raise ValueError(f"at most {MAX_SLICES} slices (got {len(names)})")
        for name in names:
            if not re.fullmatch(SLICE_NAME_RE, name):
                raise ValueError(f"slice name {name!r} does not match {SLICE_NAME_RE}")
        if not self.is_global_exporter:
            return
        # children are created on their first value: a slice never evaluated has no series (rather
        # than a 0 that a "regressed from its best" rule would read as a perfect loss)
        self._slices = {name: {} for name in names}

    def _set_slice_values(self, key: str, values: dict[str, float] | None) -> None:
        if not self.is_global_exporter or not values:
            return
        for name, value in values.items():
            children = self._slices.get(name)  # undeclared names are dropped: cardinality stays bounded
            if children is None:
                continue
            child = children.get(key)
            if child is None:
                child = children[key] = self._slice_families[key].labels(self.run, GLOBAL_RANK, name)
            child.set(value)

    def on_slice_losses(self, losses: dict[str, float] | None) -> None:
        """Per-slice mean training loss of the last step (slices absent from the batch keep their last value)."""
        self._set_slice_values("train", losses)

    def on_slice_validation(self, val: dict[str, float] | None, probe: dict[str, float] | None) -> None:
        """Per-slice held-out loss and probe loss of one eval."""
        self._set_slice_values("val", val)
        self._set_slice_values("probe", probe)

    def set_mixture_weights(self, weights: dict[str, float]) -> None:
        """The sampling weight of each slice now in effect (normalised to sum to 1)."""
        self._set_slice_values("weight", weights)

    def set_sequence_length(self, tokens: int) -> None:
        """The sequence length the last step trained at (it moves under a seq_len schedule)."""
        if self.is_global_exporter:
            self._seq_len.set(tokens)

    def on_timeline_event(self, event: str) -> None:
        """Count one timeline event (``TIMELINE_EVENTS``; others are ignored, to bound cardinality)."""
        if self.is_global_exporter and event in TIMELINE_EVENTS:
            self._timeline_events[event].inc()

    def on_checkpoint(self, *, ok: bool, seconds: float, size_bytes: int, timestamp: float) -> None:
        """Record a checkpoint save attempt. ``timestamp`` is the Unix time the save completed.

        A failure only counts; duration, size and age describe the last *successful* save.
        """
        if not self.is_global_exporter:
            return
        if not ok:
            self._ckpt_failures.inc()
            return
        self._checkpoint_ref = float(timestamp)
        self._ckpt_last.set(timestamp)
        self._ckpt_seconds.observe(seconds)
        self._ckpt_bytes.set(size_bytes)

    def on_resume(self) -> None:
        """The run resumed from a checkpoint (at process start)."""
        if self.is_global_exporter:
            self._resumes.inc()
            self._timeline_events["resume"].inc()

    def on_rollback(self) -> None:
        """The trainer rolled back to an earlier checkpoint without restarting."""
        if self.is_global_exporter:
            self._rollbacks.inc()
            self._timeline_events["rollback"].inc()

    def on_directive(self, kind: str, applied: bool) -> None:
        """A directive from the sentinel was applied (counted by kind) or rejected."""
        if not self.is_global_exporter:
            return
        if not applied:
            self._directives_rejected.labels(self.run, GLOBAL_RANK, "malformed").inc()
            return
        child = self._applied.get(kind)
        if child is None:  # unknown kinds are rejected upstream; count anyway rather than lose it
            child = self._applied[kind] = self._applied_family.labels(self.run, GLOBAL_RANK, kind)
        child.inc()

    def set_step_log(self, *, write_failures: int, lost: int, buffered: int) -> None:
        """Mirror the step log writer's cumulative failure and loss counts (rank 0)."""
        if not self.is_global_exporter:
            return
        f0, l0 = self._steplog_seen
        if write_failures > f0:
            self._steplog_failures.inc(write_failures - f0)
        if lost > l0:
            self._steplog_lost.inc(lost - l0)
        self._steplog_seen = (max(f0, write_failures), max(l0, lost))
        self._steplog_buffered.set(buffered)

    def set_directives_rejected(self, by_reason) -> None:
        """Mirror the bus client's cumulative rejections per reason into the counter."""
        if not self.is_global_exporter:
            return
        for reason, total in by_reason.items():
            new = int(total) - self._rejected_seen.get(reason, 0)
            if new < 0:  # the client was recreated: its count restarted
                new = int(total)
            if new:
                self._directives_rejected.labels(self.run, GLOBAL_RANK, reason).inc(new)
            self._rejected_seen[reason] = int(total)

    def set_telemetry_dropped(self, total: int) -> None:
        """Mirror the bus client's cumulative drop count into a counter.

        A count lower than the last one means the client was recreated (its count restarted),
        so all of ``total`` is new.
        """
        total = int(total)
        delta = total - self._dropped_seen if total >= self._dropped_seen else total
        self._dropped_seen = total
        if delta > 0:
            self._dropped.inc(delta)

    def heartbeat(self) -> None:
        """Mark this rank alive (also done by every ``on_step``); call it during long waits."""
        self._heartbeat.set(time.time())
