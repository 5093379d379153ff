"""The sentinel's own Prometheus metrics (for Grafana annotations and alerts).

Built once per daemon in a registry we own (no ``_created`` series, plus prometheus-client's
``process_*`` series of the daemon's own process). Label cardinality stays low: ``run`` everywhere,
plus ``rule`` or ``action``/``outcome`` from small fixed vocabularies.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import HistogramMetricFamily

from sentinel.client.metrics import MetricsRegistry

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# finer around the fleet target (p99 <= 50 ms, bench/daemon_scale.py), and up to 250 ms, where a fleet's
# p99 lands on a busy machine: a quantile read between 0.1 and 0.25 alone could be off by 100 ms
VERDICT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)


class LoopHistogram:
    """A label-less histogram observed by one thread (the daemon's loop) and read by the scrape.

    prometheus-client's ``Histogram.observe`` walks the buckets in Python and takes a lock per
    increment, twice: ~3 us, at every step record of every run (a fleet of 300 sends 3,000 a
    second). Here an observation is a bisect and two plain additions; a scrape copies the counts
    (one list copy under the GIL) and makes them cumulative, so ``_count`` is always the ``+Inf``
    bucket. ``_sum`` may trail the counts by the observation in flight."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = tuple(float(b) for b in buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        if value == value:  # a NaN is in no bucket (only the sum), as prometheus-client has it
            self._counts[bisect_left(self.bounds, value)] += 1  # le: the first bound >= value
        self._sum += value

    def _family(self, counts: list[int], total: float) -> HistogramMetricFamily:
        cum, acc = [], 0
        for bound, n in zip((*(repr(b) for b in self.bounds), "+Inf"), counts):
            acc += n
            cum.append((bound, acc))
        return HistogramMetricFamily(self.name, self.documentation, buckets=cum, sum_value=total)

    def collect(self):
        yield self._family(list(self._counts), self._sum)

    def describe(self):
        yield HistogramMetricFamily(self.name, self.documentation)


class SentinelMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or MetricsRegistry()
        r = self.registry
        try:
            ProcessCollector(registry=r)
        except ValueError:  # a caller's registry that has one already
            pass
        self.steps = Counter("sentinel_steps_processed", "Step records processed.", ["run"], registry=r)
        self.fired = Counter("sentinel_rule_fired", "Rule firings (after cooldowns).", ["run", "rule"], registry=r)
        self.actions = Counter("sentinel_actions",
                               "Actions taken, by outcome: sent, duplicate, dry_run, and the trainer's verdict failed or rejected.",
                               ["run", "action", "outcome"], registry=r)
        self.incidents_open = Gauge("sentinel_incidents_open", "Incidents not yet healthy or escalated-and-closed.", ["run"], registry=r)
        self.latency = Histogram("sentinel_detection_latency_seconds", "From step publish to signed directive in Redis.",
                                 ["run"], buckets=LATENCY_BUCKETS, registry=r)
        # one series for the whole daemon (not per run): how far behind the rules are, across the fleet
        self.verdict_latency = LoopHistogram("sentinel_verdict_latency_seconds", "From a step record's XADD (its stream id, "
                                             "millisecond resolution) to the rules' verdict on it, over every watched run; "
                                             "backlog read as history is not counted.", VERDICT_BUCKETS, r)
        self.last_action = Gauge("sentinel_last_action_timestamp_seconds", "Unix time of the last action, by kind.",
                                 ["run", "action"], registry=r)
        self.leader = Gauge("sentinel_leader", "1 while this sentinel holds the run's leader lease.", ["run"], registry=r)
        self.spike_pattern = Gauge("sentinel_spike_pattern",
                                   "1 for the run's current spike pattern (one-off, periodic, increasing), 0 for the others.",
                                   ["run", "pattern"], registry=r)
        self.episodes = Counter("sentinel_anomaly_episodes", "Anomaly episodes closed, by outcome: recovered (annotated, no action) or damage.",
                                ["run", "outcome"], registry=r)
        self.runs_unwatched = Gauge("sentinel_runs_unwatched", "Live runs on the bus beyond --max-runs, not watched by this sentinel.",
                                    registry=r)
        self.bus_errors = Counter("sentinel_bus_errors", "Control-bus errors (each retried).", registry=r)
        # stream: a bus key's short name (steps, acks, approvals, checkpoints, heartbeat, info, leader, incidents,
        # applied, events, directives); reason: protocol.REJECT_REASONS (both small, fixed)
        self.rejected = Counter("sentinel_records_rejected", "Bus entries refused (acknowledged, never re-read), by stream and reason.",
                                ["run", "stream", "reason"], registry=r)
        self.trimmed = Counter("sentinel_records_trimmed_unread", "Step records the capped stream trimmed before this sentinel read them.",
                               ["run"], registry=r)
        self.lag = Gauge("sentinel_stream_lag_records", "Step records on the stream not yet read by the sentinel group.",
                         ["run"], registry=r)
        self.bus_restarts = Counter("sentinel_bus_restarts", "Embedded buses this sentinel found dead and restarted.",
                                    ["run"], registry=r)
        self.internal_errors = Counter("sentinel_internal_errors", "Polls of a run that raised an unexpected error: its "
                                       "entries stay pending and are read again; after 3 in a row its policy state starts afresh.",
                                       ["run"], registry=r)
        self.mirror_failures = Counter("sentinel_mirror_write_failures", "Failed appends to the run dir's incidents.jsonl "
                                       "or pages.jsonl (disk full, read-only): that history is then only on the bus.",
                                       ["run", "file"], registry=r)

    def on_verdict(self, entry_id: str, now: float) -> None:
        """A live record's verdict is in: observe XADD -> verdict (the id's millisecond part is Redis's clock)."""
        ms, _, _ = entry_id.partition("-")
        self.verdict_latency.observe(max(0.0, now - int(ms) / 1000.0))

    def serve(self, host: str, port: int) -> int:
        from sentinel.metrics_http import serve

        _server, bound = serve(self.registry, host, port)
        return bound
