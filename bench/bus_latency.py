"""How long until a published step is visible to a reader? (loopback, embedded valkey)

Starts an embedded bus in a temporary run dir, a reader in a separate process blocked in XREAD
on the step stream, and publishes N step records two ways:

* ``bus.publish``           - a synchronous XADD from the caller (what the daemon/CLI do);
* ``BusClient.publish_step`` - the trainer's path: in-memory enqueue, background I/O thread.

Latency = reader's receive time - the record's ``time`` field (same host clock). Also reports
what ``publish_step`` costs the training loop itself, which is the number that matters for MFU.

    python bench/bus_latency.py [-n 2000] [--interval-ms 2]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time


def _reader(url: str, stream: str, n: int, out) -> None:
    from sentinel.bus import Entry, connect, decode

    r = connect(url, timeout=5.0)
    last, lat = "0-0", []
    out.send("ready")
    while len(lat) < n:
        for _s, items in r.xread({stream: last}, count=500, block=1000) or []:
            now = time.time()
            for eid, fields in items:
                lat.append(now - decode(Entry(stream, eid, fields)).time)
                last = eid
    out.send(lat)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _step(run: str, step: int):
    from sentinel.protocol import StepRecord

    return StepRecord(run=run, step=step, loss=2.0, loss_max_rank=2.1, grad_norm=1.0, lr=3e-4, tokens=step * 65536,
                      batch_fingerprint="f" * 16, sample_ids=list(range(step * 64, step * 64 + 64)), time=time.time())  # fmt: skip


def _measure(url: str, run: str, n: int, interval: float, publish) -> tuple[list[float], list[float]]:
    from sentinel.protocol import Keys

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_reader, args=(url, Keys(run).steps, n, child), daemon=True)
    p.start()
    assert parent.recv() == "ready"
    calls = []
    for s in range(n):
        rec = _step(run, s)
        t = time.perf_counter()
        publish(rec)
        calls.append(time.perf_counter() - t)
        time.sleep(interval)
    lat = parent.recv()
    p.join(10)
    return lat, calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=2000, help="records per mode")
    ap.add_argument("--interval-ms", type=float, default=2.0, help="pause between publishes")
    args = ap.parse_args()

    from sentinel import bus
    from sentinel.client.bus import BusClient
    from sentinel.embedded import ensure_embedded, stop_embedded
    from sentinel.protocol import Keys

    with tempfile.TemporaryDirectory(prefix="bus-bench-") as run_dir:
        url = ensure_embedded(run_dir)
        try:
            r = bus.connect(url)
            version = r.info("server").get("valkey_version") or r.info("server").get("redis_version")
            rows = []
            lat, calls = _measure(url, "bench-sync", args.n, args.interval_ms / 1000,
                                  lambda rec: bus.publish(r, Keys("bench-sync").steps, rec))  # fmt: skip
            rows.append(("bus.publish (sync XADD)", lat, calls))
            client = BusClient(url, "bench-client", b"bench")
            lat, calls = _measure(url, "bench-client", args.n, args.interval_ms / 1000, client.publish_step)
            client.close()
            rows.append(("BusClient.publish_step", lat, calls))
        finally:
            stop_embedded(run_dir)

    print(f"embedded valkey {version} on loopback, n={args.n} per mode, one record every {args.interval_ms:g} ms")
    print(f"{'path':26} {'visible p50':>12} {'p99':>9} {'max':>9}   {'caller p50':>11} {'p99':>9}")
    for name, lat, calls in rows:
        ms = [x * 1e3 for x in lat]
        us = [x * 1e6 for x in calls]
        print(f"{name:26} {statistics.median(ms):9.3f} ms {_pct(ms, 99):6.3f} ms {max(ms):6.3f} ms"
              f"   {statistics.median(us):8.1f} us {_pct(us, 99):6.1f} us")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
