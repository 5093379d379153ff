"""End-to-end detection latency: step record XADDed -> signed directive visible in Redis.

Loopback, embedded valkey. The daemon is the real thing in its own process (``sentinel run``
with a rules file where one NaN loss is damage: ``nonfinite.persist_steps: 1``). This script plays
the trainer of one run, over and over:

1. register a checkpoint at the last healthy step ``s`` (HSET, as the trainer does);
2. XADD a StepRecord for step ``s+1`` with loss NaN, taking ``t0`` just before the XADD;
3. block in XREAD on the directives stream; ``t1`` when the rollback directive arrives;
4. act on it like a trainer (ack "applied", a rollback TimelineRecord to ``s``, two healthy steps on
   the new timeline) and wait for the sentinel to close the incident (``incident_closed`` event).

Latency = ``t1 - t0`` on one clock: it includes the daemon's blocking XREADGROUP wake-up (it
blocks up to 100 ms per read but returns as soon as an entry arrives), the rule evaluation, the
incident state machine, HSETNX of the idempotency key, HMAC signing, and the XADD of the directive,
plus this reader's own wake-up. Also reported: the daemon's own histogram
``sentinel_detection_latency_seconds`` (record ``time`` -> directive XADD returned), scraped
from its metrics port.

    python bench/e2e_latency.py [-n 300] [--warmup 10] [--ids-per-step 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

RULES = """\
version: 1
policy:
  rollback_margin_steps: 0       # roll back to the checkpoint just before the NaN
  skip_margin_steps: 0
  max_rollbacks_per_hour: 1000000
  verify_recent_steps: 1
  verify_window_steps: 50
rules:
  nonfinite:
    persist_steps: 1             # a single NaN loss is damage: act at once
  val_divergence:
    enabled: false
"""


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("sentinel_detection_latency_seconds_") and not line.startswith("#"):
            name, _, val = line.rpartition(" ")
            out[name.split("{")[0]] = float(val)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=300, help="incidents to measure (after warmup)")
    ap.add_argument("--warmup", type=int, default=10, help="incidents run first and not counted")
    ap.add_argument("--ids-per-step", type=int, default=64, help="sample ids per step record (the global batch size)")
    ap.add_argument("--per-run", type=int, default=25, help="incidents per run (a fresh run and `sentinel run` each)")
    ap.add_argument("--history", type=int, default=2048, help="healthy steps published before the first incident of a run")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    args = ap.parse_args()

    from sentinel import bus
    from sentinel.embedded import ensure_embedded, server_binary, stop_embedded
    from sentinel.protocol import Ack, CheckpointInfo, Directive, Event, Keys, StepRecord, TimelineRecord, record_mac

    tmp = Path(tempfile.mkdtemp(prefix="e2e-latency-"))
    bus_dir = tmp / "bus-home"
    url = ensure_embedded(bus_dir)
    secret_file = bus_dir / "bus" / "secret"
    secret = bus.load_secret(bus_dir)  # step records and acks carry a MAC, as the trainer's do
    r = bus.connect(url, timeout=5.0)
    rules = tmp / "rules.yaml"
    rules.write_text(RULES)
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
    env.pop("SENTINEL_SECRET", None)
    per = args.ids_per_step
    total = args.warmup + args.n
    lat: list[float] = []
    hist = {"sentinel_detection_latency_seconds_sum": 0.0, "sentinel_detection_latency_seconds_count": 0.0}
    n_dirs = 0

    def segment(seg: int, n_incidents: int) -> None:
        """One run, one fresh `sentinel run`, ``n_incidents`` incidents back to back."""
        nonlocal n_dirs
        run = f"bench-{seg:03d}"
        k = Keys(run)
        log = tmp / f"sentinel-{seg:03d}.log"
        daemon = subprocess.Popen(
            [sys.executable, "-m", "sentinel", "run", run, "--redis-url", url, "--secret-file", str(secret_file),
             "--rules", str(rules), "--consumer", "bench", "--metrics-port", "0"],
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while r.get(k.leader) != "bench":
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"sentinel did not start: {log.read_text()[-2000:]}")
                time.sleep(0.05)
            port = int(re.search(r"http://127\.0\.0\.1:(\d+)/metrics", log.read_text()).group(1))
            timeline = 0

            def rec(s: int, loss: float) -> StepRecord:
                return StepRecord(run=run, step=s, timeline=timeline, loss=loss, loss_max_rank=loss, grad_norm=1.0, lr=3e-4,
                                  tokens=s * per * 256, batch_fingerprint=f"{s:016x}",
                                  sample_ids=list(range(s * per, (s + 1) * per)), skipped=not math.isfinite(loss),
                                  skip_reason=None if math.isfinite(loss) else "nonfinite", time=time.time())  # fmt: skip

            # a healthy history first (sample_history_steps is 2048 by default: fill it, as a real run would)
            for s0 in range(1, args.history + 1, 500):
                pipe = r.pipeline(transaction=False)
                for s in range(s0, min(s0 + 500, args.history + 1)):
                    data = rec(s, 3.0).to_json()
                    pipe.xadd(k.steps, {"json": data, "mac": record_mac(secret, k.steps, data)})
                pipe.execute()
            step = args.history
            dir_last, ev_last = "0-0", "0-0"
            # let the sentinel digest that backlog before the first incident
            last = r.xrevrange(k.steps, count=1)[0][0] if args.history else None
            deadline = time.monotonic() + 120
            while last and json.loads(r.get(k.policy) or "{}").get("last_id") != last:
                if time.monotonic() > deadline:
                    raise SystemExit(f"sentinel did not catch up with the history; {log.read_text()[-2000:]}")
                time.sleep(0.05)
            for _ in range(n_incidents):
                r.hset(k.checkpoints, str(step), CheckpointInfo(run=run, step=step, path=f"/ckpt/{step}", created=time.time(),
                                                                bytes=1, manifest_sha256="0" * 64, world_size=1,
                                                                timeline=timeline).to_json())  # saved on the current timeline
                # (the sentinel re-reads checkpoints at the start of every poll, so the poll that sees the
                # NaN step sees this checkpoint too.) Arrive at a random moment of the daemon's loop:
                time.sleep(random.uniform(0.0, 0.1))  # its blocking read is 100 ms
                data = rec(step + 1, float("nan")).to_json()
                t0 = time.time()
                r.xadd(k.steps, {"json": data, "mac": record_mac(secret, k.steps, data)}, maxlen=100_000, approximate=True)
                resp = r.xread({k.directives: dir_last}, count=1, block=5000)
                t1 = time.time()
                if not resp:
                    raise SystemExit(f"no directive within 5 s; {log.read_text()[-2000:]}")
                eid, fields = resp[0][1][0]
                dir_last = eid
                d = Directive.from_json(fields["json"])
                assert d.kind == "rollback" and d.to_step == step, d
                lat.append(t1 - t0)
                # be the trainer: ack, restore, two healthy steps on the new timeline -> incident closes
                timeline += 1
                bus.publish(r, k.acks, Ack(run=run, directive_id=d.id, kind="rollback", status="applied", step=step, timeline=timeline),
                            secret=secret)
                bus.publish(r, k.steps, TimelineRecord(kind="rollback", run=run, from_step=step, timeline=timeline,
                                                       time=time.time(), directive_id=d.id, skip_ranges=d.ranges),
                            secret=secret)  # fmt: skip
                bus.publish(r, k.steps, rec(step + 1, 3.0), secret=secret)
                bus.publish(r, k.steps, rec(step + 2, 3.0), secret=secret)
                step += 2
                closed = False
                deadline = time.monotonic() + 10
                while not closed and time.monotonic() < deadline:
                    for _s, items in r.xread({k.events: ev_last}, count=100, block=500) or []:
                        for eid, f in items:
                            ev_last = eid
                            e = Event.from_json(f["json"])
                            closed = closed or (e.kind == "incident_closed" and e.incident_id == d.incident_id)
                if not closed:
                    raise SystemExit(f"incident did not close; {log.read_text()[-2000:]}")
            for key, v in _scrape(port).items():
                if key in hist:
                    hist[key] += v
            n_dirs += r.xlen(k.directives)
        finally:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(daemon.pid, signal.SIGKILL)

    try:
        seg = 0
        while len(lat) < total:
            segment(seg, min(args.per_run, total - len(lat)))
            seg += 1
    finally:
        stop_embedded(bus_dir)
    lat = lat[args.warmup:]

    ms = [x * 1000 for x in lat]
    valkey = subprocess.run([server_binary(), "--version"], capture_output=True, text=True).stdout.split()[2]
    out = {
        "incidents": len(ms), "ids_per_step": args.ids_per_step, "directives_sent": n_dirs, "p50_ms": _pct(ms, 50), "p90_ms": _pct(ms, 90),
        "p99_ms": _pct(ms, 99), "max_ms": max(ms), "mean_ms": sum(ms) / len(ms), "min_ms": min(ms),
        "daemon_histogram_mean_ms": 1000 * hist.get("sentinel_detection_latency_seconds_sum", 0)
        / max(1.0, hist.get("sentinel_detection_latency_seconds_count", 0)),
        "daemon_histogram_count": hist.get("sentinel_detection_latency_seconds_count"),
        "cpus": os.cpu_count(), "python": platform.python_version(), "valkey": valkey,
        "load_avg_1m": os.getloadavg()[0],
    }  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['incidents']} incidents ({args.warmup} warmup not counted), {per} sample ids per step, "
              f"{args.per_run} incidents per run after {args.history} healthy steps, "
              f"embedded valkey {valkey}, loopback, "
              f"{out['cpus']} CPUs, load avg {out['load_avg_1m']:.1f}")
        print("| p50 | p90 | p99 | max | mean |")
        print("|---:|---:|---:|---:|---:|")
        print(f"| {out['p50_ms']:.2f} ms | {out['p90_ms']:.2f} ms | {out['p99_ms']:.2f} ms | {out['max_ms']:.2f} ms | {out['mean_ms']:.2f} ms |")
        print(f"daemon's own sentinel_detection_latency_seconds: mean {out['daemon_histogram_mean_ms']:.2f} ms "
              f"over {out['daemon_histogram_count']:.0f} directives")
    return 0


if __name__ == "__main__":
    sys.exit(main())
