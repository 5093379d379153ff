"""Slow damage as a ramp: the loss climbing against the level before it (``ClimbTrend``)."""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import Any

from sentinel.detectors.packed import pack, unpack
from sentinel.detectors.robust import MAD_TO_SIGMA, largest_between, median_of

_STALE = object()  # ClimbTrend._spread: to be recomputed from the blocks


class ClimbTrend:
    """A slow climb: the last ``window`` losses rise, as a ramp, above the level just before them.

    ``LevelShift`` waits until a median has risen past a bar, which for a climb of 0.3 nats over
    200 steps takes 100+ steps. This test asks the sharper question "did a ramp start ``window``
    steps ago?" with the matched filter for a ramp: the sum of ``k * r_k`` over k = 1..window, where
    ``r_k`` is the k-th loss of the window minus the *baseline* (the mean of the ``baseline`` losses
    before the window, each clipped to +-3 sigma of their median), clipped to +-3 sigma itself (a
    recovered spike adds at most a few bounded terms). sigma is the caller's robust per-step noise
    (from first differences). The sum is divided by its standard deviation under "no climb", which
    counts the baseline's own error too (``sigma * sqrt(sum k^2 + (sum k)^2 / baseline)``), so on
    white noise ``z`` is about standard normal, and a ramp of slope s nats/step gives
    ``z ~ s * sum(k^2) / that``: for window 48 and baseline 100, ``z ~ s * 167 / sigma``.

    The baseline is flat: a healthy loss falls, so its residuals against a flat level are negative
    (no alarm in the fast early descent or the lr cooldown). Extrapolating a fitted straight descent
    fires on the curvature of every early run (measured: z 9-15 at steps 150-300). With ``credit``
    (the rules' default 0.5), part of the descent is given back after all, from a power law that
    follows the deceleration and only where it fits (``_descent``).

    The bar is the run's own: z is divided by ``phi`` (``_phi``: how much more the run's block
    medians wander than white noise would; 1 on every public curve measured), so a run whose loss
    wanders slowly raises it. Two more guards keep a recovered spike cluster from reading as a
    ramp: losses the spike test flagged are held at the previous loss (``update``), and the medians
    of both late quarters of the window must rise too. And z must be 1.5x the largest z the run
    itself showed 200-1000 steps before (``_beyond_past``): slow wiggles that took the test near
    its bar before are the run's own, not a climb.

    What it can reach (measured, docs/benchmarks.md): with sigma ~0.1 nat and the bar at 5.5, only
    steep climbs (about 0.004 nats per step and more) are caught within 50 steps, and not all of
    them (2 of 5 drills on the real and validation curves; 10 of 71 at 0.002-0.004). A 0.3-nat climb
    over 200 steps (0.0015/step) reaches z ~1.3 by then (the healthy descent subtracted), inside
    the healthy range. The rules run a second instance over 144 + 144 losses for those
    (``climb_long_*``: z ~ s * 802 / sigma at 144 steps), which catches them ~130-160 steps in
    and rolls back to before their start; ``LevelShift`` catches the rest later.

    ``onset()`` is a window before the window's first step: the ramp the filter matched starts at
    the window's first step when the climb is caught at once, but a slow climb caught later began
    earlier (its baseline already rose); a rollback a little early costs steps, one late keeps the
    damage.
    Cost: O(1) per step (running sums); the exact clipped pass over ``window + baseline`` values and
    a sort of the baseline run only when the unclipped z is within ``GATE`` of the bar, and the
    calibration only for the verdicts that its least value does not decide.
    """

    __slots__ = (
        "_b",
        "_blk",
        "_blocks",
        "_dirty",
        "_f",
        "_hist",
        "_klead",
        "_ksum",
        "_ksum2",
        "_kw",
        "_last_noise",
        "_lead",
        "_lead_q",
        "_maxlen",
        "_norm2",
        "_phi_noise",
        "_phi_spread",
        "_phi_val",
        "_rn",
        "_ru",
        "_ruu",
        "_rux",
        "_rx",
        "_rxx",
        "_s0",
        "_s1",
        "_since_sync",
        "_spread",
        "_start",
        "_zden",
        "_zpast",
        "baseline",
        "credit",
        "fit",
        "n",
        "rise",
        "sigmas",
        "stride",
        "warmup",
        "window",
        "z",
    )

    GATE = 3.0  # the exact (clipped) z is computed only when the unclipped one is within this of the bar
    RESYNC = 4096  # running sums recomputed from scratch this often (float drift)
    BLOCKS = 40  # block means (of ``window`` losses each) kept to calibrate ``phi``: ~2000 steps
    MIN_BLOCKS = 10  # fewer than this: ``phi`` is PHI_UNCALIBRATED
    PHI_UNCALIBRATED = 1.5  # the run's slow noise is not known yet: assume some
    PHI_MAX = 4.0
    CONFIRM = 1.5  # each late quarter's median must stand this many of its sigmas above the baseline's
    MEDIAN_EFFICIENCY = 1.2533  # sd of a median of n normal values / sd of their mean (sqrt(pi / 2))
    PAST_STEPS, PAST_GAP = 1000, 200  # a verdict's z against the largest of the run's own z from PAST_STEPS to PAST_GAP before
    PAST_FACTOR = 1.5  # ... must be this many times that (see ``_beyond_past``)
    DESCENT_POWER = 0.5  # the healthy descent the credit follows: a + b * step^-0.5 (``_descent``; written as 1/sqrt)
    CREDIT_MAX_VAR = 0.25  # the fit's own error may add at most this share to z's variance; more: no credit
    FIT_MAX_RMS = 1.5  # ... and the curve must fit its span within this many per-step sigmas (rms); more: no credit

    def __init__(self, window: int = 48, baseline: int = 100, sigmas: float = 5.5, warmup: int = 150, stride: int = 4,
                 credit: float = 0.0, fit: int = 400):
        if window < 4 or baseline < 4:
            raise ValueError("window and baseline must be at least 4")
        self.window, self.baseline, self.sigmas, self.warmup, self.stride = window, baseline, sigmas, warmup, max(1, stride)
        self.credit = credit if credit > 0 else 0.0
        self.fit = max(fit, baseline)  # the descent is fitted over this many losses before the window
        # steps from the baseline's centre to each loss of the window: the credited descent's lead
        self._lead = [(baseline + 1) / 2.0 + k - 1.0 for k in range(1, window + 1)]
        self._klead = sum((k + 1) * lead for k, lead in enumerate(self._lead))
        q = window // 4
        first_q = (baseline + 1) / 2.0 + (window - 2 * q) + (q - 1) / 2.0  # the lead of the first late quarter's centre
        self._lead_q = (first_q, first_q + q)
        self._kw = [float(k) for k in range(1, window + 1)]
        self._norm2 = sum(k * k for k in self._kw)
        self._ksum2 = sum(self._kw) ** 2 / baseline  # the baseline mean's error enters every term
        self._zden = math.sqrt(self._norm2 + self._ksum2)  # z's sd under "no climb", in units of sigma
        self._ksum = 0.5 * window * (window + 1)
        self._maxlen = window + baseline
        self.reset()

    def update(self, step: int, x: float, noise: float, spike: bool = False) -> bool:
        """Admit a finite loss; ``noise`` is the current robust per-step sigma. True = climbing.

        ``spike``: the spike test flagged this loss. It is held at the previous loss instead: a
        spike is its own episode, and a cluster of them at the window's end (k-weighted) would
        otherwise read as a ramp. A climb's losses are not spikes: each is within a few sigma of
        the one before."""
        return self.feed([step], [x], (0,) if spike else (), noise)

    def feed(self, steps: list[int], xs: list[float], spikes, noise: float) -> bool:
        """``update`` on each loss of ``xs`` (at ``steps``) in turn; the verdict is the last one's.
        ``spikes``: the indices in ``xs`` that the spike test flagged, ascending.

        The caller batches the losses between verdicts (``LossEval`` feeds every ``stride`` steps):
        a verdict falls due only at a multiple of ``stride`` admitted losses, so only the last loss
        of a batch may be one, and the verdicts of the others would be False anyway.

        Per loss O(1): running sums of the window (plain and k-weighted) and of the baseline give
        the unclipped z; clipping only matters with outliers, so the exact clipped z (a pass over
        ``window + baseline`` values) is computed only when the unclipped one is near the bar.
        The sums are carried in locals through the batch (the same operations in the same order as
        one loss at a time: the same floats)."""
        f = self._f
        if spikes:  # held at the loss before (itself held if it was a spike too)
            xs = list(xs)
            for i in spikes:
                if i:
                    xs[i] = xs[i - 1]
                elif f:
                    xs[0] = f[-1][1]
        maxlen, b, w = self._maxlen, self.baseline, self.window
        credit = self.credit
        h = self._hist
        hmax = h.maxlen
        blk = self._blk
        dirty = self._dirty
        s0, s1, sb = self._s0, self._s1, self._b
        rn, ru, ruu, rx, rux, rxx = self._rn, self._ru, self._ruu, self._rx, self._rux, self._rxx
        synced = 0
        sqrt = math.sqrt
        for step, x in zip(steps, xs):
            if len(f) == maxlen:
                mid_step, x_mid = f[b]  # the window's oldest moves to the baseline
                blk.append(x_mid)  # ... and, once it has left the window, calibrates phi (see _close_block)
                if len(blk) >= w:
                    self._close_block(mid_step)
                    blk = self._blk
                old = f[0]
                gone = None
                if credit:  # the baseline's oldest moves to the fit's older part; its oldest leaves the fit
                    gone = old if not hmax else h[0] if len(h) == hmax else None
                    h.append(old)
                if not dirty:
                    s1 += w * x - s0
                    s0 = s0 + (x - x_mid)
                    sb += x_mid - old[1]  # the baseline's oldest leaves
                    if credit:  # the fit span's sums, updated in place (``_fit_sums`` recomputes them)
                        u = 1.0 / sqrt(mid_step if mid_step > 1 else 1)
                        ux = u * x_mid
                        if gone is None:
                            rn += 1.0
                            ru += u
                            ruu += u * u
                            rx += x_mid
                            rux += ux
                            rxx += x_mid * x_mid
                        else:
                            gs, gx = gone
                            g = 1.0 / sqrt(gs if gs > 1 else 1)
                            ru += u - g
                            ruu += u * u - g * g
                            rx += x_mid - gx
                            rux += ux - g * gx
                            rxx += x_mid * x_mid - gx * gx
                    synced += 1
            else:
                dirty = True
            f.append((step, x))
        self.n += len(xs)
        if not dirty:
            self._s0, self._s1, self._b = s0, s1, sb
            self._rn, self._ru, self._ruu, self._rx, self._rux, self._rxx = rn, ru, ruu, rx, rux, rxx
            self._since_sync += synced
        self._dirty = dirty
        if len(f) < maxlen:
            return False
        return self._verdict(steps[-1], noise)

    def _verdict(self, step: int, noise: float) -> bool:
        """The verdict after the loss at ``step`` (the window is full). True = climbing."""
        f = self._f
        n = self.n
        if n % self.stride or n < self.warmup or not noise > 0:
            return False
        if self._dirty or self._since_sync >= self.RESYNC:
            self._sync()
        self._last_noise = noise
        ramp = self._s1 - self._b / self.baseline * self._ksum  # the unclipped filter: z x its scale
        zden = self._zden
        d = 0.0  # the credited descent, nats per step (``_descent``)
        if self.credit:
            d, extra = self._descent(step, noise)
            if d:
                ramp += d * self._klead
                zden = math.sqrt(zden * zden + extra)
        gate = self.sigmas - self.GATE
        if self._below_gate_whatever_phi(ramp, noise, gate, zden):
            self.z = self.rise = 0.0  # far below the bar: not worth the exact pass
            return False
        spread = self._spread_now()
        if noise != self._phi_noise or spread is not self._phi_spread:  # both change rarely
            self._phi_noise, self._phi_spread = noise, spread
            self._phi_val = self._phi(noise)
        scale = self._phi_val * noise * zden
        if ramp / scale <= gate:
            self.z = self.rise = 0.0
            return False
        vals = [v for _, v in f]
        b = self.baseline
        pre = vals[:b]
        m = median_of(pre)
        c = 3.0 * noise
        base = sum(m - c if v < m - c else m + c if v > m + c else v for v in pre) / b
        acc = 0.0
        if d:
            for k, lead, v in zip(self._kw, self._lead, vals[b:]):
                r = v - base + d * lead
                acc += k * (-c if r < -c else c if r > c else r)
        else:
            for k, v in zip(self._kw, vals[b:]):
                r = v - base
                acc += k * (-c if r < -c else c if r > c else r)
        self.z = acc / scale
        self.rise = acc / self._norm2 * self.window  # the fitted ramp's rise over the window, in nats
        self._start = f[b][0]
        self._zpast.append((step, self.z))
        if self.z <= self.sigmas:
            return False
        # The k-weighting favours the newest losses, so a cluster of spikes at the window's end (two
        # 5-step spikes back to back, +3 sigma each after clipping, at k ~ 40) can pass the bar
        # alone. A climb also lifts the *medians* of both quarters of the window's second half
        # above the baseline's median; a recovered spike cluster lifts one at most.
        q = self.window // 4
        bar = self.CONFIRM * self.MEDIAN_EFFICIENCY * noise * math.sqrt(1.0 / q + 1.0 / b)
        w0 = b + self.window - 2 * q
        q1, q2 = (d * lead for lead in self._lead_q)  # the credited descent at each quarter's centre
        return (median_of(vals[w0:w0 + q]) - m + q1 > bar and median_of(vals[w0 + q:]) - m + q2 > bar
                and self._beyond_past(step))

    def _beyond_past(self, step: int) -> bool:
        """Is this verdict's z ``PAST_FACTOR`` times the largest z the run showed from
        ``PAST_STEPS`` to ``PAST_GAP`` steps before (the z of the exact pass, computed only near the
        bar; none computed: nothing to compare with)? A run whose slow wiggles already took the
        test to z ~4 is not climbing at z 5.5: on 400 fresh synthetic healthy runs the 5 false
        climb verdicts stood 1.10-1.64x above their run's past; every first climb verdict on 200
        climbs injected into the real curves stood >= 2.0x (their past z <= 2.7). The slow climb
        the long test catches ~150 steps in has not yet risen over its past (``PAST_GAP``)."""
        top, _ = largest_between(self._zpast, step - self.PAST_STEPS, step - self.PAST_GAP, 1)
        return self.z > self.PAST_FACTOR * (top if top is not None and top > 0.0 else 0.0)

    def _below_gate_whatever_phi(self, ramp: float, noise: float, gate: float, zden: float) -> bool:
        """Is the unclipped z (``ramp / (phi * noise * zden)``) at most ``gate`` for any ``phi`` the
        calibration can give? phi is at least ``min(1, PHI_UNCALIBRATED)``: a larger phi only
        shrinks a positive z (rounding is monotone), and a z <= 0 is under any gate >= 0. On a
        healthy run this decides nearly every verdict, so the calibration (a sort of the block
        medians' differences, ~10 us) is computed only for the few that it does not."""
        if ramp <= 0.0:
            return gate >= 0.0
        least = self.PHI_UNCALIBRATED if self.PHI_UNCALIBRATED < 1.0 else 1.0
        return ramp / (least * noise * zden) <= gate

    def _descent(self, step: int, noise: float) -> tuple[float, float]:
        """(d, extra): the descent rate to credit, nats per step, and what its error adds to z's
        variance (in units of sigma^2); (0, 0): no credit.

        The flat baseline subtracts a healthy descent from every climb: in the early descent
        (steps 200-700) that alone kept most 0.005-nat/step climbs under the bar 48 steps in. So
        the losses of the fit span (the ``fit`` losses before the window) are fitted, least squares
        on running sums, to a + b * step^-``DESCENT_POWER``, and ``credit`` of that curve's slope,
        read between the baseline's centre and the window's, lowers the expected level of each loss
        of the window by slope x its lead. The power law follows the deceleration that made a
        straight line over a long span over-predict the descent (healthy z up to 15 on the real
        curves, bench/probes/climb_baseline_probe.py); half of its slope keeps the healthy runs where the
        flat baseline had them. Only a descent is credited (b > 0), and only when the fit is firm:
        its error may add at most ``CREDIT_MAX_VAR`` of z's variance (a run whose steps start far
        from 0, where step^-0.5 hardly varies, gets none), and only when the curve fits its span to
        ``FIT_MAX_RMS`` per-step sigmas: the first steps of a run are no power law, and a log
        smoothed before it was written (an EMA) has a per-step sigma far below any misfit."""
        n = self._rn
        den = n * self._ruu - self._ru * self._ru
        if n < self.baseline or den <= 0.0:
            return 0.0, 0.0
        b = (n * self._rux - self._ru * self._rx) / den
        if b <= 0.0:
            return 0.0, 0.0
        # the curve must describe the span: a misfit (the first steps' shape, a schedule change, a
        # smoothed log whose per-step sigma is far below its wander) would be credited as descent
        a = (self._rx - b * self._ru) / n
        rss = self._rxx - a * self._rx - b * self._rux
        if rss > (n - 2.0) * (self.FIT_MAX_RMS * noise) ** 2:
            return 0.0, 0.0
        t_mid = step - 0.5 * (1.5 * self.window + 0.5 * self.baseline - 1.0)
        if t_mid < 1.0:
            return 0.0, 0.0
        g = self.credit * self.DESCENT_POWER * t_mid ** -(self.DESCENT_POWER + 1.0)
        extra = (self._klead * g) ** 2 * n / den
        if extra > self.CREDIT_MAX_VAR * self._zden * self._zden:
            return 0.0, 0.0
        return g * b, extra

    def _fit_sums(self) -> None:
        """The fit span's running sums from scratch: its older part and the baseline."""
        n = su = suu = sx = sux = sxx = 0.0
        for st, x in itertools.chain(self._hist, itertools.islice(self._f, self.baseline)):
            u = 1.0 / math.sqrt(st if st > 1 else 1)  # step^-DESCENT_POWER
            n, su, suu, sx, sux, sxx = n + 1.0, su + u, suu + u * u, sx + x, sux + u * x, sxx + x * x
        self._rn, self._ru, self._ruu, self._rx, self._rux, self._rxx = n, su, suu, sx, sux, sxx

    @property
    def phi(self) -> float:
        """The run's slow-noise factor for the noise of the last verdict and the current calibration."""
        return self._phi(self._last_noise)

    def _close_block(self, step: int) -> None:
        """Close the current block of losses that have left the window (so a climb in progress
        cannot raise the calibration that judges it). A block is summarised by its median: a
        recovered spike of a few steps does not move it (a clipped mean still moved 3x its noise)."""
        self._blocks.append((step, median_of(self._blk)))
        self._blk = []
        self._spread = _STALE  # recomputed when a verdict needs it (_spread_now)

    def _spread_now(self) -> float | None:
        """``_block_spread`` of the current blocks, computed once after they change."""
        if self._spread is _STALE:
            self._spread = self._block_spread()
        return self._spread

    def _phi(self, noise: float) -> float:
        """How much more the run's block means wander than white noise of ``noise`` would make them.

        The spread (MAD) of second differences of consecutive block means, against the white-noise
        value ``noise * sqrt(6 / window)``: a steady descent (even a curving one) cancels in a second
        difference, slow healthy wiggles do not. The ramp z is divided by it (at least 1), so a run
        whose loss wanders slowly raises its own bar, and a run with white noise (every public curve
        measured: 0.6-1.0) keeps the plain one."""
        spread = self._spread_now()
        if spread is None or not noise > 0:
            return self.PHI_UNCALIBRATED
        phi = spread / (noise * self.MEDIAN_EFFICIENCY * math.sqrt(6.0 / self.window))
        return 1.0 if phi < 1.0 else self.PHI_MAX if phi > self.PHI_MAX else phi

    def _block_spread(self) -> float | None:
        """Robust spread (MAD) of the second differences of the kept block means; None: too few."""
        bl = self._blocks
        if len(bl) < self.MIN_BLOCKS:
            return None
        m = [v for _, v in bl]
        d2 = [m[i] - 2.0 * m[i - 1] + m[i - 2] for i in range(2, len(m))]
        md = median_of(d2)
        return MAD_TO_SIGMA * median_of([abs(v - md) for v in d2])

    def _sync(self) -> None:
        vals = [v for _, v in self._f]
        b = self.baseline
        self._b = sum(vals[:b])
        self._s0 = sum(vals[b:])
        self._s1 = sum(k * v for k, v in zip(self._kw, vals[b:]))
        if self.credit:
            self._fit_sums()
        self._dirty, self._since_sync = False, 0

    def onset(self) -> int:
        return max(0, self._start - self.window)

    def rewind(self, keep_through_step: int) -> None:
        f = self._f
        while f and f[-1][0] > keep_through_step:
            f.pop()
        h = self._hist
        while h and h[-1][0] > keep_through_step:
            h.pop()
        bl = self._blocks
        while bl and bl[-1][0] > keep_through_step:
            bl.pop()
        zp = self._zpast
        while zp and zp[-1][0] > keep_through_step:
            zp.pop()
        self._blk = []
        self._spread = _STALE
        self._dirty = True

    def restart(self) -> None:
        """Start the window and baseline again (the loss level changed by plan); keep the
        calibration, which measures the run's noise, not its level."""
        blocks, spread, zpast = self._blocks, self._spread, self._zpast
        self.reset()
        self._blocks, self._spread, self._zpast = blocks, spread, zpast

    def reset(self) -> None:
        self._f: deque[tuple[int, float]] = deque(maxlen=self.window + self.baseline)
        self._hist: deque[tuple[int, float]] = deque(maxlen=self.fit - self.baseline)  # the fit span's older part
        self._s0 = self._s1 = self._b = 0.0
        self._rn = self._ru = self._ruu = self._rx = self._rux = self._rxx = 0.0  # the fit span's running sums (``_descent``)
        self._dirty, self._since_sync = True, 0
        self.n = 0
        self.z = self.rise = 0.0
        self._phi_val = self.PHI_UNCALIBRATED
        self._phi_noise, self._phi_spread = -1.0, None  # what ``_phi_val`` was last computed from
        self._last_noise = 0.0
        self._start = 0
        self._blocks: deque[tuple[int, float]] = deque(maxlen=self.BLOCKS)  # (last step, median)
        self._blk: list[float] = []  # the block being filled
        self._spread: float | object | None = None  # _STALE: the blocks changed since it was computed
        self._zpast: deque[tuple[int, float]] = deque(maxlen=256)  # (step, z) of the exact passes (near the bar: rare)

    def state_dict(self) -> dict[str, Any]:
        return {"window": pack(self._f, "if"), "n": self.n, "blocks": pack(self._blocks, "if"),
                "block": pack(self._blk, "f"), "zpast": pack(self._zpast, "if"), "fit": pack(self._hist, "if")}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.reset()
        self._f.extend(unpack(d["window"], "if"))
        self.n = int(d["n"])
        self._blocks.extend(unpack(d.get("blocks", []), "if"))  # older state: uncalibrated
        self._blk = unpack(d.get("block", []), "f")[: self.window - 1]
        self._spread = _STALE
        self._zpast.extend(unpack(d.get("zpast", []), "if"))  # older state: none
        self._hist.extend(unpack(d.get("fit", []), "if"))  # older state: none (credit from a short fit)
