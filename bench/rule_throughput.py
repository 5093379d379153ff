"""Records per second through the full default rule set, on one core.

    /tmp/venv/bin/python bench/rule_throughput.py [--n 200000]

Records are built (and pydantic-validated) before the clock starts: the daemon parses each record
once anyway, and what this measures is the cost the rules add per step. Two record shapes:
"loss-only" (step + loss, what public logs give) and "full" (every telemetry field a trainer in
this repo emits, 8 ranks). Two scopes: ``RuleEngine.evaluate`` (the detectors) and
``RunPolicy.on_step`` (detectors + cooldowns + incident state machine, what the daemon calls).
Healthy noise with a spike every ~500 steps, so the anomaly path is exercised too.
Timed with ``time.process_time`` (CPU seconds of this process), so "records per second" means per
CPU-second of one core, and other work on a shared machine does not count against it (it still
costs some cache); best of ``--repeat`` runs.
Target: >= 200k records/s for the engine on full records.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sentinel.policy import RunPolicy
from sentinel.protocol import StepRecord
from sentinel.rules import RuleEngine, default_rules


def make_records(n: int, full: bool, seed: int = 0) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1)
    loss = 3.0 + 4.0 * steps ** -0.3 + rng.normal(0, 0.03, n)
    spikes = rng.random(n) < 1 / 500
    loss[spikes] *= 1.5
    grad = np.abs(rng.normal(1.0, 0.1, n)) + spikes * 5
    out = []
    for i in range(n):
        kw = dict(run="bench", step=int(steps[i]), loss=float(loss[i]), loss_max_rank=float(loss[i]) * 1.02,
                  grad_norm=float(grad[i]) if full else 0.0, lr=3e-4, tokens=int(steps[i]) * 524288,
                  batch_fingerprint="ab" * 8, time=1000.0 + i * 0.5)
        if full:
            r = rng.normal(0.5, 0.01, 8)
            kw.update(step_seconds=0.5, phases={"data_wait": 0.01, "forward_backward": 0.45, "optimizer": 0.03, "telemetry": 0.01},
                      rank_step_seconds=[float(x) for x in r], rank_losses=[float(loss[i]) + float(x) for x in rng.normal(0, 0.05, 8)],
                      tokens_per_second=float(1.0e6 + rng.normal(0, 1e4)), mfu=0.41, checkpoint_age_seconds=float(i % 1000),
                      world_size=8, sample_ids=list(range(i * 8, i * 8 + 8)))
            if i % 250 == 0:
                kw.update(val_loss=float(loss[i]) + 0.05)
        out.append(StepRecord(**kw))
    return out


def timeit(fn, records, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        t = time.process_time()
        fn(records)
        best = min(best, time.process_time() - t)
        gc.enable()
    return len(records) / best


def run_engine(records):
    ev = RuleEngine(default_rules()).evaluate
    for r in records:
        ev(r)


def run_policy(records):
    clock = [0.0]
    p = RunPolicy("bench", default_rules(), clock=lambda: clock[0])
    on_step = p.on_step
    for r in records:
        on_step(r)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = []
    for shape in ("loss-only", "full"):
        recs = make_records(a.n, full=shape == "full")
        for scope, fn in (("RuleEngine.evaluate", run_engine), ("RunPolicy.on_step", run_policy)):
            rows.append({"records": shape, "scope": scope, "records_per_s": round(timeit(fn, recs, a.repeat))})
    if a.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"python {platform.python_version()} on {platform.machine()}, {a.n} records, best of {a.repeat}, one core")
    print(f"{'records':<10} {'scope':<22} {'records/s':>12}  target 200k")
    for r in rows:
        ok = "ok" if r["records_per_s"] >= 200_000 else "BELOW"
        print(f"{r['records']:<10} {r['scope']:<22} {r['records_per_s']:>12,}  {ok}")


if __name__ == "__main__":
    main()
