"""False pages and detection of the ``slice_regression`` rule on simulated per-slice eval curves.

    python bench/slice_rule_quality.py [--seeds 100] [--set heldout|tuning|both] [--json]

Every run has 4 slices and 120 evaluations. Each slice follows its own curve,
``base + amp * exp(-e / tau) - drift * e`` (different floors, amplitudes, time constants and
late-improvement rates per slice, drawn per seed), shaped by an LR schedule, plus eval noise whose
scale differs per slice (0.01-0.05 nats, real tiny-model evals show 0.03-0.04).

Healthy scenarios (a page anywhere is a false page):
gauss, t3 (Student-t df=3, same scale), ar1 (AR(1) phi=0.9: slowly drifting eval noise),
outliers (Gaussian + a single eval off by +0.3..+1.0 nats with probability 3%), warmup (a
20-eval plateau before the descent), cooldown (the last 25 evals all slices drop 0.3 nats fast),
mixed (t3 noise + AR(1) + outliers + cooldown together), ar1_common (one AR(1) phi=0.9 drift shared
by every slice, each with its own loading 0.7-1.3, plus the slice's own Gaussian noise: a drifting
eval pipeline or checkpoint moves every slice together).

In ``ar1`` every slice drifts on its own, independently of the others: the harder case for a rule
that compares slices, kept as the main figure. ``ar1_common`` is the other end; real eval noise is
likely a mix of both.

Regression scenarios: one slice (random) starts rising at eval 60 while the others keep improving:
ramp (+0.02 nats/eval), slow (+0.01 nats/eval), step (+0.2 nats at once), each under t3 noise and
ramp also under AR(1) noise (ramp_ar1: independent, ramp_ar1_common: shared drift). Detected = the first page
after the onset names that slice (delay in
evals from the onset); a page before the onset or naming another slice is a false page.

Seeds 0..N-1 are the tuning set; seeds 10_000.. are held out (never looked at while tuning).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sentinel.protocol import StepRecord
from sentinel.rules import RuleEngine, default_rules

N_EVALS, N_SLICES, ONSET, EVAL_EVERY = 120, 4, 60, 50
NAMES = ("shakespeare", "pydoc", "stdlib", "prose")


def _noise(rng: np.random.Generator, kind: str, scale: float) -> np.ndarray:
    if kind == "gauss":
        return rng.normal(0, scale, N_EVALS)
    if kind == "t3":
        return scale * rng.standard_t(3, N_EVALS) / math.sqrt(3)  # unit variance t3, heavy tails
    if kind == "ar1":
        phi, e = 0.9, rng.normal(0, scale * math.sqrt(1 - 0.81), N_EVALS)
        x = np.empty(N_EVALS)
        x[0] = rng.normal(0, scale)
        for i in range(1, N_EVALS):
            x[i] = phi * x[i - 1] + e[i]
        return x + rng.normal(0, scale / 3, N_EVALS)
    raise ValueError(kind)


def simulate(scenario: str, seed: int) -> tuple[np.ndarray, int | None]:
    """(evals x slices) losses and the index of the regressing slice (None: healthy)."""
    rng = np.random.default_rng(seed)
    e = np.arange(N_EVALS, dtype=float)
    noise_kind = {"t3": "t3", "ramp": "t3", "slow": "t3", "step": "t3", "ar1": "ar1", "ramp_ar1": "ar1"}.get(scenario, "gauss")
    out = np.empty((N_EVALS, N_SLICES))
    bad = int(rng.integers(N_SLICES)) if scenario in REGRESSIONS else None
    common = _noise(rng, "ar1", rng.uniform(0.02, 0.05)) if scenario in COMMON else None
    for s in range(N_SLICES):
        base, amp, tau = 2.5 + 0.3 * s + rng.uniform(-0.1, 0.1), rng.uniform(0.8, 2.0), rng.uniform(4, 15)
        drift, scale = rng.uniform(0.0005, 0.004), rng.uniform(0.01, 0.05)
        t = e.copy()
        if scenario == "warmup":
            t = np.maximum(0, e - 20)  # a plateau while the LR warms up
        y = base + amp * np.exp(-t / tau) - drift * t
        if scenario in ("cooldown", "mixed"):
            y -= 0.3 * np.clip((e - (N_EVALS - 25)) / 12, 0, 1) * rng.uniform(0.7, 1.3)  # all drop fast
        if scenario in REGRESSIONS and s == bad:
            # the regressing slice stops improving at the onset (its curve is held there) and rises
            k = np.maximum(0, e - ONSET + 1)
            y = np.where(k > 0, y[ONSET - 1], y) + {"ramp": 0.02 * k, "ramp_ar1": 0.02 * k, "ramp_ar1_common": 0.02 * k,
                                                    "slow": 0.01 * k, "step": 0.2 * (k > 0)}[scenario]
        if common is not None:
            y = y + common * rng.uniform(0.7, 1.3) + _noise(rng, "gauss", scale)
        elif scenario == "mixed":
            y = y + _noise(rng, ["t3", "ar1", "gauss"][s % 3], scale)
        else:
            y = y + _noise(rng, noise_kind, scale)
        if scenario in ("outliers", "mixed"):
            hit = rng.random(N_EVALS) < 0.03
            y += hit * rng.uniform(0.3, 1.0, N_EVALS)
        out[:, s] = y
    return out, bad


HEALTHY = ("gauss", "t3", "ar1", "outliers", "warmup", "cooldown", "mixed", "ar1_common")
REGRESSIONS = ("ramp", "ramp_ar1", "slow", "step", "ramp_ar1_common")
COMMON = ("ar1_common", "ramp_ar1_common")  # one drift shared by every slice


def pages(evals: np.ndarray, field: str = "val_slice_loss") -> list[tuple[int, str]]:
    """(eval index, detail) of every slice_regression finding over one run."""
    eng = RuleEngine(default_rules())
    ev = eng._evals["slice_regression"]
    found = []
    for i, row in enumerate(evals):
        step = (i + 1) * EVAL_EVERY
        rec = StepRecord.model_construct(run="r", step=step, loss=3.0, loss_max_rank=3.0, grad_norm=1.0, lr=1e-3,
                                         tokens=step, batch_fingerprint="f", time=float(step), timeline=0,
                                         sample_ids=[], **{field: {n: float(x) for n, x in zip(NAMES, row)}})
        out: list = []
        ev(rec.__dict__, out)  # evaluators take the record's field dict
        found += [(i, f.detail) for f in out]
    return found


def score(scenario: str, seeds: range) -> dict:
    false_runs, detected, delays = 0, 0, []
    for seed in seeds:
        evals, bad = simulate(scenario, seed)
        found = pages(evals)
        if bad is None:
            false_runs += bool(found)
            continue
        early = [f for f in found if f[0] < ONSET]
        after = [f for f in found if f[0] >= ONSET]
        if early:
            false_runs += 1
        if after and f"slice {NAMES[bad]} " in after[0][1]:
            detected += 1
            delays.append(after[0][0] - ONSET + 1)
        elif after:
            false_runs += 1
    n = len(seeds)
    r = {"scenario": scenario, "runs": n, "false_page_runs": false_runs}
    if scenario in REGRESSIONS:
        r.update(detected=detected, median_delay_evals=float(np.median(delays)) if delays else None,
                 max_delay_evals=int(max(delays)) if delays else None)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=100)
    ap.add_argument("--set", choices=["tuning", "heldout", "both"], default="both")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    sets = {"tuning": range(a.seeds), "heldout": range(10_000, 10_000 + a.seeds)}
    names = [a.set] if a.set != "both" else ["tuning", "heldout"]
    rows = []
    for which in names:
        for sc in a.only or (HEALTHY + REGRESSIONS):
            rows.append({"set": which, **score(sc, sets[which])})
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print("| set | scenario | false-page runs | detected | median / max delay (evals) |")
    print("|---|---|---|---|---|")
    for r in rows:
        det = f"{r['detected']}/{r['runs']}" if "detected" in r else "-"
        dl = f"{r['median_delay_evals']} / {r['max_delay_evals']}" if r.get("median_delay_evals") is not None else "-"
        print(f"| {r['set']} | {r['scenario']} | {r['false_page_runs']}/{r['runs']} | {det} | {dl} |")


if __name__ == "__main__":
    main()
