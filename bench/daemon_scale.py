"""One sentinel, a fleet: CPU, memory and verdict latency of `sentinel run` watching N runs at once.

    python bench/daemon_scale.py [--runs 1,10,100,300] [--workers 1,2,3] [--rate 10] [--seconds 10] [--history N]
                                 [--cpu-dips DUTY:MS:EVERY] [--json]

For each N, a fresh Debian ``redis-server`` on loopback and one ``sentinel run`` process naming N
run ids (the default rules, ``--secret-file``, ``--metrics-port 0``). This script plays N trainers:
every run publishes ``--rate`` signed step records a second (a real ``StepRecord`` as the trainer
writes it: loss near a slow descent with noise, grad norm, lr, ``--ids-per-step`` sample ids, the
record MAC), with the runs' phases spread evenly over the interval, as a fleet's are. Records are
built and signed before the clock starts; the publisher only XADDs them on schedule (pipelined,
every 5 ms), so its own cost does not shape the load.

By default the runs start at step 1, so the window holds their first ~130 steps: the early-descent
test (``DescentJump``, steps 26-274) is at work and the detectors' windows are still filling, as in
a sweep that launched every run at once. ``--history N`` plays a fleet in mid-run instead: before
the schedule starts, each run publishes steps 1..N as fast as the daemon judges them (signed as it
goes, stamped with the time they are sent), and the window continues from step N + 1 with every
detector's history full (a daemon state of ~50 KB a run at 2,000 steps, saved every ~4 s). The
warm-up is then 10 s longer: right after a catch-up of 600,000 records the daemon's collector runs
full collections of 46-91 ms (a sentinel that just caught up on a backlog pays them too), which a
10 s window would count against the fleet's steady state.

After ``--warmup`` seconds (the daemon's first reads, lease, consumer groups) it measures for
``--seconds``:

- ``cpu_cores``: the daemon's CPU seconds (``/proc/PID/stat``, user + system, every thread, every worker) per
  wall second; ``cpu_per_run_ms_per_s``: that over N, in CPU milliseconds per second per run;
  ``cpu_us_per_record``: CPU microseconds per record judged.
- ``rss_mib`` / ``peak_rss_mib``: the daemon's resident memory at the end (``VmRSS``, ``VmHWM``).
- ``verdict_p50_ms`` / ``p99``: from each record's XADD (its stream id, Redis's clock, millisecond
  resolution) to the rules' verdict on it, from the daemon's own histogram
  ``sentinel_verdict_latency_seconds`` (the difference of two scrapes, interpolated within a bucket).
- ``redis_calls_per_record``: commands the daemon sent Redis in the window (``INFO commandstats``,
  the publisher's XADDs left out) per record published; ``redis_calls`` has them by command.
- ``keeps_up``: the daemon judged at least 97 % of what was published in the window, and the
  backlog left when publishing stops drains within 2 s plus one second per 1,000 records.
- ``cpu_dips``: how steady the machine's CPU was just before the window (``cpu_steadiness``: 3 s of
  a fixed loop, counted in 50 ms buckets; a dip is a bucket at under half the median pace). On the
  project's VM on 2026-11-30 both vCPUs slowed to 13-48 % for 50-100 ms every ~1.5 s, with nothing
  else running; each dip is a backlog the daemon then drains at its spare CPU, so at 0.7 of a core
  the verdicts queued for 100-250 ms, every 1.5 s (docs/benchmarks/daemon-scale.md). A p99 read
  with dips is the machine's as much as the daemon's. ``--cpu-dips DUTY:MS:EVERY`` brings that
  regime on at any hour (``bench/cpu_dips.py``: root, a cgroup CPU controller): Redis, the daemon
  and this publisher then get DUTY % of the CPUs for MS every EVERY seconds (``25:80:1.5`` reads
  as the VM's bad minutes do), so arms can be compared in it rather than in the minute the
  machine gives; the JSON says what was injected (``cpu_dips_injected``).

- ``floor`` (with ``--floor-us``): after each size, the same fleet read by ``bench/fleet_floor.py``
  instead of the daemon, once per amount of work given: the same reads, paced the same, and a fixed
  amount of work a record instead of judging it. Each arm reports its ``cpu_cores``,
  ``cpu_us_per_record``, p50 and p99: the latency any consumer of that CPU gets on this machine, to
  set the daemon's beside.

- ``workers`` (``--workers``, default 1,2,3): each size of 100 runs or more is measured once per
  worker count K (``sentinel run --workers K``, each worker 50 runs or more): one process, and the
  runs shared by K daemon processes under one supervisor. ``cpu_cores`` and the memory are then the
  whole process tree's (the supervisor and its workers), the latency the histogram of every worker.

Target: 300 runs on one core (``cpu_cores`` <= 1 at N = 300) with p99 <= 50 ms, by any worker count
(``target_met`` says which rows meet it). This machine's cores are shared with other jobs: the load
average is printed with each figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from cpu_dips import CpuDips, DipError, DipSpec  # bench/cpu_dips.py
from failures import Failed, said  # bench/failures.py
from redis_server import redis_version, start_redis  # bench/redis_server.py

ROOT = Path(__file__).resolve().parents[1]
P99_TARGET_MS = 50.0
HISTORY_SETTLE_S = 10.0  # added to the warm-up after --history: the catch-up's garbage is collected before the window
HIST = "sentinel_verdict_latency_seconds"


def scrape(port: int) -> tuple[dict[float, float], float]:
    """The verdict histogram's cumulative buckets, and steps processed over all runs."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    buckets, steps = {}, 0.0
    for line in text.splitlines():
        if line.startswith(HIST + "_bucket"):
            le = re.search(r'le="([^"]+)"', line).group(1)
            buckets[math.inf if le == "+Inf" else float(le)] = float(line.rpartition(" ")[2])
        elif line.startswith("sentinel_steps_processed_total{"):
            steps += float(line.rpartition(" ")[2])
    return buckets, steps


def quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """The q-quantile of the observations between two scrapes, linear within its bucket (seconds)."""
    edges = sorted(after)
    counts = [after[e] - before.get(e, 0.0) for e in edges]
    total = counts[-1]
    if total <= 0:
        return None
    rank, lo, prev = q * total, 0.0, 0.0
    for e, c in zip(edges, counts):
        if c >= rank:
            if math.isinf(e):
                return lo  # beyond the last finite bucket: its lower edge is all we know
            return lo + (e - lo) * ((rank - prev) / (c - prev) if c > prev else 1.0)
        lo, prev = e, c
    return edges[-2]


def hiredis_available() -> bool:
    """Whether redis-py parses replies with hiredis here (and so in the daemon: the same interpreter)."""
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


def command_calls(r) -> dict[str, int]:
    """Redis's per-command call counts (``INFO commandstats``)."""
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in r.info("commandstats").items()}


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()  # fields from the state on: [1] ppid, [11] utime, [12] stime


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live children (``sentinel run --workers``: the supervisor and its workers)."""
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and d != str(pid):
            try:
                if int(_stat(int(d))[1]) == pid:
                    kids.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return [pid, *kids]


def proc_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and its live workers, and of the workers it reaped."""
    total = 0
    for p in process_tree(pid):
        try:
            fields = _stat(p)
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if p == pid else 0)
    return total / os.sysconf("SC_CLK_TCK")


def proc_mem_mib(pid: int) -> tuple[float, float]:
    """Resident memory (VmRSS) and its peak (VmHWM) of ``pid`` and its live workers, summed."""
    rss = hwm = 0.0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        rss += int(line.split()[1]) / 1024
                    elif line.startswith("VmHWM:"):
                        hwm += int(line.split()[1]) / 1024
        except OSError:
            pass
    return rss, hwm


def cpu_steadiness(seconds: float = 3.0, bucket_s: float = 0.05) -> dict:
    """This process's pace at a fixed loop, in ``bucket_s`` buckets over ``seconds``: how many
    buckets ran at under half the median pace (dips), and the slowest bucket's pace over the median."""
    buckets, cur = [], 0
    t0 = time.perf_counter()
    edge = t0 + bucket_s
    while True:
        for _ in range(200):
            pass
        cur += 1
        now = time.perf_counter()
        if now >= edge:
            buckets.append(cur)
            cur, edge = 0, edge + bucket_s
            if now - t0 >= seconds:
                break
    med = statistics.median(buckets)
    dips = sum(1 for b in buckets if b < 0.5 * med)
    return {"seconds": round(now - t0, 2), "bucket_ms": 1000 * bucket_s, "dips": dips, "dips_per_s": dips / (now - t0),
            "slowest_ratio": min(buckets) / med}


def build_records(runs: list[str], rate: float, seconds: float, t0: float, ids: int, secret: bytes, first_step: int = 1):
    """Every (send time, stream, fields) of the window, signed, sorted by send time. A run's start
    record leads when ``first_step`` is 1 (a run with history has had it)."""
    from sentinel.protocol import Keys, TimelineRecord, record_mac

    out = []
    n, dt = len(runs), 1.0 / rate
    per_run = int(seconds * rate)
    for i, run in enumerate(runs):
        stream = Keys(run).steps
        rng = random.Random(i * 1_000_003 + first_step)
        phase = dt * i / n
        if first_step == 1:
            start = TimelineRecord(kind="start", run=run, from_step=0, timeline=1, time=t0 - 1.0).to_json()
            out.append((t0 - 1.0, stream, {"json": start, "mac": record_mac(secret, stream, start)}))
        for k in range(per_run):
            at = t0 + phase + k * dt
            out.append((at, stream, step_fields(run, first_step + k, at, dt, ids, rng, secret)))
    out.sort(key=lambda x: x[0])
    return out


def step_fields(run: str, step: int, at: float, dt: float, ids: int, rng: random.Random, secret: bytes) -> dict:
    """One signed step record's stream fields: a loss near a slow descent with noise, as a trainer writes it."""
    from sentinel.protocol import Keys, StepRecord, record_mac

    loss = 3.0 + 2.0 * math.exp(-step / 300) + rng.gauss(0, 0.02)
    rec = StepRecord(run=run, step=step, timeline=1, loss=loss, loss_max_rank=loss, grad_norm=1.0 + rng.gauss(0, 0.05),
                     lr=3e-4, tokens=step * ids * 1024, batch_tokens=ids * 1024,
                     batch_fingerprint=f"{step:016x}", sample_ids=list(range(step * ids, (step + 1) * ids)),
                     skipped=False, time=at, step_seconds=dt).to_json()
    stream = Keys(run).steps
    return {"json": rec, "mac": record_mac(secret, stream, rec)}


def publish_history(r, runs: list[str], steps: int, args, secret: bytes, port: int) -> float:
    """Steps 1..``steps`` of every run (after its start record), signed as they go, published in
    rounds of 10 steps a run as fast as the daemon judges them (at most two rounds ahead). Returns
    the seconds it took."""
    from sentinel.protocol import Keys, TimelineRecord, record_mac

    t_start = time.monotonic()
    rngs = [random.Random(10_007 * i) for i in range(len(runs))]
    pipe = r.pipeline(transaction=False)
    for run in runs:
        stream = Keys(run).steps
        start = TimelineRecord(kind="start", run=run, from_step=0, timeline=1, time=time.time()).to_json()
        pipe.xadd(stream, {"json": start, "mac": record_mac(secret, stream, start)})
    pipe.execute()
    sent, chunk, dt = 0, 10, 1.0 / args.rate
    for first in range(1, steps + 1, chunk):
        now = time.time()
        pipe = r.pipeline(transaction=False)
        for i, run in enumerate(runs):
            for step in range(first, min(steps, first + chunk - 1) + 1):
                pipe.xadd(Keys(run).steps, step_fields(run, step, now, dt, args.ids_per_step, rngs[i], secret),
                          maxlen=100_000, approximate=True)
                sent += 1
        pipe.execute()
        while scrape(port)[1] < sent - 2 * chunk * len(runs):
            time.sleep(0.05)
        print(f"\r  history: {sent:,} of {steps * len(runs):,} records sent", end="", file=sys.stderr, flush=True)
    while scrape(port)[1] < sent:
        time.sleep(0.05)
    print(file=sys.stderr)
    return time.monotonic() - t_start


def one_size(n: int, args, work: Path, env: dict, floor_us: float | None = None, workers: int = 1) -> dict:
    """One fleet size: ``sentinel run`` as the consumer, or with ``floor_us`` the floor arm
    (``bench/fleet_floor.py``: the same reads, that much fixed work a record instead of judging)."""
    from sentinel import bus
    from sentinel.protocol import Keys

    redis_proc, url = start_redis(work)
    secret_file = work / "secret"
    secret = secret_file.read_text().strip().encode()
    runs = [f"scale{n}-{i:04d}" for i in range(n)]
    log = work / f"sentinel-{n}.log"
    daemon = None
    try:
        r = bus.raw(bus.connect(url, timeout=10.0))
        t_build = time.monotonic()
        t0 = time.time()  # the records' own stamps; they are sent from when the daemon is ready (below)
        warmup = args.warmup + (HISTORY_SETTLE_S if args.history else 0.0)
        total = warmup + args.seconds
        records = build_records(runs, args.rate, total, t0, args.ids_per_step, secret, first_step=args.history + 1)
        build_s = time.monotonic() - t_build
        prof = ["-m", "cProfile", "-o", str(Path(args.profile) / f"daemon-{n}.prof")] if args.profile else []
        consumer = [sys.executable, *prof, "-m", "sentinel", "run", *runs, "--redis-url", url, "--secret-file", str(secret_file),
                    "--consumer", "bench", "--metrics-port", "0", "--workers", str(workers)]
        if floor_us is not None:
            consumer = [sys.executable, str(ROOT / "bench" / "fleet_floor.py"), *runs, "--redis-url", url,
                        "--work-us", str(floor_us)]
        daemon = subprocess.Popen(
            consumer,
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
        deadline = time.monotonic() + 60
        port = None
        while port is None:
            m = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_text(errors="replace"))
            port = int(m.group(1)) if m else None
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise Failed("sentinel did not start" if daemon.poll() is None else f"sentinel exited ({daemon.returncode})", log)
            time.sleep(0.05)
        while sum(1 for run in runs if r.get(Keys(run).leader) == b"bench") < n:  # every lease held
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise Failed("sentinel did not take the runs' leases", log)
            time.sleep(0.05)
        history_s = publish_history(r, runs, args.history, args, secret, port) if args.history else 0.0
        shift = time.time() + 0.2 - t0  # the schedule starts now; record stamps stay a few seconds early
        records = [(at + shift, stream, fields) for at, stream, fields in records]
        t0 += shift

        # ---- publish on schedule; scrape at the start and the end of the measured window
        t_measure = t0 + warmup
        i, published_in_window, snap0 = 0, 0, None
        while i < len(records):
            now = time.time()
            if snap0 is None and now >= t_measure:
                snap0 = (now, proc_cpu_seconds(daemon.pid), *scrape(port), i)
                calls0 = command_calls(r)
            j = i
            while j < len(records) and records[j][0] <= now:
                j += 1
            if j > i:
                pipe = r.pipeline(transaction=False)
                for _, stream, fields in records[i:j]:
                    pipe.xadd(stream, fields, maxlen=100_000, approximate=True)
                pipe.execute()
                i = j
            time.sleep(0.005)
        now = time.time()
        snap1 = (now, proc_cpu_seconds(daemon.pid), *scrape(port), i)
        calls1 = command_calls(r)
        rss, peak = proc_mem_mib(daemon.pid)
        published_in_window = snap1[4] - snap0[4]
        calls = {c: n - calls0.get(c, 0) for c, n in calls1.items() if c != "info" and n - calls0.get(c, 0) > 0}
        calls["xadd"] = calls.get("xadd", 0) - published_in_window  # the publisher's; the daemon's own events stay
        calls = {c: n for c, n in sorted(calls.items(), key=lambda x: -x[1]) if n > 0}
        judged = snap1[3] - snap0[3]
        # ---- the backlog at the end: how long until the daemon has judged everything
        drain_deadline = time.monotonic() + 2.0 + len(records) / 1000.0
        t_stop = time.monotonic()
        steps = len(records) - (0 if args.history else n) + n * args.history  # a start record is no step
        processed = snap1[3]
        while processed < steps and time.monotonic() < drain_deadline:
            time.sleep(0.05)
            processed = scrape(port)[1]
        drained = processed >= steps
        wall = snap1[0] - snap0[0]
        cpu = (snap1[1] - snap0[1]) / wall
        p50, p99 = quantile(snap0[2], snap1[2], 0.50), quantile(snap0[2], snap1[2], 0.99)
        keeps_up = drained and judged >= 0.97 * published_in_window
        return {
            "runs": n, "workers": workers, "records_per_s": published_in_window / wall, "judged_per_s": judged / wall,
            "cpu_cores": cpu, "cpu_per_run_ms_per_s": 1000 * cpu / n,
            "cpu_us_per_record": 1e6 * cpu * wall / max(1, judged), "rss_mib": rss, "peak_rss_mib": peak,
            "verdict_p50_ms": None if p50 is None else 1000 * p50, "verdict_p99_ms": None if p99 is None else 1000 * p99,
            "redis_calls_per_record": sum(calls.values()) / max(1, published_in_window), "redis_calls": calls,
            "keeps_up": keeps_up, "drain_seconds": time.monotonic() - t_stop if drained else None,
            "target_met": keeps_up and cpu <= 1.0 and p99 is not None and 1000 * p99 <= P99_TARGET_MS,
            "window_seconds": wall, "warmup_seconds": warmup, "build_seconds": build_s, "history_steps": args.history,
            "history_seconds": history_s,
            "load_avg_1m": os.getloadavg()[0],
        }
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
                daemon.wait()
        redis_proc.terminate()
        redis_proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="1,10,100,300", help="comma-separated fleet sizes (default: 1,10,100,300)")
    ap.add_argument("--rate", type=float, default=10.0, help="step records per second per run (default 10)")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per fleet size (default 10)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds published before the window (default 3)")
    ap.add_argument("--ids-per-step", type=int, default=64, help="sample ids per step record (default 64)")
    ap.add_argument("--history", type=int, default=0, metavar="N",
                    help="steps each run has behind it before the window (published as fast as the daemon judges "
                         "them): a fleet in mid-run (default 0: every run starts at step 1)")
    ap.add_argument("--floor-us", default="", metavar="US,...",
                    help="after each size, the floor arm with each of these amounts of work a record (microseconds): "
                         "bench/fleet_floor.py reads the same streams the same way and only spends that work, so its "
                         "p99 is what any consumer of that CPU a record gets on this machine (default: none)")
    ap.add_argument("--workers", default="1,2,3", metavar="K,...",
                    help="`sentinel run --workers K` for each K at each size of 100 runs or more where each worker "
                         "gets 50 runs or more (smaller sizes: 1 worker) (default: 1,2,3)")
    ap.add_argument("--cpu-dips", metavar="DUTY:MS:EVERY",
                    help="a noisy machine on demand (root, a cgroup CPU controller; bench/cpu_dips.py): Redis, the "
                         "daemon and the publisher get DUTY %% of the CPUs for MS every EVERY seconds, as this VM's "
                         "bad minutes do (25:80:1.5); default: the machine as it is")
    ap.add_argument("--profile", metavar="DIR", help="run the daemon under cProfile, one daemon-N.prof per size in DIR")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a Markdown table")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.runs.split(",") if x]
    except ValueError:
        ap.error(f"--runs: not a list of integers: {args.runs!r}")
    try:
        floors = [float(x) for x in args.floor_us.split(",") if x]
    except ValueError:
        ap.error(f"--floor-us: not a list of numbers: {args.floor_us!r}")
    try:
        worker_counts = [int(x) for x in args.workers.split(",") if x]
    except ValueError:
        ap.error(f"--workers: not a list of integers: {args.workers!r}")
    if not worker_counts or any(not 1 <= k <= 64 for k in worker_counts):
        ap.error("--workers: each count must be 1 to 64")
    if args.profile and worker_counts != [1]:
        ap.error("--profile profiles one process: give --workers 1")
    if any(not 0 <= w <= 1e5 for w in floors):
        ap.error("--floor-us: each amount of work must be 0 to 100000 microseconds")
    if not sizes or min(sizes) < 1 or args.rate <= 0 or args.seconds < 2 or args.warmup < 1 or args.ids_per_step < 1 \
            or args.history < 0:
        ap.error("need --runs >= 1, --rate > 0, --seconds >= 2, --warmup >= 1, --ids-per-step >= 1, --history >= 0")

    try:
        dips = DipSpec.parse(args.cpu_dips) if args.cpu_dips else None
    except ValueError as e:
        ap.error(f"--cpu-dips: {e}")
    if args.profile:
        try:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            ap.error(f"--profile {args.profile}: cannot write there ({e.strerror or type(e).__name__})")
    work = Path(tempfile.mkdtemp(prefix="daemon-scale-"))
    fd = os.open(work / "secret", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, os.urandom(24).hex().encode())
    os.close(fd)
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200",
               PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("SENTINEL_SECRET", None)
    t0 = time.monotonic()
    results = []
    try:
        with CpuDips(dips) if dips else contextlib.nullcontext():
            for n in sizes:
                one_process = None  # the floor arm stands beside one process (the first count given)
                for k in ([k for k in worker_counts if k == 1 or n // k >= 50] if n >= 100 else [1]):
                    steady = cpu_steadiness()
                    res = one_size(n, args, work, env, workers=k)
                    res["cpu_dips"] = steady
                    results.append(res)
                    one_process = one_process or res
                    print(f"N={n}, {k} worker(s): cpu {res['cpu_cores']:.3f} cores, p99 {res['verdict_p99_ms']} ms, "
                          f"keeps up {res['keeps_up']}", file=sys.stderr, flush=True)
                for w in floors:
                    steady = cpu_steadiness()
                    f = one_size(n, args, work, env, floor_us=w)
                    one_process.setdefault("floor", []).append({
                        "work_us": w, **{k: f[k] for k in ("cpu_cores", "cpu_us_per_record", "verdict_p50_ms", "verdict_p99_ms",
                                                           "keeps_up", "load_avg_1m")}, "cpu_dips": steady})
                    print(f"N={n} floor {w:g} us: cpu {f['cpu_cores']:.3f} cores, p99 {f['verdict_p99_ms']} ms",
                          file=sys.stderr, flush=True)
    except DipError as e:
        print(f"daemon_scale: --cpu-dips: {e}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
        return 2
    except (Failed, KeyboardInterrupt) as e:
        return said(ap.prog, e, work)
    except BaseException:
        print(f"(scratch kept for a look: {work})", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    version = redis_version()
    out = {"results": results, "target": f"300 runs on one core with p99 <= {P99_TARGET_MS:g} ms",
           "target_met": any(r["runs"] >= 300 and r["target_met"] for r in results),
           "rate_per_run": args.rate, "ids_per_step": args.ids_per_step, "window_seconds": args.seconds,
           "history_steps": args.history, "cpu_dips_injected": dips.as_dict() if dips else None,
           "wall_seconds": time.monotonic() - t0, "cpus": os.cpu_count(), "python": platform.python_version(),
           "redis": version, "hiredis": hiredis_available()}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    history = f" after {args.history:,} steps of history" if args.history else ""
    if dips:
        history += f", CPU dips injected ({dips.duty_percent:g} % of the CPUs for {dips.dip_ms:g} ms every {dips.every_s:g} s)"
    print(f"`sentinel run` watching N runs at {args.rate:g} steps/s each ({args.ids_per_step} ids/step), {args.seconds:g} s "
          f"window{history}, redis-server {version}, hiredis {'yes' if out['hiredis'] else 'no'}, {out['cpus']} CPUs")
    print("| runs | workers | records/s | daemon CPU (cores) | CPU per run | RSS | Redis calls per record | verdict p50 | verdict p99 | keeps up "
          "| load | CPU dips before |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|")
    for r in results:
        def ms(v):
            return "n/a" if v is None else f"{v:.1f} ms"
        print(f"| {r['runs']} | {r['workers']} | {r['records_per_s']:.0f} | {r['cpu_cores']:.3f} | {r['cpu_per_run_ms_per_s']:.2f} ms/s | "
              f"{r['rss_mib']:.0f} MiB | {r['redis_calls_per_record']:.2f} | "
              f"{ms(r['verdict_p50_ms'])} | {ms(r['verdict_p99_ms'])} | {'yes' if r['keeps_up'] else 'no'} | "
              f"{r['load_avg_1m']:.1f} | {r['cpu_dips']['dips']} in {r['cpu_dips']['seconds']:g} s "
              f"(slowest {100 * r['cpu_dips']['slowest_ratio']:.0f} %) |")
    floor_rows = [(r, f) for r in results for f in r.get("floor", [])]
    if floor_rows:
        print("\nThe floor arm (bench/fleet_floor.py: the same reads, a fixed amount of work a record), beside the daemon:")
        print("| runs | consumer | CPU a record | CPU (cores) | verdict p50 | verdict p99 | keeps up | load | CPU dips before |")
        print("|---:|---|---:|---:|---:|---:|---|---:|---|")
        for r, f in [(r, None) for r in results if r.get("floor")] + floor_rows:
            x = f or r
            name = "`sentinel run`" if f is None else f"floor, {f['work_us']:g} µs of work"
            p50 = "n/a" if x["verdict_p50_ms"] is None else f"{x['verdict_p50_ms']:.1f} ms"
            p99 = "n/a" if x["verdict_p99_ms"] is None else f"{x['verdict_p99_ms']:.1f} ms"
            print(f"| {r['runs']} | {name} | {x['cpu_us_per_record']:.0f} µs | {x['cpu_cores']:.3f} | {p50} | {p99} | "
                  f"{'yes' if x['keeps_up'] else 'no'} | {x['load_avg_1m']:.1f} | {x['cpu_dips']['dips']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
