"""The most that any detector could catch of the drilled slow climbs within 50 steps, at the judge's
false-alarm budget: an oracle's ceiling.

    python bench/probes/climb_ceiling.py [--per-run 8] [--json out.json]

The judge counts a climb as caught when a rollback to at or before its onset is ordered at most 50
steps after it, and allows at most 3 rollbacks across ~67 healthy runs. This bench asks how many of
the climbs that ``bench/decision_quality.py`` drills (``inject``: 0.2-0.5 nats over 100-300 steps,
then held, at onsets in [200, n - 120]) an *oracle* would catch under those two rules. The oracle
knows what no detector can:

- the healthy run's expected loss at every step: a local quadratic fit (Savitzky-Golay, ``--trend``
  losses wide) of the healthy losses around it, past *and future*; it judges the residuals against
  that level, not against a baseline estimated from the past;
- the run's per-step noise (a robust sigma of the healthy residuals);
- the climb's onset: its test is the matched filter for a ramp that starts exactly there,
  ``z_L = sum(k * r_k) / (sigma * sqrt(sum(k^2)))`` over the L losses from the onset, and it is
  caught when ``z_L`` passes the bar for some L <= 50 (for a ramp, the most powerful test there is).

Its bar comes from the healthy curves: the same filter at every possible onset (every 4 steps,
L = 50) of every real healthy curve, and the bar is the lowest that leaves at most 3/67 of the runs
with a z above it (one false rollback each, at least). A real detector must also estimate the
level from the past and scan for the onset, so it can only do worse than this ceiling.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: decision_quality

import decision_quality as dq

DEADLINE = 50  # the judge: a rollback at most this many steps after the onset
STRIDE = 4  # healthy scan: a candidate onset every this many steps
BUDGET = 3 / 67  # the judge: at most 3 rollbacks across ~67 healthy runs


def trend(x: np.ndarray, width: int) -> np.ndarray:
    """Savitzky-Golay (local quadratic) smoothing of ``x`` over ``width`` losses (odd); the ends are
    left NaN (no centred window there)."""
    h = width // 2
    t = np.arange(-h, h + 1, dtype=float)
    a = np.vstack([np.ones_like(t), t, t * t]).T
    coef = np.linalg.pinv(a)[0]  # the fitted value at the centre, as weights on the window
    out = np.full(len(x), np.nan)
    out[h:len(x) - h] = np.convolve(x, coef[::-1], mode="valid")
    return out


def robust_sigma(r: np.ndarray) -> float:
    r = r[np.isfinite(r)]
    return float(1.4826 * np.median(np.abs(r - np.median(r))))


def ramp_z(resid: np.ndarray, sigma: float, length: int) -> np.ndarray:
    """z of a ramp of ``length`` losses starting at each index of ``resid`` (NaN where it does not fit)."""
    k = np.arange(1, length + 1, dtype=float)
    norm = sigma * math.sqrt(float(np.sum(k * k)))
    r = np.nan_to_num(resid, nan=0.0)
    z = np.correlate(r, k, mode="valid") / norm  # z[i] = sum_k k * r[i + k - 1]
    bad = np.convolve(np.isnan(resid).astype(float), np.ones(length), mode="valid") > 0
    z[bad] = np.nan
    return z


def causal_level(x: np.ndarray, onset0: int, fit: int, power: float) -> np.ndarray | None:
    """The level a detector could know at 0-based index ``onset0``: ``a + b * step^-power`` fitted
    (least squares) to the ``fit`` losses before it, read at the next ``DEADLINE`` steps."""
    if onset0 < fit:
        return None
    t = np.arange(onset0 - fit + 1, onset0 + 1, dtype=float)  # 1-based steps of the fit span
    u = t ** -power
    b, c = np.polyfit(u, x[onset0 - fit:onset0], 1)
    return b * np.arange(onset0 + 1, onset0 + DEADLINE + 1, dtype=float) ** -power + c


def healthy_max(x: np.ndarray, a: argparse.Namespace, width: int) -> tuple[float, np.ndarray, float]:
    """(the ramp filter's largest z over the run's candidate onsets, the oracle level, sigma)."""
    lvl = trend(x, width)
    sigma = robust_sigma((x - lvl)[200:])
    lo, hi = 200, len(x) - 120
    if not a.causal:
        z = ramp_z(x - lvl, sigma, DEADLINE)[lo - 1:hi - 1:STRIDE]  # onsets lo.. (1-based step = index + 1)
        return float(np.nanmax(z)), lvl, sigma
    k = np.arange(1, DEADLINE + 1, dtype=float)
    norm = sigma * math.sqrt(float(np.sum(k * k)))
    zs = [float(np.sum(k * np.clip(x[o0:o0 + DEADLINE] - lv, -3 * sigma, 3 * sigma)) / norm)
          for o0 in range(lo - 1, hi - 1, STRIDE) if (lv := causal_level(x, o0, a.causal, a.power)) is not None]
    return (max(zs) if zs else math.nan), lvl, sigma


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dq.add_curve_args(ap)
    ap.add_argument("--per-run", type=int, default=8, help="climbs drilled per real curve")
    ap.add_argument("--trend", type=int, default=201, help="width of the oracle's level fit, losses (odd)")
    ap.add_argument("--causal", type=int, default=0, metavar="FIT",
                    help="a causal oracle instead: the level is a + b * step^-POWER fitted to the FIT losses before the onset")
    ap.add_argument("--power", type=float, default=0.5)
    ap.add_argument("--synthetic", type=int, default=0, metavar="N",
                    help="also: how many of N fresh synthetic healthy runs (seeds 2000..) pass the bar set on the real ones")
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    runs = dq.real_curves(a)
    width = a.trend | 1

    per_run_max, fits = [], []
    for run in runs:
        x = np.asarray(run.losses, dtype=float)
        top, lvl, sigma = healthy_max(x, a, width)
        per_run_max.append(top)
        fits.append((x, lvl, sigma))
    tops = sorted((t for t in per_run_max if t == t), reverse=True)
    allowed = math.floor(BUDGET * len(runs))  # runs that may pass the bar
    bar = tops[allowed] if allowed < len(tops) else 0.0

    rng = np.random.default_rng(0)
    bands: dict[str, list[int]] = {}
    k = np.arange(1, DEADLINE + 1, dtype=float)
    for run, (x, lvl, sigma) in zip(runs, fits):
        n = len(x)
        for onset in rng.integers(200, n - 120, a.per_run):
            onset = int(onset)
            dmg, label = dq.inject(run, "climb", onset, rng)
            ref = lvl[onset - 1:onset - 1 + DEADLINE]
            if a.causal:
                ref = causal_level(x, onset - 1, a.causal, a.power)
                if ref is None:
                    continue
            resid = np.asarray(dmg, dtype=float)[onset - 1:onset - 1 + DEADLINE] - ref
            if a.causal:  # clipped at 3 sigma, as the healthy scan is (a spike is not a ramp)
                resid = np.clip(resid, -3 * sigma, 3 * sigma)
            zl = np.cumsum(k * np.nan_to_num(resid)) / (sigma * np.sqrt(np.cumsum(k * k)))
            c = bands.setdefault(label, [0, 0])
            c[0] += bool(np.nanmax(zl) > bar)
            c[1] += 1

    how = f"a + b * step^-{a.power:g} fitted to the {a.causal} losses before the onset" if a.causal else f"local quadratic over {width} losses"
    print(f"{len(runs)} real healthy curves; oracle level: {how}; "
          f"per-step sigma (median over runs) {np.median([f[2] for f in fits]):.4f}")
    print(f"healthy: the ramp filter's largest z per run (L = {DEADLINE}, every {STRIDE} steps): "
          f"top {', '.join(f'{t:.2f}' for t in tops[:5])}; median {np.median(tops):.2f}")
    print(f"bar that leaves at most {allowed} of {len(runs)} runs over it ({BUDGET:.3f} of them): {bar:.2f}")
    total = [0, 0]
    for label in sorted(bands):
        c = bands[label]
        total[0] += c[0]
        total[1] += c[1]
        print(f"  {label:24} caught by the oracle within {DEADLINE} steps: {c[0]}/{c[1]} ({c[0] / c[1]:.1%})")
    print(f"  all climbs: {total[0]}/{total[1]} ({total[0] / total[1]:.1%})"
          + (" (onsets before the fit span has its losses are left out)" if a.causal else ""))
    out = {"runs": len(runs), "bar": bar, "healthy_top_z": tops[:10], "bands": bands, "all": total}
    if a.synthetic:
        syn = [healthy_max(np.asarray(dq.synthetic_healthy(2000 + i).losses, dtype=float), a, width)[0] for i in range(a.synthetic)]
        over = sum(t > bar for t in syn)
        print(f"fresh synthetic healthy runs (seeds 2000-{1999 + a.synthetic}) over that bar: {over}/{a.synthetic}; "
              f"their largest z: median {np.nanmedian(syn):.2f}, 90th percentile {np.nanpercentile(syn, 90):.2f}")
        out["synthetic_over_bar"] = [over, a.synthetic]
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
