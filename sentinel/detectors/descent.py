"""Persistent damage in the early descent: the loss jumped against its own falling trend (``DescentJump``)."""

from __future__ import annotations

from collections import deque
from typing import Any

from sentinel.detectors.packed import pack, unpack
from sentinel.detectors.robust import HALF_MAX, MAD_TO_SIGMA, median_of, slope_median


class DescentJump:
    """A jump in the first few hundred steps: the loss stands above the line its descent was on.

    In the early descent the loss falls by 0.005-0.05 nats per step, and the other tests are still
    warming up or judge against levels the descent soon undercuts: on the real curves, jumps and
    slow decays of 0.25-1.0 nats with onsets at steps 30-199 were missed by all of them in 161 of
    672 drills, 14 of those at onsets 48-60 with jumps of 0.47-0.74 nats (docs/benchmarks.md).

    This test asks "did the loss jump at ``t0``, ``post`` steps ago?" directly. It fits a line to
    the ``pre`` losses before ``t0`` and one to the ``post`` losses from it (Theil-Sen: the median
    of the pairwise slopes, and the median of the residuals as the level; a recovered spike moves
    neither), and reads both at ``t0``: a jump is where they part. A convex descent bends each
    line's ends alike and a knee (the descent slowing) keeps them meeting, so neither reads as a
    jump; one slope fitted to both sides did read a knee as one (a synthetic run at z 5.0, step 65).

    The jump is judged in units of the loss's noise at the level of window medians: the larger of
    the per-step noise (robust spread of first differences) and of second differences of losses
    ``LAG`` steps apart, both over the up to ``HISTORY`` losses before ``t0`` (``_noise``), so a log
    whose noise is correlated is judged at its real wander, and a jump cannot raise the noise
    that judges it. The caller's per-step noise is not used: it still holds the first steps'
    plunge (0.15-0.2 nats at step 65 where the loss's own is 0.11).

    It only judges logs whose noise looks raw, the two ways white noise shows: its first
    differences (less their own trend) correlate at -0.5 with their neighbours (``RAW_RHO``), and
    the level noise is no larger than the per-step one (``RAW_RATIO``). A smoothed loss (an EMA, a
    running mean) fails one or both, and its smoothing lag bends a convex descent into what reads
    as a jump. An EMA of weight a correlates at -a / 2, so a lightly smoothed log that passes is
    judged at the noise it had before smoothing (x ``sqrt((2 - a) / a)``): smoothing shrinks white
    noise but not a healthy bump of several steps (one real curve has a +0.25-nat bump of 8 steps
    at step 124; logged as an EMA of 0.5 it read z 5.1 before this, 3.7 after). Measured at steps
    50-250 (``bench/probes/early_jump.py``): 99 % of the raw real curves' verdict points pass; 47 % of an
    EMA of 0.5's, 4 % of 0.3's, none of an EMA of 0.2 or less or of a running mean of 10-20.

    Three more checks: the jump must be ``MIN_RISE`` (4 %) of the level before it (in a quiet run
    5 sigmas are a few tenths of a nat, which the bends of a steep early descent reach: a synthetic
    healthy run had 0.20 nats at step 52, level ~6; the damage judged is 0.25-1.0 nats, and the
    floor at the early levels of 4-7 nats is 0.16-0.28); the lower quartiles of the two sides'
    residuals must differ by ``QUARTILE`` (3/4) of the bar (recovered spikes bunched into the
    ``post`` losses lift its median, not its lower quartile; a jump lifts both); and the newest
    half of the ``post`` losses, on the ``pre`` line, must stand ``HOLD`` (half) of the jump up (a
    bump that has come back down does not).

    It judges only onsets from ``first + pre`` to ``until`` (run steps): before ``first`` the warmup
    knee (the loss falling from ~11 to ~6 in 25 steps, then slowing) reads as a jump; after
    ``until`` the level and jump tests have their own history and judge with more care.

    Losses the spike test flagged are kept as they are (``spike`` is ignored): a jump's first
    losses are flagged as spikes, and holding them at the loss before, as the climb test does,
    hides the jump. ``onset()`` is ``t0``: at the jump, or up to half a ``post`` window before it
    (the line after then still holds a few losses from before). Cost: nothing outside its range
    of steps; inside it an O(1) append per step and, every ``stride`` steps, medians of
    ``C(pre, 2) + C(post, 2)`` slopes (~550; ``slope_median``, in numpy), on ~100 steps of a run. The noise (as
    much again) is measured only where the jump clears ``MIN_RISE``, which a healthy run's rarely does.
    """

    __slots__ = ("_gated", "_memo", "_n", "_points", "_pre_k", "_steps", "_t0", "_wild", "_x", "first", "post", "pre", "rise", "sigmas",
                 "stride", "tally", "until", "z")

    HISTORY = 64  # losses for the level noise and the rawness check
    LAG = 8  # the level noise: spread of second differences of losses this many steps apart
    RAW_RHO = -0.3  # judge only while the lag-1 correlation of first differences is at most this
    RAW_RATIO = 1.5  # ... and the level noise at most this many times the per-step noise
    MIN_RISE = 0.04  # the jump must be at least this fraction of the level before it
    HOLD = 0.5  # the newest half of the ``post`` losses must still stand this fraction of the jump up
    QUARTILE = 0.75  # the lower quartiles must differ by this fraction of the bar (a jump lifts all the losses)

    def __init__(self, pre: int = 24, post: int = 24, sigmas: float = 5.0, first: int = 26, until: int = 250, stride: int = 2):
        if pre < 4 or post < 4:
            raise ValueError("pre and post must be at least 4")
        self.pre, self.post, self.sigmas, self.first, self.until, self.stride = pre, post, sigmas, first, until, max(1, stride)
        # True: the rawness gate is run at every verdict point, so ``_points`` and ``_gated`` count
        # them all (bench/probes/early_jump.py); False (the daemon): only where a jump is big
        # enough to judge. The verdicts are the same either way
        self.tally = False
        self.reset()

    def update(self, step: int, x: float, noise: float, spike: bool = False) -> bool:
        """Admit a finite loss at ``step``. True = jumped. ``noise`` and ``spike`` (the caller's
        per-step sigma and spike verdict) are not used: see the class docstring."""
        if step > self.until + self.post or step < self.first:
            return False
        steps, xs = self._steps, self._x
        steps.append(step)
        xs.append(x)
        if not -HALF_MAX < x < HALF_MAX:
            self._wild = self._n  # slope_median must look for an overflow while this loss is in a window
        self._n += 1
        if self._n % self.stride or len(xs) < self.pre + self.post:
            return False
        t0_index = len(xs) - self.post
        t0 = steps[t0_index]
        if steps[t0_index - self.pre] < self.first or t0 > self.until:
            return False
        vals = list(xs)
        self.z = self.rise = 0.0
        self._points += 1
        gate = self._gate(vals, t0_index) if self.tally else None
        if gate is False:
            return False
        pre, post = vals[t0_index - self.pre:t0_index], vals[t0_index:]
        # each side's own line (Theil-Sen), both read at t0: a jump is where they part
        memo = self._memo
        key = tuple(pre)
        bounded = self._n - self._wild > len(xs)
        s_pre = memo.get(key)
        if s_pre is None:
            s_pre = slope_median(pre, bounded)
        s_post = slope_median(post, bounded)
        # ``post`` / ``stride`` points later, these ``post`` losses are the ``pre`` ones: their line is kept
        memo[tuple(post)] = s_post
        if len(memo) > self.post // self.stride + 2:
            del memo[next(iter(memo))]
        befores = sorted([v - s_pre * k for v, k in zip(pre, self._pre_k)])
        afters = [v - s_post * k for k, v in enumerate(post)]
        h = len(befores) >> 1  # median_of(befores), sorted already
        before = befores[h] if len(befores) & 1 else 0.5 * (befores[h - 1] + befores[h])
        jump = median_of(afters) - before
        # the rise asked of any jump needs no noise: checked first, it spares most points the
        # noise's cost (half of this test's, which was a fifth of the daemon's CPU in a young fleet)
        if not jump > self.MIN_RISE * median_of(pre):
            return False
        if gate is None and (gate := self._gate(vals, t0_index)) is False:
            return False
        step_noise, level_noise, rho = gate
        # judged at the noise the loss had before any light smoothing: an EMA of weight a shrinks
        # white noise by sqrt(a / (2 - a)) but a healthy bump of several steps hardly, and its
        # differences correlate at -a / 2 (a = 1: raw)
        a = -2.0 * rho if rho > -0.5 else 1.0
        scale = (step_noise if step_noise > level_noise else level_noise) * ((2.0 - a) / a) ** 0.5
        self.rise, self.z, self._t0 = jump, jump / scale, t0
        if not self.z > self.sigmas:
            return False
        low = sorted(afters)[len(afters) // 4] - befores[len(befores) // 4]
        held = median_of([v - s_pre * k for k, v in enumerate(post)][len(post) // 2:]) - before
        return low > self.QUARTILE * self.sigmas * scale and held > self.HOLD * jump

    def _gate(self, vals: list[float], t0_index: int) -> tuple[float, float, float] | bool:
        """``_noise`` of the history before ``t0``, or False where the log does not look raw (counted)."""
        step_noise, level_noise, rho = noise = self._noise(vals, t0_index)
        if rho > self.RAW_RHO or not step_noise > 0 or level_noise > self.RAW_RATIO * step_noise:
            self._gated += 1
            return False
        return noise

    def _noise(self, vals: list[float], t0_index: int) -> tuple[float, float, float]:
        """(per-step noise, noise at the level of window medians, lag-1 correlation of first
        differences) over the up to ``HISTORY`` losses before ``t0`` (see the class docstring)."""
        h = vals[max(0, t0_index - self.HISTORY):t0_index]
        lag = self.LAG
        if len(h) < 2 * lag + 8:
            return 0.0, 0.0, -1.0
        d = [b - a for a, b in zip(h, h[1:])]
        md = median_of(d)
        mad = median_of([abs(v - md) for v in d])
        c = 3.0 * MAD_TO_SIGMA * mad or 1e-12
        # the differences less their own trend (a curving descent's slope drifts over the history,
        # which reads as positive correlation), clipped at 3 sigma (a spike's two big differences)
        n = len(d)
        km, dm = 0.5 * (n - 1), sum(d) / n
        tilt = sum((k - km) * (v - dm) for k, v in enumerate(d)) / sum((k - km) ** 2 for k in range(n))
        r = [max(-c, min(c, v - dm - tilt * (k - km))) for k, v in enumerate(d)]
        num = sum(u * w for u, w in zip(r, r[1:]))
        den = sum(u * u for u in r) or 1e-12
        far = [u - 2.0 * w + y for u, w, y in zip(h, h[lag:], h[2 * lag:])]  # a curving descent cancels too
        mf = median_of(far)
        return MAD_TO_SIGMA * mad / 2 ** 0.5, MAD_TO_SIGMA * median_of([abs(v - mf) for v in far]) / 6 ** 0.5, num / den

    def onset(self) -> int:
        return self._t0

    def rewind(self, keep_through_step: int) -> None:
        steps, xs = self._steps, self._x
        while steps and steps[-1] > keep_through_step:
            steps.pop()
            xs.pop()
        self._look_for_wild()

    def reset(self) -> None:
        # the steps and their losses, side by side (the losses are copied to a list at each verdict point)
        n = max(self.pre + self.post, self.HISTORY + self.post)
        self._steps: deque[int] = deque(maxlen=n)
        self._x: deque[float] = deque(maxlen=n)
        self._n = 0
        self._wild = -n - 1  # the last loss admitted (its ``_n``) that could overflow a slope: none
        self._pre_k = list(range(-self.pre, 0))  # the ``pre`` losses' places, counted from t0
        # the Theil-Sen slope of each recent ``post`` window, by its losses (a cache: equal losses,
        # equal slope, whatever was rewound; not saved)
        self._memo: dict[tuple[float, ...], float] = {}
        self.z = self.rise = 0.0
        self._t0 = 0
        self._points = 0  # verdict points in range (for bench/probes/early_jump.py)
        self._gated = 0  # ... of which skipped because the log did not look raw

    def state_dict(self) -> dict[str, Any]:
        return {"window": pack(zip(self._steps, self._x), "if"), "n": self._n}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.reset()
        for step, x in unpack(d["window"], "if"):
            self._steps.append(step)
            self._x.append(x)
        self._n = int(d["n"])
        self._look_for_wild()

    def _look_for_wild(self) -> None:
        """After the window changed other than by ``update``: whether a loss in it could overflow a
        slope (then ``slope_median`` looks until a window's worth of losses came after now)."""
        if any(not -HALF_MAX < x < HALF_MAX for x in self._x):
            self._wild = self._n
