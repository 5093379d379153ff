"""The early-descent jump test (``DescentJump``) on its own: where it judges, how close healthy runs
come to its bar, and which jumps it catches.

    python bench/probes/early_jump.py [--synthetic 100] [--variants ema0.5,ema0.3,...] [--json out.json]

``bench/decision_quality.py --onsets 30-200`` scores the whole sentinel on early damage; this looks
inside the one test built for it, over every real curve (``../shared/curves`` and
``bench/curves-validation``), synthetic healthy runs (``decision_quality.synthetic_healthy``,
tuning seeds 0.. and held-out seeds 1000..) and the same real curves as other trainers would log
them (``logging_variants.logged``):

1. *Rawness*: of the test's verdict points (onsets 50-250), the share that passes its two checks
   that the log is raw (first differences correlated at most ``RAW_RHO``; level noise at most
   ``RAW_RATIO`` x the per-step noise). A raw log should pass nearly always, a smoothed one rarely.
2. *Healthy margin*: the largest z per run among verdict points that pass every other check (the
   rise floor, the lower quartile, the hold), against the bar. Every run here is healthy, so a z
   above the bar is a false rollback.
3. *Catch rate*: a jump of 0.25-1.0 nats (never decaying) injected at onsets 50-250 of each real
   curve; caught = a verdict within ``post`` + 4 steps (28) with ``onset()`` at the jump or up to
   half a ``post`` window (12 steps) before it (the test alone, not the rest of the sentinel), by
   jump size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: decision_quality

import decision_quality as dq
import logging_variants as lv

from sentinel.detectors import DescentJump

VARIANTS = "ema0.5,ema0.3,ema0.2,ema0.1,roll10,roll20,quiet0.3,quiet0.2,round2"


def replay(steps, losses) -> tuple[int, int, float]:
    """(verdict points, points judged raw, largest z that passed every other check) of one log."""
    dj = DescentJump()
    dj.tally = True  # the rawness gate at every point: the share judged raw counts them all
    bar, dj.sigmas = dj.sigmas, -1e9  # every check but the bar: the z that would have had to clear it
    top = 0.0
    for s, x in zip(steps, losses):
        if dj.update(int(s), round(float(x), 4), 0.0):
            top = max(top, dj.z)
    dj.sigmas = bar
    return dj._points, dj._points - dj._gated, top


def healthy_rows(label: str, logs) -> dict:
    pts = raw = 0
    tops = []
    for name, s, x in logs:
        p, r, t = replay(s, x)
        pts, raw = pts + p, raw + r
        tops.append((t, name))
    tops.sort(reverse=True)
    bar = DescentJump().sigmas
    row = {"set": label, "runs": len(tops), "raw_share": raw / pts if pts else None,
           "over_bar": sum(t > bar for t, _ in tops), "top_z": [[round(t, 2), n] for t, n in tops[:3]]}
    share = f"{row['raw_share']:.2f}" if pts else "-"
    print(f"{label:28} {len(tops):>4} runs  raw {share:>5}  z>bar {row['over_bar']:>2}  top z "
          + ", ".join(f"{t:.2f} ({n[-12:]})" for t, n in tops[:3]), flush=True)
    return row


def catch_rows(runs: list[dq.Run], per_run: int) -> list[dict]:
    rng = np.random.default_rng(0)
    bands = {(0.25, 0.5): [0, 0], (0.5, 0.75): [0, 0], (0.75, 1.0001): [0, 0]}
    for run in runs:
        for _ in range(per_run):
            onset, a = int(rng.integers(50, 251)), float(rng.uniform(0.25, 1.0))
            x = np.asarray(run.losses[:onset + 40], dtype=float).copy()
            x[onset - 1:] += a
            dj = DescentJump()
            hit = next((s for s, v in enumerate(x, start=1) if dj.update(s, round(float(v), 4), 0.0)), None)
            ok = hit is not None and hit <= onset + dj.post + 4 and onset - dj.post // 2 <= dj.onset() <= onset
            for (lo, hi), c in bands.items():
                if lo <= a < hi:
                    c[0] += ok
                    c[1] += 1
    rows = []
    for (lo, hi), (k, n) in bands.items():
        rows.append({"jump": f"{lo:g}-{min(hi, 1.0):g}", "caught": k, "drills": n})
        print(f"  jump {lo:g}-{min(hi, 1.0):g} nats at onsets 50-250: caught {k}/{n}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dq.add_curve_args(ap)
    ap.add_argument("--synthetic", type=int, default=100, help="synthetic healthy runs per set (tuning and held-out)")
    ap.add_argument("--variants", default=VARIANTS)
    ap.add_argument("--per-run", type=int, default=6, help="jumps injected per real curve")
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    runs = dq.real_curves(a)

    def raw_logs(rs):
        return [(r.name, np.arange(1, len(r.losses) + 1), r.losses) for r in rs]

    print(f"{'set':28} healthy runs, share of verdict points judged raw, runs over the bar ({DescentJump().sigmas:g})")
    out = {"healthy": [healthy_rows("real curves, raw", raw_logs(runs))]}
    out["healthy"].append(healthy_rows("synthetic (tuning seeds)", raw_logs(dq.synthetic_healthy(s) for s in range(a.synthetic))))
    out["healthy"].append(healthy_rows("synthetic (held out)", raw_logs(dq.synthetic_healthy(dq.HELD_OUT_FROM + s) for s in range(a.synthetic))))
    for v in (v for v in a.variants.split(",") if v):
        out["healthy"].append(healthy_rows(f"real curves as {v}", [(r.name, *lv.logged(r, v)[:2]) for r in runs]))
    print("catch rate of the test alone, one jump per drill:")
    out["catch"] = catch_rows(runs, a.per_run)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
