"""The floor arm of ``bench/daemon_scale.py``: what verdict latency any consumer of a given CPU gets.

    python bench/fleet_floor.py RUN... --redis-url URL --work-us 250 [--metrics-port 0]

It reads a fleet's step streams as ``sentinel run`` does (one XREADGROUP over every run's stream
with the same client, paced as ``sentinel run`` paces it: ``PACE_PER_RUN_S`` a run, at most
``PACE_MAX_S``, never after a full batch; the oldest record first), then spends a fixed amount of
work on each record instead of judging it (``--work-us``: a loop of as many iterations as took
that long when it started, the median of seven timings), notes the record's latency from its XADD
(its stream id, Redis's clock) and acknowledges what it read. It serves the two metrics ``daemon_scale.py``
scrapes: ``sentinel_verdict_latency_seconds`` (the daemon's buckets) and
``sentinel_steps_processed_total``, and it takes every run's lease key under the consumer name
``bench``, so the bench measures it exactly as it measures the daemon.

The work is counted in loop iterations, not in CPU time: the daemon's work per record is fixed
too, so when the machine's CPU slows (the project's VM: both vCPUs at 13-48 % for 50-100 ms every
~1.5 s) both take longer alike. At ``--work-us`` near the daemon's CPU per record, its p99 is the
p99 a consumer of the daemon's cost gets on this machine, whatever it computes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from sentinel import bus
from sentinel.cli.run_cmd import PACE_PER_RUN_S
from sentinel.daemon_options import PACE_MAX_S, Options, _stream_id_tuple
from sentinel.metrics import VERDICT_BUCKETS
from sentinel.protocol import STEP_CONSUMER_GROUP, Keys

CONSUMER = "bench"
BATCH = Options.__dataclass_fields__["batch"].default  # entries a stream, a read: the daemon's


def spin(n: int) -> int:
    x = 0
    for _ in range(n):
        x += 1
    return x


def iterations_per_us() -> float:
    """How many ``spin`` iterations take a microsecond here: the median of seven 20 ms timings."""
    rates = []
    for _ in range(7):
        n, t = 0, time.perf_counter()
        while time.perf_counter() - t < 0.02:
            spin(1000)
            n += 1000
        rates.append(n / ((time.perf_counter() - t) * 1e6))
    return statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="the run ids whose step streams to read")
    ap.add_argument("--redis-url", required=True)
    ap.add_argument("--work-us", type=float, required=True, help="work spent on each record, in microseconds of this "
                                                                  "machine's pace when it starts")
    ap.add_argument("--metrics-port", type=int, default=0)
    args = ap.parse_args()
    if args.work_us < 0:
        ap.error("--work-us must be >= 0")
    work = round(args.work_us * iterations_per_us())
    r = bus.connect(args.redis_url)
    streams = [Keys(run).steps for run in args.runs]
    for run, stream in zip(args.runs, streams):
        bus.ensure_group(r, stream, STEP_CONSUMER_GROUP)
        r.set(Keys(run).leader, CONSUMER)
    registry = CollectorRegistry()
    latency = Histogram("sentinel_verdict_latency_seconds", "XADD to the end of the record's work.",
                        buckets=VERDICT_BUCKETS, registry=registry)
    processed = Counter("sentinel_steps_processed", "Records worked on.", ["run"], registry=registry).labels("all")
    server, _ = start_http_server(args.metrics_port, addr="127.0.0.1", registry=registry)
    print(f"floor consumer: {work} iterations a record; metrics on http://127.0.0.1:{server.server_port}/metrics",
          flush=True)
    pace = min(PACE_MAX_S, PACE_PER_RUN_S * len(streams))
    next_read = 0.0
    while True:
        wait = next_read - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        started = time.monotonic()
        entries = bus.read_group(r, streams, STEP_CONSUMER_GROUP, CONSUMER, count=BATCH, block_ms=100)
        done: dict[str, list[str]] = {}
        for e in sorted(entries, key=lambda e: _stream_id_tuple(e.id)):  # the oldest record first, as the daemon judges them
            spin(work)
            latency.observe(max(0.0, time.time() - int(e.id.partition("-")[0]) / 1000.0))
            done.setdefault(e.stream, []).append(e.id)
        processed.inc(len(entries))
        if done:
            pipe = bus.raw(r).pipeline(transaction=False)
            for stream, ids in done.items():
                pipe.xack(stream, STEP_CONSUMER_GROUP, *ids)
            pipe.execute()
        if entries and max(len(ids) for ids in done.values()) < BATCH:
            next_read = started + pace


if __name__ == "__main__":
    sys.exit(main())
