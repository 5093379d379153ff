"""Where does a climb's z go? The 48-step climb test's z against the best any test could have.

    python bench/probes/climb_autopsy.py [--slopes 0.003,0.004,0.005] [--per-run 2]

For a ramp of slope s from a known onset, on white noise of per-step sigma and a *perfectly known*
healthy level, the matched filter over the first 48 losses reaches ``s * sqrt(sum k^2) / sigma``
(``ideal``). The rules' test (``sentinel.detectors.ClimbTrend`` inside ``LossEval``, default rules)
loses part of that to:
- its baseline: the mean of the 100 losses before the window has an error of its own, which
  enters every term (``÷ zden / sqrt(sum k^2)``, 1.17 for 48 + 100);
- the healthy descent: the flat baseline subtracts it from the climb, the descent credit gives half
  of it back;
- the run's slow-noise factor phi: ``PHI_UNCALIBRATED`` (1.5) until 10 blocks of 48 losses have
  left the window, about step 630;
- alignment: the test judges every 4th loss.
This injects never-held ramps into every real curve (``--per-run`` onsets in [200, n - 120], as
``bench/drill_shapes.py``), feeds ``LossEval`` alone (no policy, no rollback), and reads the test's
largest z at steps onset + 40 .. onset + 50 (the exact pass forced at every verdict step, so z is
known below the bar too), with its phi, by onset band. Reads the real curves only; tunes nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: decision_quality

import decision_quality as dq

from sentinel.detectors.climb import ClimbTrend
from sentinel.rules import default_rules
from sentinel.rules.loss import LossEval

BANDS = ((200, 700), (700, 1500), (1500, 10**9))


def per_step_sigma(x: np.ndarray) -> float:
    d = np.diff(x)
    return float(1.4826 * np.median(np.abs(d - np.median(d))) / math.sqrt(2.0))


def drill(losses: list[float], onset: int, slope: float) -> dict:
    """The test's largest z (and its phi) at steps onset + 40 .. onset + 50 of one ramp drill."""
    x = np.asarray(losses, dtype=float).copy()
    x[onset - 1:] += slope * np.arange(1, len(x) - onset + 2, dtype=float)
    ev = LossEval(default_rules().rules)
    cl = ev.climb
    best = {"z": -math.inf, "phi": math.nan}
    for i in range(onset + 50):
        step = i + 1
        ev({"step": step, "loss": float(x[i])}, [])
        if step >= onset + 40 and cl.n % cl.stride == 0 and cl._last_noise > 0 and cl.z > best["z"]:
            best = {"z": cl.z, "phi": cl._phi_val}
    sigma = per_step_sigma(np.asarray(losses[max(0, onset - 500):onset - 1]))
    norm = math.sqrt(sum(k * k for k in range(1, cl.window + 1)))
    return {**best, "onset": onset, "ideal": slope * norm / sigma, "base_err": cl._zden / norm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dq.add_curve_args(ap)
    ap.add_argument("--slopes", default="0.003,0.004,0.005")
    ap.add_argument("--per-run", type=int, default=2)
    a = ap.parse_args()
    runs = dq.real_curves(a)
    ClimbTrend.GATE = 1e9  # the exact z at every verdict step (the verdicts are the same; this only reads z)
    bar = default_rules().rules.divergence.climb_sigmas
    print(f"{len(runs)} real curves, {a.per_run} never-held ramps each per slope; bar {bar:g}; largest z at onset + 40..50")
    print(f"{'slope':>7} {'onsets':>11} {'drills':>6} {'ideal z':>8} {'÷ baseline err':>15} {'z x phi':>8} "
          f"{'z':>6} {'phi 1.5':>8} {'z > bar':>8}")
    rng = np.random.default_rng(0)
    for slope in (float(s) for s in a.slopes.split(",") if s):
        rows = [drill(run.losses, int(o), slope) for run in runs for o in rng.integers(200, len(run.losses) - 120, a.per_run)]
        for lo, hi in ((200, 10**9), *BANDS):
            sel = [r for r in rows if lo <= r["onset"] < hi]
            if not sel:
                continue
            z = np.array([r["z"] for r in sel])
            phi = np.array([r["phi"] for r in sel])
            ideal = np.array([r["ideal"] for r in sel])
            band = "all" if hi == 10**9 and lo == 200 else f"{lo}-{hi if hi < 10**9 else 'end'}"
            print(f"{slope:>7g} {band:>11} {len(sel):>6} {np.median(ideal):>8.2f} {np.median(ideal / sel[0]['base_err']):>15.2f} "
                  f"{np.median(z * phi):>8.2f} {np.median(z):>6.2f} {np.mean(np.isclose(phi, 1.5)):>8.2f} {np.mean(z > bar):>8.2f}")


if __name__ == "__main__":
    main()
