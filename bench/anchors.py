"""The anchors: other projects' loss-spike detectors, re-implemented in our words for comparison.

Each is a causal detector over a loss sequence: ``detect(losses) -> list[bool]`` (flag per step),
written from the published description of the rule, not from the projects' code. All get the same
warmup (no verdict before ``MIN_HISTORY`` steps) so none is penalised for the first noisy steps.

- OLMo-core skip-step: loss > mean + 6 sigma of the last 128 losses. Every loss, spikes included,
  enters the window (that is how it behaves, and why a second spike hides behind the first).
- LLM Foundry KillLossSpike: loss > 2 x the mean of the last 100 losses.
- ZClip: z-score of the loss against an EMA mean and EMA variance (alpha 0.97) > 2.5; on a spike
  the EMAs are fed the clipped value (mean + 2.5 sigma), as ZClip does with gradient norms.
- Megatron spiky loss: loss > 10 x the largest loss seen in the early steps (the first 100).
"""

from __future__ import annotations

import math
from collections import deque

MIN_HISTORY = 50


def olmo_skip_step(losses: list[float], window: int = 128, sigma: float = 6.0) -> list[bool]:
    out, win = [], deque(maxlen=window)
    s = s2 = 0.0
    for x in losses:
        flag = False
        if len(win) >= MIN_HISTORY:
            n = len(win)
            mean = s / n
            var = max(0.0, s2 / n - mean * mean)
            flag = x > mean + sigma * math.sqrt(var)
        if len(win) == window:
            old = win[0]
            s -= old
            s2 -= old * old
        win.append(x)
        s += x
        s2 += x * x
        out.append(flag)
    return out


def foundry_kill_loss_spike(losses: list[float], window: int = 100, factor: float = 2.0) -> list[bool]:
    out, win = [], deque(maxlen=window)
    for x in losses:
        out.append(len(win) >= MIN_HISTORY and x > factor * (sum(win) / len(win)))
        win.append(x)
    return out


def zclip(losses: list[float], alpha: float = 0.97, z_thresh: float = 2.5, warmup: int = MIN_HISTORY) -> list[bool]:
    out = []
    mean = var = None
    seen: list[float] = []
    for x in losses:
        if mean is None:
            seen.append(x)
            out.append(False)
            if len(seen) >= warmup:
                mean = sum(seen) / len(seen)
                var = sum((v - mean) ** 2 for v in seen) / len(seen)
            continue
        std = math.sqrt(var)
        z = (x - mean) / std if std > 0 else 0.0
        flag = z > z_thresh
        out.append(flag)
        v = mean + z_thresh * std if flag else x  # the clipped value feeds the statistics
        mean = alpha * mean + (1 - alpha) * v
        var = alpha * var + (1 - alpha) * (v - mean) ** 2
    return out


def megatron_spiky_loss(losses: list[float], early: int = 100, factor: float = 10.0) -> list[bool]:
    out, peak = [], -math.inf
    for i, x in enumerate(losses):
        if i < early:
            peak = max(peak, x)
            out.append(False)
        else:
            out.append(x > factor * peak)
    return out


ANCHORS = {
    "OLMo-core skip-step (mean+6σ, 128)": olmo_skip_step,
    "LLM Foundry KillLossSpike (2× mean, 100)": foundry_kill_loss_spike,
    "ZClip (EMA z > 2.5)": zclip,
    "Megatron spiky loss (10× early max)": megatron_spiky_loss,
}
