"""How the timely-rollback rate depends on the damage's shape: a climb's slope, a decay's speed.

    python bench/drill_shapes.py [--climbs 0.0015,0.002,...] [--decays 30,60,...] [--per-run 2] [--json out.json]

``bench/decision_quality.py`` draws its drills from fixed ranges (a climb of 0.2-0.5 nats over
100-300 steps, a jump decaying with a time constant of 300-3000 steps). A judge, or a real fault,
may use others. This sweeps one parameter at a time over every real curve (``../shared/curves``
and ``bench/curves-validation``), through the same path as the CLI (``run_backtest``: default rules,
a checkpoint every 100 steps and one of step 0), ``--per-run`` onsets per curve drawn in
[200, n - 120]:

- *climbs*: a ramp of a fixed slope (nats per step) from the onset on, never held: the loss is
  ``slope x 50`` nats up 50 steps after the onset;
- *decays*: a jump of 0.25-1.0 nats (uniform) decaying with a fixed time constant (steps);
- ``--others``: shapes no other bench drills (``OTHER_SHAPES``: a noisier jump, a multiplicative
  one, a jump that partly recovers, stairs, a jump with spikes, a small jump, a jump reached over
  10 steps, an exponential runaway), one line each.

Each line: timely (a rollback within 50 steps of the onset with ``to_step`` at or before it), late,
wrong target, missed (no rollback within 200 steps) and false before (a rollback or pause before the
onset), and the median delay of the first rollback after the onset.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decision_quality as dq

OTHER_SHAPES = {
    "jump-noisy": "a jump of 0.25-1.0 nats, and the per-step noise doubles from the onset",
    "mult": "the loss multiplied by 1.08-1.3 from the onset",
    "partial": "a jump of 0.25-1.0 that falls back to 40 % of itself (time constant 20 steps) and stays",
    "stairs": "two steps of half a 0.25-1.0 jump, 20 steps apart",
    "spiky": "a jump of 0.25-1.0 with a +1.5-nat spike every 7th step",
    "small": "a jump of only 0.15-0.25 nats (below the judged range)",
    "ramp-jump": "a jump of 0.25-1.0 reached over 10 steps",
    "runaway": "0.02 x (exp(k / 25) - 1): 0.13 nats after 50 steps, 1.07 after 100",
}


def other_shape(kind: str, x: np.ndarray, i: int, rng: np.random.Generator) -> np.ndarray:
    """``x`` with one damage of a shape no other bench drills, from 0-based index ``i`` (``OTHER_SHAPES``)."""
    k = np.arange(len(x) - i, dtype=float)
    a = rng.uniform(0.25, 1.0)
    if kind == "jump-noisy":
        x[i:] += a + (x[i:] - np.convolve(x, np.ones(21) / 21, mode="same")[i:])
    elif kind == "mult":
        x[i:] *= rng.uniform(1.08, 1.3)
    elif kind == "partial":
        x[i:] += a * (0.4 + 0.6 * np.exp(-k / 20))
    elif kind == "stairs":
        x[i:] += a / 2
        x[i + 20:] += a / 2
    elif kind == "spiky":
        x[i:] += a
        x[i::7] += 1.5
    elif kind == "small":
        x[i:] += rng.uniform(0.15, 0.25)
    elif kind == "ramp-jump":
        x[i:] += a * np.minimum(k + 1, 10) / 10
    elif kind == "runaway":
        x[i:] += 0.02 * (np.exp(np.minimum(k, 400) / 25) - 1)
    else:
        raise ValueError(f"unknown shape {kind!r} (one of {', '.join(OTHER_SHAPES)})")
    return x


def sweep(runs: list[dq.Run], kind: str, value: float, per_run: int, rng: np.random.Generator) -> dict:
    """Outcome counts and median delay of ``per_run`` drills per run of one shape."""
    counts, delays = [0] * len(dq.OUTCOMES), []
    for run in runs:
        n = len(run.losses)
        for onset in rng.integers(200, n - 120, per_run):
            onset = int(onset)
            x = np.asarray(run.losses, dtype=float).copy()
            k = np.arange(n - onset + 1, dtype=float)
            if kind == "climb":
                x[onset - 1:] += value * (k + 1)
            elif kind == "decay":
                x[onset - 1:] += rng.uniform(0.25, 1.0) * np.exp(-k / value)
            else:
                x = other_shape(kind, x, onset - 1, rng)
            end = min(n, onset + dq.HORIZON)
            dmg = [round(float(v), 4) for v in x[:end]]
            outcome, delay = dq.drill_outcome(dq.run_backtest(run.name, dmg, run.wall_ms[:end])["actions"], onset)
            counts[outcome] += 1
            if delay is not None:
                delays.append(delay)
    return {"shape": kind, "value": value, **dict(zip(dq.OUTCOMES, counts)),
            "median_delay": float(np.median(delays)) if delays else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dq.add_curve_args(ap)
    ap.add_argument("--climbs", default="0.0015,0.002,0.003,0.004,0.005,0.0075,0.01", help="climb slopes, nats per step")
    ap.add_argument("--decays", default="30,60,100,300,1000", help="decay time constants, steps")
    ap.add_argument("--others", default="", help="other shapes, comma-separated: " + ", ".join(OTHER_SHAPES))
    ap.add_argument("--per-run", type=int, default=2, help="drills per run per value")
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    runs = dq.real_curves(a)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{len(runs)} real curves, {a.per_run} drills per curve per value")
    print(f"{'shape':10} {'value':>8}  " + "  ".join(f"{o:>12}" for o in dq.OUTCOMES) + "  median delay")
    for kind, values in (("climb", a.climbs), ("decay", a.decays), *((o, "0") for o in a.others.split(",") if o)):
        for v in (float(s) for s in values.split(",") if s):
            r = sweep(runs, kind, v, a.per_run, rng)
            rows.append(r)
            print(f"{kind:10} {v:>8g}  " + "  ".join(f"{r[o]:>12}" for o in dq.OUTCOMES) + f"  {r['median_delay']}", flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
