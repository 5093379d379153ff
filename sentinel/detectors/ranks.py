"""Comparisons across the ranks of one step: the straggler, the rank whose loss stands apart."""

from __future__ import annotations

import math


def straggler(rank_seconds: list[float]) -> tuple[int, float] | None:
    """(slowest rank, its time / median rank time), or None with fewer than two ranks.

    The median, not the mean, is the reference so that one very slow rank cannot raise its own bar.
    """
    n = len(rank_seconds)
    if n < 2:
        return None
    s = sorted(rank_seconds)
    h = n >> 1
    med = s[h] if n & 1 else 0.5 * (s[h - 1] + s[h])
    if not (med > 0) or not math.isfinite(med):
        return None
    worst = s[-1]
    return rank_seconds.index(worst), worst / med


def rank_outlier(rank_losses: list[float]) -> tuple[int, float] | None:
    """(rank farthest from the others, its relative deviation), or None with fewer than two ranks.

    Each rank is compared with the median of the *other* ranks, so with two ranks the higher one is
    the suspect (a rank with a corrupted shard or a bad GPU usually shows a *higher* loss). The
    farthest rank is always the lowest or the highest, so only those two are scored: one sort.
    A non-finite rank loss is an infinite deviation.
    """
    n = len(rank_losses)
    if n < 2:
        return None
    if not math.isfinite(sum(rank_losses)):
        return next(r for r, x in enumerate(rank_losses) if not math.isfinite(x)), math.inf
    s = sorted(rank_losses)
    lo, hi = s[0], s[-1]
    # median of the others when the highest (resp. lowest) is left out: s[:-1] (resp. s[1:])
    m = n - 1
    h = m >> 1
    med_wo_hi = s[h] if m & 1 else 0.5 * (s[h - 1] + s[h])
    med_wo_lo = s[h + 1] if m & 1 else 0.5 * (s[h] + s[h + 1])
    dev_hi = abs(hi - med_wo_hi) / abs(med_wo_hi) if med_wo_hi else math.inf
    dev_lo = abs(lo - med_wo_lo) / abs(med_wo_lo) if med_wo_lo else math.inf
    if dev_hi >= dev_lo:
        return rank_losses.index(hi), dev_hi
    return rank_losses.index(lo), dev_lo
