"""Healthy real curves as other trainers would have logged them: does the sentinel still keep quiet?

    python bench/probes/logging_variants.py [--variants ema0.3,ema0.1,mean10,every10,restart500] [--json out.json]

The public curves (``../shared/curves`` and ``bench/curves-validation``) log rank 0's raw loss at
every step. Other logs do not: some print an EMA of the loss (a "smoothed loss"), some the mean over
a logging interval, some only every k-th step. Each variant is applied to every healthy real curve
and replayed through the CLI's own backtest path (``parse_trace_line`` + ``sentinel.backtest`` with
the default rules, a checkpoint every 100 steps and one of step 0), and the pauses and rollbacks
are counted: every curve finished healthy, so each one is a false alarm. Variants:

- ``emaA``: an exponential moving average with weight A on the newest loss, logged every step
  (A = 0.1 is TensorBoard's smoothing 0.9);
- ``meanK``: the mean of each K steps, logged at the K-th (a logging interval, as in Megatron or
  the Hugging Face Trainer);
- ``everyK``: the raw loss of every K-th step only;
- ``rollK``: the mean of the last K steps, logged every step (a running mean, as Lightning's
  progress bar shows the loss);
- ``quietF``: a quieter run (a bigger batch): the per-step noise scaled by F around the centred
  25-step running mean, which keeps the data-order wiggles slower than that at their full size
  (the hard case: the noise the bars are set in shrinks, the wander does not);
- ``roundD``: the raw loss printed with D decimals (``loss:3.28``);
- ``noisyF``: a noisier run (a smaller batch): the same as ``quietF`` with F > 1;
- ``shiftD``: the loss D nats lower, noise unchanged (a stronger model or another tokenizer: the
  bars that are a share of the level get smaller in nats);
- ``scaleF``: the loss and its noise times F (``scale1.4427``: logged in bits; ``scale0.5``: a
  level half as high with half the noise);
- ``restartK``: a requeued job appending to the same log. The run reached a step drawn at random
  (200 to n - 100, seeded by the curve's length), was restarted from its last checkpoint at least K
  steps before (a multiple of 100) and ran on to the end with the same data order: the log's steps
  go back once, with no marker, and repeat.
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

from decision_quality import Run, load_curves

from sentinel.backtest import backtest, parse_trace_line
from sentinel.rules import default_rules

DEFAULT = "ema0.5,ema0.3,ema0.2,ema0.1,mean10,every10,restart100,restart500"


def logged(run: Run, variant: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, losses, wall_ms) of ``run`` as ``variant`` would have logged it."""
    x = np.asarray(run.losses, dtype=float)
    w = np.asarray(run.wall_ms, dtype=np.int64)
    s = np.arange(1, len(x) + 1)
    if variant.startswith("ema"):
        a, m, out = float(variant[3:]), x[0], np.empty_like(x)
        for i, v in enumerate(x):
            m = a * v + (1.0 - a) * m
            out[i] = m
        return s, out, w
    if variant.startswith("mean"):
        k = int(variant[4:])
        n = len(x) // k * k
        return s[k - 1:n:k], x[:n].reshape(-1, k).mean(axis=1), w[k - 1:n:k]
    if variant.startswith("quiet"):
        f = float(variant[5:])
        slow = np.convolve(np.pad(x, 12, mode="edge"), np.ones(25) / 25, mode="valid")
        return s, slow + f * (x - slow), w
    if variant.startswith("round"):
        return s, np.round(x, int(variant[5:])), w
    if variant.startswith("shift"):
        return s, x - float(variant[5:]), w
    if variant.startswith("scale"):
        return s, x * float(variant[5:]), w
    if variant.startswith("noisy"):
        f = float(variant[5:])
        slow = np.convolve(np.pad(x, 12, mode="edge"), np.ones(25) / 25, mode="valid")
        return s, slow + f * (x - slow), w
    if variant.startswith("roll"):
        k = int(variant[4:])
        c = np.cumsum(np.r_[0.0, x])
        lo = np.maximum(np.arange(1, len(x) + 1) - k, 0)
        return s, (c[1:] - c[lo]) / (np.arange(1, len(x) + 1) - lo), w
    if variant.startswith("every"):
        k = int(variant[5:])
        return s[k - 1::k], x[k - 1::k], w[k - 1::k]
    if variant.startswith("restart"):
        k = int(variant[7:])
        reached = int(np.random.default_rng(len(x) * 7919 + k).integers(200, max(201, len(x) - 100)))
        back_to = max(0, (reached - k) // 100 * 100)
        keep = np.r_[np.arange(reached), np.arange(back_to, len(x))]
        wall = np.r_[w[:reached], w[reached - 1] + 60_000 + 160 * np.arange(len(x) - back_to)]  # a minute to restart
        return s[keep], x[keep], wall
    raise ValueError(f"unknown variant {variant!r} (emaA, meanK, everyK, rollK, roundD, quietF, noisyF, shiftD, scaleF, restartK)")


def replay(name: str, steps, losses, wall) -> list[dict]:
    lines = (json.dumps({"step": int(s), "loss": round(float(x), 4), "wall_ms": int(t)}) for s, x, t in zip(steps, losses, wall))
    recs = [parse_trace_line(line, default_run=name) for line in lines]
    return backtest(recs, default_rules(), checkpoint_every=100, initial_checkpoint=True).to_json()["actions"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--curves", default="/work/shared/curves")
    ap.add_argument("--validation-curves", default=str(Path(__file__).resolve().parent / "curves-validation"))
    ap.add_argument("--variants", default=DEFAULT)
    ap.add_argument("--json", dest="json_out", default=None)
    a = ap.parse_args()
    runs = [r for f in (a.curves, a.validation_curves) if Path(f).is_dir() for r in load_curves(Path(f))]
    results = []
    for variant in a.variants.split(","):
        bad = []
        for run in runs:
            acts = [x for x in replay(run.name, *logged(run, variant)) if x["kind"] in ("pause", "rollback")]
            if acts:
                bad.append({"run": run.name, "kind": acts[0]["kind"], "step": acts[0]["step"], "reason": acts[0]["reason"]})
                print(f"   {variant} {run.name}: {acts[0]['kind']} at step {acts[0]['step']}: {acts[0]['reason'][:110]}")
        print(f"== {variant}: {len(bad)} of {len(runs)} healthy real runs with a pause or rollback", flush=True)
        results.append({"variant": variant, "runs": len(runs), "runs_with_actions": len(bad), "first_actions": bad})
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
