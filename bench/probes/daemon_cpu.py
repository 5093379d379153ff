"""The daemon's CPU per step record, in process: N runs, one record each per poll, as a fleet's.

    python bench/probes/daemon_cpu.py [--runs 300] [--steps 60] [--per-iteration K] [--profile FILE]

A fresh Debian ``redis-server``; one ``Daemon`` (the default rules, ``sentinel run``'s ``state_save_s`` and
``side_read_s``, and the collector frozen, as ``sentinel run`` has them) watching N runs. Each round XADDs one signed
``StepRecord`` per run (64 sample ids), then iterates the daemon until it judged them all: the
process CPU time of those iterations over the records judged, after 20 rounds of warm-up.
``--per-iteration K`` XADDs K records at a time instead (a fleet's iteration under
``bench/daemon_scale.py`` sees about 10 at 300 runs), so the figure holds the iteration's own cost. Not
the wall clock: the figure holds on a shared machine, where ``bench/daemon_scale.py``'s latency
does not. ``--profile`` writes a cProfile of the measured rounds. Run it with and without
``hiredis`` importable (``pip install --target DIR hiredis``, ``PYTHONPATH=.:DIR``) to see what
the C reply parser saves; alternate the two, the machine drifts.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: redis_server, daemon_scale

from daemon_scale import build_records, hiredis_available
from redis_server import start_redis


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--steps", type=int, default=60, help="records per run (20 rounds of warm-up among them)")
    ap.add_argument("--per-iteration", type=int, default=0, metavar="K",
                    help="records XADDed between iterations (default: one per run, all runs at once)")
    ap.add_argument("--profile", metavar="FILE", help="write a cProfile of the measured rounds")
    args = ap.parse_args()
    if args.runs < 1 or args.steps < 25:
        ap.error("need --runs >= 1 and --steps >= 25")

    from sentinel import bus
    from sentinel.cli.run_cmd import SIDE_READ_S, STATE_SAVE_S
    from sentinel.daemon import Daemon, Options
    from sentinel.metrics import SentinelMetrics
    from sentinel.rules import default_rules

    work = Path(tempfile.mkdtemp(prefix="daemon-cpu-"))
    proc, url = start_redis(work)
    try:
        secret, n = b"probe-secret-0123456789abcdef", args.runs
        r = bus.connect(url)
        runs = [f"cpu{i:04d}" for i in range(n)]
        d = Daemon(r, Options(rules=default_rules(), secret=secret, consumer="probe", state_save_s=STATE_SAVE_S,
                           side_read_s=SIDE_READ_S), runs=runs,
                   metrics=SentinelMetrics(), log=lambda _m: None)
        d.iterate(block_ms=10)
        records = build_records(runs, 10.0, args.steps / 10.0, time.time() - 100.0, 64, secret)
        raw = bus.raw(r)
        gc.collect()
        gc.freeze()
        gc.set_threshold(20_000, 10, 10)
        prof = cProfile.Profile() if args.profile else None
        cpu, judged = 0.0, 0
        chunk = args.per_iteration or n
        for k in range(0, len(records), chunk):
            batch = records[k:k + chunk]
            pipe = raw.pipeline(transaction=False)
            for _, stream, fields in batch:
                pipe.xadd(stream, fields)
            pipe.execute()
            measured = k >= 21 * n
            want = len(batch) - sum(1 for _, _, f in batch if '"kind":"start"' in f["json"])  # start records are not counted
            c = time.process_time()
            if prof and measured:
                prof.enable()
            got = 0
            while got < want:
                got += d.iterate(block_ms=10)
            if prof and measured:
                prof.disable()
            if measured:
                cpu += time.process_time() - c
                judged += got
        print(f"{n} runs, hiredis {'yes' if hiredis_available() else 'no'}: {1e6 * cpu / judged:.1f} us of daemon CPU "
              f"per record ({judged} records judged)")
        if prof:
            prof.dump_stats(args.profile)
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
