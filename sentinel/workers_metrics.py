"""One ``/metrics`` for ``sentinel run --workers K``: every worker's series, with a ``worker`` label.

Each worker serves its own metrics on a loopback port only the supervisor knows. At each scrape
the supervisor fetches them all (at once, each within ``FETCH_TIMEOUT_S``) and serves them as one
exposition: a family's samples from every worker, each sample labelled with its worker's index
(``worker="0"``). The runs of two workers never overlap, so per-run series stay one per run; the
daemon-wide ones (the verdict histogram, bus errors, ``process_*``) become one per worker, which a
query sums (``sum by (le) (rate(sentinel_verdict_latency_seconds_bucket[5m]))``).

A worker that does not answer (restarting, stuck) leaves its series out of that scrape, and
``sentinel_worker_up{worker}`` reads 0 for it: Prometheus sees a gap, not a stale value.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

FETCH_TIMEOUT_S = 3.0  # within Prometheus's default scrape timeout (10 s), with room to spare
MAX_EXPOSITION_BYTES = 64 << 20  # a worker's page past this is not read (a runaway label set)


def fetch(port: int, timeout: float = FETCH_TIMEOUT_S) -> str | None:
    """A worker's exposition text from 127.0.0.1:``port``, or None when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as resp:
            body = resp.read(MAX_EXPOSITION_BYTES + 1)
    except (OSError, urllib.error.URLError, ValueError):
        return None
    if len(body) > MAX_EXPOSITION_BYTES:
        return None
    return body.decode("utf-8", "replace")


def merge(pages: dict[str, str | None]) -> list[Metric]:
    """The families of every page (worker label -> exposition text, None when it did not answer),
    each sample labelled ``worker``; a family's help and type from the first page that has it. A
    page that does not parse counts as unanswered (its worker reads down)."""
    families: dict[str, Metric] = {}
    for worker, text in pages.items():
        if text is None:
            continue
        try:
            parsed = list(text_string_to_metric_families(text))
        except (ValueError, TypeError, IndexError):
            pages[worker] = None
            continue
        for fam in parsed:
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            elif out.type != fam.type:
                continue  # two workers of one build never disagree; a mismatch is left out, not mixed
            for s in fam.samples:
                out.samples.append(s._replace(labels={**s.labels, "worker": worker}))
    return list(families.values())


class WorkersCollector:
    """A registry collector that serves the workers' metrics merged, plus the supervisor's own:
    ``sentinel_worker_up`` and ``sentinel_worker_restarts_total``, per worker. ``ports`` gives the
    current {worker label: metrics port or None (not up yet)}; ``restarts`` {worker label: count}."""

    def __init__(self, ports: Callable[[], dict[str, int | None]], restarts: Callable[[], dict[str, int]],
                 fetcher: Callable[[int], str | None] = fetch):
        self._ports, self._restarts, self._fetch = ports, restarts, fetcher

    def collect(self) -> Iterable[Metric]:
        ports = self._ports()
        known = {w: p for w, p in ports.items() if p is not None}
        pages: dict[str, str | None] = dict.fromkeys(ports)
        if known:
            with ThreadPoolExecutor(max_workers=min(16, len(known))) as pool:
                for w, text in zip(known, pool.map(self._fetch, known.values())):
                    pages[w] = text
        merged = merge(pages)
        up = GaugeMetricFamily("sentinel_worker_up", "1 when the worker (of sentinel run --workers) answered this scrape.",
                               labels=["worker"])
        for w in ports:
            up.add_metric([w], 0.0 if pages[w] is None else 1.0)
        restarts = CounterMetricFamily("sentinel_worker_restarts", "Workers the supervisor started again after they exited.",
                                       labels=["worker"])
        for w, n in self._restarts().items():
            restarts.add_metric([w], float(n))
        yield up
        yield restarts
        yield from merged

    def describe(self) -> Iterable[Metric]:
        return []  # collected at each scrape: nothing to check names against at registration
