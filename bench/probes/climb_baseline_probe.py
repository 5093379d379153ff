"""Would the climb test separate climbs from healthy runs better against the descent's own trend?

    python bench/probes/climb_baseline_probe.py [--window 48] [--baseline 100] [--onsets 8]

The 48-step climb test (``sentinel.detectors.ClimbTrend``) measures its ramp against a *flat*
baseline: the clipped mean of the 100 losses before the window. A healthy loss still falls there,
so the descent is subtracted from every climb, and that is one reason a 0.004-nat/step climb is
only sometimes over the bar 48 steps in. This probe asks whether extrapolating the baseline's own
(robust, never rising) slope into the window, in full or in part (``alpha``), would help.

Two more rows fit the slope over the 600 losses before the window instead (its error ~10x smaller;
drills whose onset leaves fewer than 600 losses before the window are not counted there). The
descent decelerates, so a slope fitted further back over-predicts it: healthy runs score higher.

It computes the bare matched-filter z (no spike holding, no slow-noise factor, no past check, so
it isolates the baseline) on every real curve:
- *healthy*: the largest z per run over every 4th step from step 300 on;
- *drills*: z exactly 48 steps after a climb's onset (slopes 0.002-0.005 nats/step, ``--onsets``
  random onsets per curve in [200, n - 120], one generator seed), and the share over the bar.
The null standard deviation counts the baseline's level error and, with a trend, its slope error,
so each z is in units of its own noise. Reads the real curves only (``../shared/curves`` and
``bench/curves-validation``); nothing is tuned here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: decision_quality
import decision_quality as dq

SLOPES = (0.002, 0.003, 0.004, 0.005)
ALPHAS = (0.0, 0.5, 1.0)  # the share of the baseline's slope carried into the window (0: today's flat baseline)
LONG_FITS = ((0.5, 600), (1.0, 600))  # (alpha, losses): a slope fitted over a longer history before the window


def per_step_sigma(x: np.ndarray) -> float:
    """Robust per-step noise: the MAD of first differences, over sqrt(2)."""
    d = np.diff(x)
    return float(1.4826 * np.median(np.abs(d - np.median(d))) / np.sqrt(2.0))


def ramp_z(x: np.ndarray, end: int, sigma: float, alpha: float, window: int, baseline: int, fit: int = 0) -> float:
    """z of a ramp over the ``window`` losses ending at index ``end`` against the ``baseline``
    before them (clipped to +-3 sigma of their median), a descent slope carried in by ``alpha``:
    the baseline's own (``fit`` 0) or one fitted over the ``fit`` losses before the window (clipped
    to +-3 sigma of their quarters' medians; a longer fit has a smaller slope error)."""
    k = np.arange(1.0, window + 1.0)
    w = x[end - window + 1:end + 1]
    b = x[end - window + 1 - baseline:end - window + 1]
    m, c = float(np.median(b)), 3.0 * sigma
    bc = np.clip(b, m - c, m + c)
    level = float(bc.mean())
    h, hc = (b, bc) if not fit else (x[end - window + 1 - fit:end - window + 1], None)
    if hc is None:
        q = fit // 4
        med = np.repeat([np.median(h[i * q:(i + 1) * q]) for i in range(4)], q)
        med = np.concatenate([med, np.full(fit - len(med), med[-1])])
        hc = np.clip(h, med - c, med + c)
    tb = np.arange(len(hc)) - (len(hc) - 1) / 2.0
    slope = min(0.0, float((tb * (hc - hc.mean())).sum() / (tb * tb).sum()))  # a descent only
    lead = (baseline + 1) / 2.0 + k - 1.0  # steps from the baseline's centre to each window loss
    r = np.clip(w - (level + alpha * slope * lead), -c, c)
    var = float((k * k).sum() + k.sum() ** 2 / baseline)
    if alpha:
        var += float((alpha * (k * lead).sum()) ** 2 / (tb * tb).sum())
    return float((k * r).sum() / (sigma * np.sqrt(var)))


def _share_over(zs: list[float], bar: float) -> float:
    z = np.array(zs)
    z = z[~np.isnan(z)]
    return float(np.mean(z > bar))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    dq.add_curve_args(ap)
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--baseline", type=int, default=100)
    ap.add_argument("--onsets", type=int, default=8, help="climb onsets per curve")
    ap.add_argument("--bar", type=float, default=5.5)
    a = ap.parse_args()
    runs = dq.real_curves(a)
    rng = np.random.default_rng(7)
    variants = [(al, 0) for al in ALPHAS] + list(LONG_FITS)
    healthy: dict[tuple[float, int], list[float]] = {v: [] for v in variants}
    drills: dict[tuple[tuple[float, int], float], list[float]] = {(v, s): [] for v in variants for s in SLOPES}
    def first(v):  # the first index with a full history for this variant
        return max(300, a.window + max(a.baseline, v[1]))
    for run in runs:
        x = np.asarray(run.losses, float)
        n = len(x)
        sigma = per_step_sigma(x[200:])
        for v in variants:
            healthy[v].append(max(ramp_z(x, t, sigma, v[0], a.window, a.baseline, v[1]) for t in range(first(v), n, 4)))
        for onset in rng.integers(200, n - 120, a.onsets):
            end = int(onset) + a.window - 1
            for s in SLOPES:
                y = x.copy()
                y[onset - 1:] += s * (np.arange(n - onset + 1) + 1)
                for v in variants:
                    enough = end - a.window + 1 - max(a.baseline, v[1]) >= 0  # an onset too early for a long fit: not counted
                    drills[(v, s)].append(ramp_z(y, end, sigma, v[0], a.window, a.baseline, v[1]) if enough else np.nan)
    print(f"{len(runs)} real curves; window {a.window}, baseline {a.baseline}; climb z {a.window} steps after the onset, "
          f"{a.onsets} onsets per curve")
    print("| baseline | healthy max z: largest / p90 / median | " + " | ".join(f"{s}/step: > {a.bar} (median z)" for s in SLOPES) + " |")
    print("|---|---|" + "---|" * len(SLOPES))
    for v in variants:
        h = np.array(healthy[v])
        name = "flat (today)" if v[0] == 0 else f"trend x {v[0]}" + (f", fitted over {v[1]}" if v[1] else "")
        cells = [f"{_share_over(drills[(v, s)], a.bar):.2f} ({np.nanmedian(drills[(v, s)]):.1f})" for s in SLOPES]
        print(f"| {name} | {h.max():.2f} / {np.percentile(h, 90):.2f} / {np.median(h):.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
