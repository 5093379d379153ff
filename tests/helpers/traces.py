"""Synthetic loss traces shaped like real pretraining curves, for the detectors and the backtest."""

from __future__ import annotations

import math

import numpy as np


def pretraining(n: int, seed: int, sigma: float = 0.1) -> list[float]:
    """A healthy run as the modded-nanogpt curves look: a fast descent from ~11 nats, Student-t noise
    (white: their step-to-step autocorrelation is ~0), recovered spikes, and an lr cooldown over the
    last third that makes the loss fall faster."""
    rng = np.random.default_rng(seed)
    t = np.arange(1, n + 1, dtype=float)
    x = 3.2 + 7.7 * (1 + t / 8) ** -0.6
    c0 = 2 * n // 3
    x[c0:] -= 0.15 * ((t[c0:] - c0) / (n - c0)) ** 1.5
    x += rng.standard_t(6, n) * sigma / math.sqrt(6 / 4)
    for s in rng.integers(150, n - 10, 20):  # spikes of 1-5 steps that recover
        x[s:s + int(rng.integers(1, 6))] += rng.uniform(0.3, 2.5)
    return [float(v) for v in x]


def climb(xs: list[float], onset: int, amp: float, length: float) -> list[float]:
    return [x + (amp * min(i - onset + 1, length) / length if i >= onset else 0.0) for i, x in enumerate(xs)]


def early_steps(seed: int, n: int = 400, sigma: float = 0.1) -> list[float]:
    """The first ``n`` steps of a ``pretraining`` run (its recovered spikes as sparse as in 3000 steps)."""
    return pretraining(3000, seed, sigma)[:n]
