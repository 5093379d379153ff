"""Detector building blocks: small, pure state machines over the numbers in a StepRecord.

Nothing here knows about rules files, runs or Redis. Each class answers one question about one
stream of numbers ("is this value a spike against its own recent history?", "has this value been
below its band for long enough?") and can save and restore its state as plain JSON, so a restarted
daemon picks up with the same baselines it had.

Why a robust, *self-excluding* baseline: OLMo-core's skip-step compares a loss with the mean and
standard deviation of the last 128 losses, and the spike then enters that window, inflating sigma
so that a second spike a few steps later hides behind the first. ``SpikeDetector`` keeps anomalous
values out of its own window, and measures spread with the median absolute deviation, which a few
outliers cannot move.

Cost: ``SortedWindow`` keeps its values sorted with ``bisect`` (an O(log n) search and a memmove of
at most ``size`` floats, which for the window sizes used here is a few hundred nanoseconds). The
median is O(1) and the MAD is O(log n) (a k-th-smallest search over two sorted runs). The MAD is only
computed when a cheap ratio gate says the value might be anomalous. ``SpikeDetector`` goes one step
further: on the common path it only appends to the window's FIFO and leaves the sorted copy stale,
which is rebuilt (one C sort) when a verdict or a reader needs it, a few times per hundred steps.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice
from operator import itemgetter, mul, sub
from typing import Any

# verdict codes returned by SpikeDetector.update (ints, not enums: this is the per-step hot path)
WARMUP = -1  # not enough history for a verdict
NORMAL = 0
ELEVATED = 1  # above the baseline by a modest margin: counts towards sustained divergence
SPIKE = 2  # far above the baseline
NONFINITE = 3  # NaN or inf

MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution is 0.6745 sigma


def is_nonfinite(x: float | None) -> bool:
    """True for NaN/inf; None (input absent) is not a verdict."""
    return x is not None and (x != x or x in (math.inf, -math.inf))


class SortedWindow:
    """The last ``size`` (step, value) pairs, with the values also kept sorted.

    The FIFO remembers steps so that a rollback can drop exactly the values recorded after the
    restored step (``rewind``) instead of throwing the whole baseline away.

    The sorted copy may be *stale* (``append_unsorted``): then it is rebuilt from the FIFO by the
    next reader. A stable sort of the FIFO puts equal values in FIFO order, which is where
    ``insort`` (after its equals) and ``del s[bisect_left(...)]`` (the oldest of its equals) keep
    them too, so both ways give the same list.
    """

    __slots__ = ("size", "_fifo", "_sorted", "_mad_cache", "_stale")

    def __init__(self, size: int):
        if size < 3:
            raise ValueError("window size must be at least 3")
        self.size = size
        self._fifo: deque[tuple[int, float]] = deque()
        self._sorted: list[float] = []
        self._mad_cache: float | None = None
        self._stale = False  # True: ``_sorted`` lags the FIFO; ``_sorted_now`` rebuilds it

    def __len__(self) -> int:
        return len(self._fifo)

    def push(self, step: int, x: float) -> None:
        if self._stale:
            self.append_unsorted(step, x)
            return
        s = self._sorted
        if len(s) >= self.size:
            _, old = self._fifo.popleft()
            del s[bisect_left(s, old)]
        insort(s, x)
        self._fifo.append((step, x))
        self._mad_cache = None

    def append_unsorted(self, step: int, x: float) -> None:
        """``push`` without keeping the sorted copy: O(1). For a writer that reads the order
        statistics much less often than it pushes (the sort then costs less than the inserts)."""
        f = self._fifo
        if len(f) >= self.size:
            f.popleft()
        f.append((step, x))
        self._stale = True

    def _sorted_now(self) -> list[float]:
        """The sorted values, rebuilt in place if stale (aliases of the list stay valid)."""
        s = self._sorted
        if self._stale:
            s[:] = map(_second, self._fifo)
            s.sort()
            self._stale = False
            self._mad_cache = None
        return s

    def median(self) -> float:
        s = self._sorted_now()
        n = len(s)
        h = n >> 1
        return s[h] if n & 1 else 0.5 * (s[h - 1] + s[h])

    def quantile(self, q: float) -> float:
        """Nearest-rank quantile (cheap; used for bands, not for statistics that need interpolation)."""
        s = self._sorted_now()
        return s[min(len(s) - 1, max(0, int(q * len(s))))]

    def mad(self) -> float:
        """Median absolute deviation from the median, exact, in O(log n)."""
        s = self._sorted_now()
        if self._mad_cache is None:
            n = len(s)
            m = self.median()
            p = bisect_left(s, m)
            if n & 1:
                self._mad_cache = _kth_distance(s, m, p, n >> 1)
            else:
                self._mad_cache = 0.5 * (_kth_distance(s, m, p, (n >> 1) - 1) + _kth_distance(s, m, p, n >> 1))
        return self._mad_cache

    def rewind(self, keep_through_step: int) -> None:
        """Forget values recorded at steps after ``keep_through_step`` (the FIFO is in step order)."""
        f, s = self._fifo, self._sorted
        while f and f[-1][0] > keep_through_step:
            _, x = f.pop()
            if not self._stale:
                del s[bisect_left(s, x)]
        self._mad_cache = None

    def clear(self) -> None:
        self._fifo.clear()
        self._sorted.clear()
        self._mad_cache = None
        self._stale = False

    def values(self) -> list[float]:
        return [x for _, x in self._fifo]

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "items": [[st, x] for st, x in self._fifo]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.size = int(d["size"])
        self.clear()
        for st, x in d["items"]:
            self.push(int(st), float(x))


_second = itemgetter(1)


def _kth_distance(s: list[float], m: float, p: int, k: int) -> float:
    """k-th smallest (0-based) of |x - m| over sorted ``s`` where s[:p] < m <= s[p:].

    The distances to the left of ``p`` read right-to-left are ascending, and so are those to the
    right read left-to-right: the k-th smallest of two sorted runs is a binary search on how many
    come from the left run.
    """
    nl, nr = p, len(s) - p
    lo, hi = max(0, k + 1 - nr), min(k + 1, nl)
    while lo < hi:
        i = (lo + hi) >> 1
        j = k + 1 - i
        # take more from the left while its next distance is smaller than the last taken on the right
        if i < nl and j > 0 and (m - s[p - 1 - i]) < (s[p + j - 1] - m):
            lo = i + 1
        else:
            hi = i
    i, j = lo, k + 1 - lo
    a = (m - s[p - i]) if i > 0 else -math.inf
    b = (s[p + j - 1] - m) if j > 0 else -math.inf
    return a if a > b else b


class Ema:
    """Exponential moving average; ``None`` until the first value."""

    __slots__ = ("alpha", "value")

    def __init__(self, alpha: float, value: float | None = None):
        self.alpha = alpha
        self.value = value

    def update(self, x: float) -> float:
        v = self.value
        self.value = x if v is None else v + self.alpha * (x - v)
        return self.value


class SpikeDetector:
    """Is ``x`` anomalously high against the recent history of the same signal?

    Two tests must both pass, because each alone misleads:

    - robust z: ``(x - median) / (1.4826 * MAD)`` over the last ``window`` *admitted* values says the
      value is statistically unusual. Alone it cries wolf late in training, when the noise is so
      small that a 1% wiggle is many sigmas.
    - ratio to the recent level (an EMA of admitted values, which tracks a falling loss faster than
      the median does) says the excess is large enough to matter.

    ``ELEVATED`` uses lower bars for both; it feeds sustained-divergence counting. Elevated, spiking
    and non-finite values are *not admitted* to the baseline, so one spike cannot hide the next. If
    most recent values are being refused (``readmit_fraction`` of the last ``readmit_window``), the
    level has genuinely moved and values are admitted again: the baseline follows real regime
    changes instead of flagging forever.
    """

    __slots__ = (
        "window", "ema", "min_history", "z_spike", "ratio_spike", "z_elevated", "ratio_elevated",
        "scale_floor", "readmit_window", "readmit_fraction", "_refused", "_refused_count",
        "z", "ratio", "baseline", "scale", "_gate", "_fifo", "_size", "_alpha", "recent", "_raw", "_dabs",
        "noise_floor", "noise_cap",
    )

    def __init__(
        self,
        window: int = 128,
        min_history: int = 50,
        z_spike: float = 6.0,
        ratio_spike: float = 1.1,
        z_elevated: float = 3.0,
        ratio_elevated: float = 1.03,
        ema_alpha: float = 0.05,
        scale_floor: float = 1e-3,
        readmit_window: int = 32,
        readmit_fraction: float = 0.75,
        recent: int = 0,
    ):
        self.window = SortedWindow(window)
        self.ema = Ema(ema_alpha)
        # aliases of the window's containers (the same objects, never rebound) for the hot path
        self._fifo, self._size, self._alpha = self.window._fifo, window, ema_alpha
        self.min_history = max(3, min_history)
        self.z_spike, self.ratio_spike = z_spike, ratio_spike
        self.z_elevated, self.ratio_elevated = z_elevated, ratio_elevated
        self.scale_floor = scale_floor  # relative to the median: a 4-decimal loss has no spread below ~1e-4
        self.readmit_window, self.readmit_fraction = readmit_window, readmit_fraction
        self._refused: deque[bool] = deque(maxlen=readmit_window)
        self._refused_count = 0
        self._gate = min(ratio_spike, ratio_elevated)
        self.recent = recent  # > 0: noise-aware verdicts (see update)
        self._raw: deque[float] = deque(maxlen=2 * recent if recent else 1)  # every finite value, spikes too
        # |differences| of consecutive _raw values, kept as they arrive: noise() then only sorts them
        self._dabs: deque[float] = deque(maxlen=max(1, 2 * recent - 1))
        self.noise_floor = 0.0  # the caller's slow per-step noise sigma (see update); 0: none
        self.noise_cap = 0.0  # the most the spread may be taken as: a multiple of the per-step noise; 0: none
        # details of the last verdict, for findings (only meaningful when it was not NORMAL)
        self.z = 0.0
        self.ratio = 1.0
        self.baseline = 0.0
        self.scale = 0.0

    def _note_refusal(self, refused: bool) -> None:
        q = self._refused
        if len(q) == q.maxlen and q[0]:
            self._refused_count -= 1
        q.append(refused)
        if refused:
            self._refused_count += 1

    def update(self, step: int, x: float) -> int:
        """Classify ``x`` and (unless anomalous) admit it to the baseline. Returns a verdict code.

        The window push and EMA update are written inline: this runs for every step of every run.
        The common path only appends to the window's FIFO (``SortedWindow.append_unsorted``): the
        order statistics are needed only past the ratio gate (~2 % of healthy loss steps), where
        one sort of the window costs less than the inserts it replaces, and not even there when
        the noise floor alone keeps the value NORMAL (``_normal_below_floor``).
        """
        if x - x != 0.0:  # NaN or +-inf (inf - inf is NaN)
            self._note_refusal(True)
            return NONFINITE
        if self.recent:
            raw = self._raw
            if raw:
                self._dabs.append(abs(x - raw[-1]))
            raw.append(x)
        w = self.window
        fifo = self._fifo
        ema = self.ema
        level = ema.value
        n = len(fifo)
        if n < self.min_history:
            w.push(step, x)
            ema.value = x if level is None else level + self._alpha * (x - level)
            return WARMUP
        ratio = x / level if level > 0 else (math.inf if x > 0 else 1.0)
        if ratio < self._gate:  # the common case: O(1), no order statistics needed
            if n >= self._size:
                fifo.popleft()
            fifo.append((step, x))
            w._stale = True
            ema.value = level + self._alpha * (x - level)
            if self._refused_count:
                self._note_refusal(False)
            return NORMAL
        if self.recent and len(fifo) >= self.recent:
            # noise-aware: the level is the median of the most recent admitted values (the long
            # median lags a falling loss, understating early spikes) ...
            med = median_of([v for _, v in islice(reversed(fifo), self.recent)])
            if self._normal_below_floor(x, med):
                self.ratio, self.baseline = ratio, med
                w.push(step, x)
                ema.update(x)
                self._note_refusal(False)
                return NORMAL
            scale = MAD_TO_SIGMA * w.mad()
        else:
            med = w.median()
            scale = MAD_TO_SIGMA * w.mad()
        floor = self.scale_floor * abs(med)
        if scale < floor:
            scale = floor
        z = (x - med) / scale if scale > 0 else math.inf
        if self.recent and z >= self.z_elevated and self._raw:
            # ... and the spread is the larger of the long window's and the local one of every
            # recent value, spikes included: the admitted window leaves values above 3 sigma out,
            # so its MAD understates the noise, and a noisy stretch should raise its own bar (the
            # false flags sat at 4-5 sigma of local noise). Only needed when z could pass a bar.
            cap = self.noise_cap
            if not 0.0 < cap <= scale:  # else the cap below decides alone: the local MAD could only raise scale
                raw = list(self._raw)
                rm = median_of(raw)
                local = MAD_TO_SIGMA * median_of([abs(v - rm) for v in raw])
                if local > scale:
                    scale = local
            # ... but a MAD around a median counts a fast descent as spread (128 losses falling
            # 0.5 nat early in a run): capped by the caller's per-step noise from first differences,
            # which a trend does not inflate (a clear early spike at z 8 in hindsight went unflagged)
            if 0.0 < cap < scale:
                scale = cap
            # ... and never below the run's slow per-step noise (first differences over a few hundred
            # steps): both MADs come from a few dozen values and now and then understate the spread
            # by 15-20 %, which is exactly what turned 5-sigma wiggles into 6-sigma flags.
            if self.noise_floor > scale:
                scale = self.noise_floor
            z = (x - med) / scale
        self.z, self.ratio, self.baseline, self.scale = z, ratio, med, scale
        if z >= self.z_spike and ratio >= self.ratio_spike:
            verdict = SPIKE
        elif z >= self.z_elevated and ratio >= self.ratio_elevated:
            verdict = ELEVATED
        else:
            verdict = NORMAL
        if verdict == NORMAL or self._refused_count + 1 >= self.readmit_fraction * self.readmit_window:
            w.push(step, x)
            ema.update(x)
            self._note_refusal(False)
        else:
            self._note_refusal(True)
        return verdict

    def _normal_below_floor(self, x: float, med: float) -> bool:
        """True when ``x`` is NORMAL whatever the spread: its excess over ``med`` is under the lower
        bar in units of the noise floor. Every path of ``update`` that can flag ``x`` divides that
        excess by a spread of at least the floor (z below the elevated bar stays NORMAL, and z at
        or above it takes the floor as the least spread), so the window's sort and MADs can be
        skipped (about 20 us, on ~40 % of the losses past the ratio gate). Only with the
        spike bar at or above the elevated one, so that a z below the elevated bar flags nothing.
        ``z`` and ``scale`` are then not computed: they are read only for a flagged value."""
        nf = self.noise_floor
        return nf > 0.0 and self.z_spike >= self.z_elevated and (x - med) / nf < self.z_elevated

    def noise(self) -> float:
        """Robust per-step noise sigma: from first differences of the recent values when they are
        kept (a falling loss does not count as spread), else the admitted window's MAD."""
        if self.recent and len(self._raw) >= 8:
            return _abs_diff_sigma(self._dabs)  # = diff_sigma(self._raw): the same differences, kept per step
        return MAD_TO_SIGMA * self.window.mad()

    def level(self) -> float | None:
        """The pre-anomaly baseline level: median of the admitted window (None while empty)."""
        return self.window.median() if len(self.window) else None

    def rewind(self, keep_through_step: int) -> None:
        """Drop values after a restored step; restart the EMA from the surviving median."""
        self.window.rewind(keep_through_step)
        self.ema.value = self.window.median() if len(self.window) else None
        self._refused.clear()
        self._refused_count = 0

    def reset(self) -> None:
        self.window.clear()
        self.ema.value = None
        self._refused.clear()
        self._refused_count = 0

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window.state_dict(), "ema": self.ema.value, "refused": list(self._refused)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.window.load_state_dict(d["window"])
        self.ema.value = d["ema"]
        self._refused.clear()
        self._refused_count = 0
        for r in d["refused"]:
            self._note_refusal(bool(r))


class KOfN:
    """Fires when at least ``k`` of the last ``n`` observed steps were flagged.

    Keeps the flagged steps themselves, so the finding can name the onset (the oldest flagged step
    still in the window).
    """

    __slots__ = ("k", "n", "_flagged")

    def __init__(self, k: int, n: int):
        if not 1 <= k <= n:
            raise ValueError("need 1 <= k <= n")
        self.k, self.n = k, n
        self._flagged: deque[int] = deque()

    def update(self, step: int, flagged: bool) -> bool:
        f = self._flagged
        if flagged:
            f.append(step)
        while f and f[0] <= step - self.n:
            f.popleft()
        return len(f) >= self.k

    def onset(self) -> int | None:
        return self._flagged[0] if self._flagged else None

    def clear(self) -> None:
        self._flagged.clear()

    def rewind(self, keep_through_step: int) -> None:
        f = self._flagged
        while f and f[-1] > keep_through_step:
            f.pop()

    def state_dict(self) -> dict[str, Any]:
        return {"flagged": list(self._flagged)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._flagged = deque(int(s) for s in d["flagged"])


class Persistence:
    """Fires once a condition has held for ``min_steps`` consecutive steps *and* ``min_seconds``.

    Throughput dips for a step or two on every checkpoint or eval; only a sustained shortfall is
    worth a page. Time comes from the records (``StepRecord.time``), so backtests replay exactly.
    """

    __slots__ = ("min_steps", "min_seconds", "since_step", "since_time", "count")

    def __init__(self, min_steps: int = 1, min_seconds: float = 0.0):
        self.min_steps, self.min_seconds = min_steps, min_seconds
        self.since_step: int | None = None
        self.since_time: float | None = None
        self.count = 0

    def update(self, step: int, t: float, condition: bool) -> bool:
        if not condition:
            self.count = 0
            self.since_step = self.since_time = None
            return False
        if self.count == 0:
            self.since_step, self.since_time = step, t
        self.count += 1
        return self.count >= self.min_steps and (t - self.since_time) >= self.min_seconds

    def reset(self) -> None:
        self.update(0, 0.0, False)

    def state_dict(self) -> dict[str, Any]:
        return {"since_step": self.since_step, "since_time": self.since_time, "count": self.count}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.since_step, self.since_time, self.count = d["since_step"], d["since_time"], int(d["count"])


def diff_sigma(xs: Sequence[float]) -> float:
    """Robust per-step noise sigma from first differences: a trend (a falling loss) cancels out,
    which a MAD around the median does not (it counts the descent as spread)."""
    # |difference| about zero, not about the median difference: the per-step drift of a loss
    # curve (~1e-4 nats) is nothing next to its noise, and one sort instead of two
    return _abs_diff_sigma(map(abs, map(sub, islice(xs, 1, None), xs)))


def _abs_diff_sigma(abs_diffs) -> float:
    """``diff_sigma`` from the absolute first differences themselves."""
    d = sorted(abs_diffs)
    if not d:
        return 0.0
    h = len(d) >> 1
    return MAD_TO_SIGMA * (d[h] if len(d) & 1 else 0.5 * (d[h - 1] + d[h])) / math.sqrt(2.0)


def median_of(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    h = n >> 1
    return s[h] if n & 1 else 0.5 * (s[h - 1] + s[h])


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


class LevelShift:
    """Persistent damage: the median of the last ``window`` losses stands above the run's own best level.

    A loss spike is one bad batch; damage is loss that *stays* high on the following, different
    batches (a level shift, a slow decay, a climb). The median of a short window ignores a spike of
    a few steps but moves once most of the window is elevated. The reference is the run's best
    level: the lowest such median over the last ``horizon`` steps, excluding the windows that
    overlap the current one (a healthy run's loss only falls, so a rise above its own best is the
    signal; a rolling baseline would follow a slow climb up). The bar is noise-aware:
    ``max(min_rise x best, sigmas x noise)`` where noise is a robust per-step sigma supplied by the
    caller (``SpikeDetector.noise``: from first differences, so a fast early descent does not count
    as noise), because a 0.1-nat move is nothing in a noisy run and a lot in a quiet one.

    With ``jump_sigmas`` > 0 it also compares each window with the window just before it (see
    ``feed``): in a fast early descent the descent itself soon undercuts the pre-jump best, so a
    small jump there never stands a bar above the best, but it does stand above its own past.
    ``jump_detrend`` (0..1) credits that comparison with this fraction of the descent the run
    showed over the ~100 steps before: healthy, the window after is *lower* by about one window of
    descent, which a jump must first make up (see ``_descent``).

    A level verdict also needs the window's lower quartile ``QUARTILE_SIGMAS`` noise sigmas above
    the best: a shift lifts the whole window, recovered spikes bunched into it only its median.

    A verdict that passes its bars at the per-step noise is judged again at the noise the run's
    level really shows (``_still_past``, ``measure_wander``): for a loss logged smoothed, or one that
    drifts, first differences understate how far window medians wander by 3-10x.

    ``onset()`` estimates where the shift began: the first step of the current elevated stretch
    (median above half the bar), less a window (the median lags a jump by half a window, and a
    slow climb by more); for a jump, two windows back.

    Cost per step: a deque append. Every ``stride`` steps (a sixth of the window, at least 4): a
    sort of the window (the median) and a sliding minimum (amortised O(1)). A verdict every few
    steps delays a detection by at most ``stride - 1`` steps, small next to the window's own lag,
    and keeps two of these well under a microsecond per step together.
    """

    __slots__ = ("window", "stride", "horizon", "sigmas", "min_rise", "warmup", "n", "_pending", "_mono",
                 "_above_since", "_v", "_st", "excess", "best", "bar", "jump_sigmas", "_jz", "_jzq", "_q", "kind",
                 "jump_detrend", "_hist", "_hist_min", "credit", "_lag", "_lrm", "_d2", "wander", "_past")

    SEGMENTS = 3  # the descent's rate is the slowest of this many consecutive spans of past medians
    QUARTILE_SIGMAS = 1.0  # a level verdict also needs the window's lower quartile this many noise sigmas above the best
    WANDER_SAMPLES = 128  # second differences of window medians kept to measure how far the level wanders (``measure_wander``)
    WANDER_MIN = 32  # fewer than this: no measurement, the per-step noise stands
    WANDER_SLACK = 0.5  # the noise is scaled by (measured ratio - this), at least 1: a white-noise run's ratio wanders to ~2
    PAST_STEPS = 1000  # a verdict also needs its excess PAST_FACTOR x the largest the run showed over this many steps before
    PAST_FACTOR = 2.0  # (see ``_beyond_past``)
    PAST_MIN = 20  # fewer earlier verdicts than this: no such check
    PAST_GAP = 200  # the past ends this many steps back: a climb caught late rose over them

    def __init__(self, window: int = 24, horizon: int = 500, sigmas: float = 2.5, min_rise: float = 0.02, warmup: int = 100,
                 jump_sigmas: float = 0.0, jump_detrend: float = 0.0):
        self.window, self.horizon, self.sigmas, self.min_rise, self.warmup = window, horizon, sigmas, min_rise, warmup
        self.stride = max(4, window // 6)
        self.jump_sigmas = jump_sigmas
        self.jump_detrend = jump_detrend if jump_sigmas > 0 else 0.0
        # past window medians for the descent (``_descent``): one per stride over four windows, and
        # at least two windows' worth before the descent is measured at all
        self._hist_min = 2 * window // self.stride + 1
        # sd of the difference of two medians (and of two lower quartiles) of ``window`` normal
        # losses, per unit of per-step sigma
        self._jz = 1.2533 * math.sqrt(2.0 / window)
        self._jzq = math.sqrt(2.0 * 0.1875 / window) / 0.3178  # sqrt(2 p (1-p) / n) / pdf(z_p), p = 1/4
        self._q = (window - 1) // 4  # the lower quartile's index in the sorted window
        self._lag = -(-window // self.stride)  # verdicts per window: medians this many verdicts apart do not overlap
        self.kind = "level"  # what the last True verdict saw: "level" (above the best) or "jump"
        self.reset()

    def update(self, step: int, x: float, noise: float) -> bool:
        """Admit a finite loss; ``noise`` is the current robust per-step sigma. True = shifted."""
        return self.feed([step], [x], noise)

    def feed(self, steps: list[int], xs: list[float], noise: float) -> bool:
        """Admit several finite losses at once (``xs`` at ``steps``); the verdict is the last one's.

        The same as ``update`` on each in turn, provided no verdict is due before the last loss
        (the caller batches the steps between verdicts: a multiple of ``stride`` can only be the
        last); otherwise it falls back to one at a time."""
        n0, k, s = self.n, len(xs), self.stride
        if k > 1 and (n0 + k - 1) // s != n0 // s:
            for i in range(k - 1):
                self.feed(steps[i:i + 1], xs[i:i + 1], noise)
            return self.feed(steps[-1:], xs[-1:], noise)
        v = self._v
        v.extend(xs)
        self._st.extend(steps)
        self.n = n = n0 + k
        if n % s or len(v) < self.window:
            return False
        step = steps[-1]
        srt = sorted(v)
        h = self.window >> 1
        m = srt[h] if self.window & 1 else 0.5 * (srt[h - 1] + srt[h])
        pend, mono = self._pending, self._mono
        q = srt[self._q]
        pend.append((step, m, q))
        lrm = self._lrm
        lrm.append(m)
        if len(lrm) == lrm.maxlen:  # a second difference of three medians a window apart each
            self._d2.append((step, m - 2.0 * lrm[self._lag] + lrm[0]))
        before = None
        if pend[0][0] <= step - self.window:  # a window that no longer overlaps this one (one per stride)
            ps, v, q0 = before = pend.popleft()
            if self.jump_detrend:
                self._hist.append((ps, v))
            while mono and mono[-1][1] >= v:
                mono.pop()
            mono.append((ps, v))
        while mono and mono[0][0] < step - self.horizon:
            mono.popleft()
        if not mono or self.n < self.warmup:
            return False
        best = mono[0][1]
        ex = m - best
        self._past.append((step, ex, m - before[1] if before is not None else None))
        bar = self.sigmas * noise
        floor = self.min_rise * (best if best > 0 else -best)
        if floor > bar:
            bar = floor
        if ex > 0.5 * bar:
            self.excess, self.best, self.bar = ex, best, bar
            if self._above_since is None:
                self._above_since = step
            if ex > bar and q - best > self.QUARTILE_SIGMAS * noise and self._still_past(ex, q - best, noise, self.sigmas, self.QUARTILE_SIGMAS, floor, 0.0) \
                    and self._beyond_past(ex, 1, min(step - self.PAST_GAP, self._above_since - self.window), step):
                # a shift lifts the whole window; recovered spikes bunched into it (14 of 24 losses
                # in three multi-step spikes) lift its median past the bar but not its lower quartile
                self.kind = "level"
                self.bar = max(self.sigmas * noise * self.wander, floor)  # the bar it passed (the same unless the level wanders)
                return True
        else:
            self._above_since = None
        if before is not None and self.jump_sigmas > 0 and q0 is not None:
            # A jump: this window stands above the window just before it, by its median *and* by its
            # lower quartile. In a fast early descent the run's best is soon undercut by the descent
            # itself, so a +0.25-nat jump at step ~220 never stood above it by the bar; the window
            # before has no such lag. A jump lifts the whole window; a cluster of recovered spikes
            # (half a window of them) lifts the median but not the lower quartile, and a dip in the
            # window before lowers its quartile but not its median (healthy runs: min of the two
            # z <= 3.3 on every public and synthetic curve; 0.25-nat jumps >= 4.5).
            jb = self.jump_sigmas * noise
            floor_j = floor if floor > 0 else 0.0
            bm, bq = max(jb * self._jz, floor_j), max(jb * self._jzq, floor_j)
            short = max(bm - (m - v), bq - (q - q0))  # what a credit must make up for a jump
            credit = self._descent(short) if self.jump_detrend and short >= 0.0 else 0.0
            if m - v + credit > bm and q - q0 + credit > bq and self._still_past(
                    m - v + credit, q - q0 + credit, noise, self.jump_sigmas * self._jz, self.jump_sigmas * self._jzq, floor_j, floor_j) \
                    and self._beyond_past(m - v + credit, 2, step - self.PAST_GAP, step):
                # ``best`` is the level expected of this window: the one before, less the credited descent;
                # the bar is the one it passed (the same as ``bm`` unless the level wanders)
                self.kind, self.excess, self.best, self.credit = "jump", m - v + credit, v - credit, credit
                self.bar = max(jb * self._jz * self.wander, floor_j)
                return True
        return False

    def _beyond_past(self, stat: float, idx: int, cut: int, step: int) -> bool:
        """Does ``stat`` (a level excess, idx 1, or a jump, idx 2) stand ``PAST_FACTOR`` times above
        the largest of its kind at this run's verdicts from ``PAST_STEPS`` before ``step`` to ``cut``?

        The bars are set in per-step noise, and on a run logged raw that is far above how its
        level wanders (a window median's noise is ~1/4 of it), so the run's own slow wander never
        reaches them. A loss logged smoothed (an EMA, a running mean) or a quieter run (a bigger
        batch) shrinks the per-step noise but not the wander of its data order: on the 48 healthy
        real curves so logged, the verdicts that fired stood only 0.72-1.80x above the largest of
        their kind 200-1000 steps before, against at least 2.47x (median 7.9) for the first verdict
        on every injected jump and slow decay (0.25-1.0 nats) that these tests caught
        (``bench/past_check_probe.py``). ``cut`` leaves the newest ``PAST_GAP`` steps out (a jump
        must not raise its own bar, nor a climb caught late) and, for the level test, the current
        elevated stretch (a slow climb's own rise is not its past)."""
        top, k = largest_between(self._past, step - self.PAST_STEPS, cut, idx)
        if k < self.PAST_MIN or top is None or top <= 0.0:
            return True
        return stat > self.PAST_FACTOR * top

    def _still_past(self, ex: float, exq: float, noise: float, k_median: float, k_quartile: float, floor: float,
                    floor_q: float) -> bool:
        """Does a verdict that passed its bars at the per-step ``noise`` still pass them at the
        noise the run's level really shows? (``wander`` x noise; ``k_*``: the bars in units of it.)

        The per-step noise comes from first differences, which is right for a loss whose batches
        are independent. A loss logged smoothed (an EMA, a running mean) or one that drifts with
        its data order has far smaller differences than its level's real spread: on the 23 public
        curves smoothed with an EMA of 0.3, the window median stood 2 % above the run's best on 19
        of them, and every test would have rolled back. Measured only here, for a verdict that
        would fire (rare): a healthy white-noise run never pays for it."""
        f = self.wander = self.measure_wander(noise)
        if f <= 1.0:
            return True
        return ex > max(k_median * noise * f, floor) and exq > max(k_quartile * noise * f, floor_q)

    def measure_wander(self, noise: float) -> float:
        """How much more the run's window medians wander than independent losses of per-step
        ``noise`` would make them, less ``WANDER_SLACK``, at least 1.

        Second differences of window medians a window apart (each spans three windows; a steady
        descent cancels in them) are differenced again three windows apart (no data in common; a
        curvature that changes slowly cancels too), and the robust spread (MAD) of those is set
        against its white-noise value ``noise * 1.2533 * sqrt(12 / window)``. The last two windows'
        worth are left out: a jump the test is judging must not raise its own bar. Up to 128 of them
        (~5 windows of independent information, so the ratio of a white-noise run wanders: 1st-99th
        percentile 0.55-1.9 on the public curves, hence the slack); an EMA of 0.3 gives 2-9, of 0.1
        5-30."""
        d2, lag = self._d2, self._lag
        n = len(d2) - 2 * lag  # the newest two windows' worth left out
        if n - 3 * lag < self.WANDER_MIN or not noise > 0:
            return 1.0
        vals = [v for _, v in islice(d2, 0, n)]
        # differences of second differences three windows apart (no data in common): a descent's
        # curvature, which changes slowly, cancels too (the fast early descent's does not in d2 alone)
        dd = list(map(sub, vals[3 * lag:], vals))
        med = median_of(dd)
        spread = MAD_TO_SIGMA * median_of([abs(v - med) for v in dd])
        ratio = spread / (noise * 1.2533 * math.sqrt(12.0 / self.window))
        f = ratio - self.WANDER_SLACK
        return f if f > 1.0 else 1.0

    def _descent(self, short: float) -> float:
        """How far a healthy descent would take the next window below the last closed one, times
        ``jump_detrend``; 0 when even the largest credit possible would not exceed ``short`` (the
        slowest span's rate is at most the whole stretch's: most verdicts end there), and 0 unless
        the past window medians fell over each of ``SEGMENTS`` consecutive spans of the last ~4
        windows (~32 steps each). The slowest span's rate is carried on:
        - a descent slows, so an older rate over-predicts the next window's descent (carrying on
          the whole 4-window rate at half weight rolled back 22 of 24 synthetic power-law starts
          at steps 100-300; at full weight the slowest of four spans did on 87 of 120 fresh ones);
        - a recovered spike cluster lifts, and a dip of easy batches lowers, the medians of one or
          two spans: every span must fall, and the slowest decides (with two halves, clusters and
          dips 60 steps apart passed for a jump: ``test_level_shift_jump_test_ignores_spike_clusters_and_dips``).
        Its own error (~0.1 sigma at half weight) is small next to the comparison's 0.36 sigma, and
        taking the slowest of three biases it low, so the bar is left as it is."""
        hist = self._hist
        n = len(hist)
        if n < self._hist_min:
            return 0.0
        (s_prev, m_prev), (s_end, m_end) = hist[0], hist[-1]
        if s_end <= s_prev or self.jump_detrend * (m_prev - m_end) / (s_end - s_prev) * self.window <= short:
            return 0.0
        k = self.SEGMENTS
        rate = math.inf
        for j in range(1, k + 1):
            s_j, m_j = hist[(n - 1) * j // k]
            if not (m_prev > m_j and s_prev < s_j):
                return 0.0  # not falling over every segment (a plateau, a climb, a cluster or dip): no credit
            r = (m_prev - m_j) / (s_j - s_prev)
            if r < rate:
                rate = r
            s_prev, m_prev = s_j, m_j
        return self.jump_detrend * rate * self.window

    def onset(self, step: int) -> int:
        if self.kind == "jump":  # it happened in this window or at the end of the one before
            return max(0, step - 2 * self.window)
        since = self._above_since if self._above_since is not None else step
        return max(0, since - self.window)  # a whole window back: a rollback a little early costs steps, one late keeps the damage

    def rewind(self, keep_through_step: int) -> None:
        st, v = self._st, self._v
        while st and st[-1] > keep_through_step:
            st.pop()
            v.pop()
        for q in (self._pending, self._mono, self._hist, self._d2, self._past):
            while q and q[-1][0] > keep_through_step:
                q.pop()
        self._lrm.clear()  # the next second difference starts from fresh medians (lost: 2 windows of samples)
        self._above_since = None

    def reset(self) -> None:
        self._v: deque[float] = deque(maxlen=self.window)  # the window's losses ...
        self._st: deque[int] = deque(maxlen=self.window)  # ... and their steps
        self.n = 0
        self._pending: deque[tuple[int, float]] = deque()
        self._mono: deque[tuple[int, float]] = deque()
        self._hist: deque[tuple[int, float]] = deque(maxlen=4 * self.window // self.stride + 1)  # (step, median)
        self._above_since: int | None = None
        self.excess = self.best = self.bar = self.credit = 0.0
        self._lrm: deque[float] = deque(maxlen=2 * self._lag + 1)  # the last window medians, one per verdict
        self._d2: deque[tuple[int, float]] = deque(maxlen=self.WANDER_SAMPLES + 5 * self._lag)  # (step, second difference)
        self.wander = 1.0
        # (step, level excess, jump) at each verdict, for ``_beyond_past``
        self._past: deque[tuple[int, float, float | None]] = deque(maxlen=(self.PAST_STEPS + 2 * self.window) // self.stride + 2)

    def state_dict(self) -> dict[str, Any]:
        return {"window": [[s, v] for s, v in zip(self._st, self._v)], "n": self.n, "pending": [list(p) for p in self._pending],
                "mono": [list(p) for p in self._mono], "above_since": self._above_since,
                "hist": [list(p) for p in self._hist], "lrm": list(self._lrm), "d2": [list(p) for p in self._d2],
                "past": [list(p) for p in self._past]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.reset()
        for s, v in d["window"]:
            self._st.append(int(s))
            self._v.append(float(v))
        self.n = int(d["n"])
        # (step, median, lower quartile); a state saved before the jump test has no quartile
        self._pending = deque((int(p[0]), float(p[1]), float(p[2]) if len(p) > 2 and p[2] is not None else None)
                              for p in d["pending"])
        self._mono = deque((int(s), float(v)) for s, v in d["mono"])
        self._hist.extend((int(s), float(v)) for s, v in d.get("hist", ()))  # none in a state saved before the detrend
        self._lrm.extend(float(v) for v in d.get("lrm", ()))  # none in a state saved before the wander measure
        self._d2.extend((int(s), float(v)) for s, v in d.get("d2", ()))
        self._past.extend((int(p[0]), float(p[1]), None if p[2] is None else float(p[2])) for p in d.get("past", ()))  # none before the check
        self._above_since = d["above_since"]


def largest_between(entries: Iterable[tuple], lo: int, hi: int, idx: int) -> tuple[float | None, int]:
    """(the largest ``e[idx]`` that is not None, how many there were) over ``entries`` (tuples led
    by their step, in step order) with a step in ``[lo, hi]``: a run's own past, for the checks
    that set a verdict against it (``LevelShift._beyond_past``, ``ClimbTrend._beyond_past``)."""
    top, k = None, 0
    for e in entries:
        if e[0] < lo:
            continue
        if e[0] > hi:
            break
        x = e[idx]
        if x is not None:
            k += 1
            if top is None or x > top:
                top = x
    return top, k


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

    The baseline is flat on purpose: a healthy loss falls, so its residuals against a flat level are
    negative (no alarm in the fast early descent or the lr cooldown). Extrapolating a fitted descent
    fires on the curvature of every early run (measured: z 9-15 at steps 150-300).

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

    __slots__ = ("window", "baseline", "sigmas", "stride", "warmup", "n", "_f", "_kw", "_norm2", "_ksum2", "z", "rise", "_start",
                 "_s0", "_s1", "_b", "_dirty", "_since_sync", "_phi_val", "_blocks", "_blk", "_spread",
                 "_zden", "_ksum", "_maxlen", "_phi_noise", "_phi_spread", "_last_noise", "_zpast")

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

    def __init__(self, window: int = 48, baseline: int = 100, sigmas: float = 5.5, warmup: int = 150, stride: int = 4):
        if window < 4 or baseline < 4:
            raise ValueError("window and baseline must be at least 4")
        self.window, self.baseline, self.sigmas, self.warmup, self.stride = window, baseline, sigmas, warmup, max(1, stride)
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
        the one before.

        Per step O(1): running sums of the window (plain and k-weighted) and of the baseline give
        the unclipped z; clipping only matters with outliers, so the exact clipped z (a pass over
        ``window + baseline`` values) is computed only when the unclipped one is near the bar."""
        f = self._f
        if spike and f:
            x = f[-1][1]
        if len(f) == self._maxlen:
            mid_step, x_mid = f[self.baseline]  # the window's oldest moves to the baseline
            blk = self._blk  # ... and, once it has left the window, calibrates phi (see _close_block)
            blk.append(x_mid)
            if len(blk) >= self.window:
                self._close_block(mid_step)
            if not self._dirty:
                s0 = self._s0
                self._s1 += self.window * x - s0
                self._s0 = s0 + (x - x_mid)
                self._b += x_mid - f[0][1]  # the baseline's oldest leaves
                self._since_sync += 1
            f.append((step, x))
            self.n = n = self.n + 1
        else:
            f.append((step, x))
            self.n = n = self.n + 1
            self._dirty = True
            if len(f) < self._maxlen:
                return False
        if n % self.stride or n < self.warmup or not noise > 0:
            return False
        if self._dirty or self._since_sync >= self.RESYNC:
            self._sync()
        self._last_noise = noise
        ramp = self._s1 - self._b / self.baseline * self._ksum  # the unclipped filter: z x its scale
        gate = self.sigmas - self.GATE
        if self._below_gate_whatever_phi(ramp, noise, gate):
            self.z = self.rise = 0.0  # far below the bar: not worth the exact pass
            return False
        spread = self._spread_now()
        if noise != self._phi_noise or spread is not self._phi_spread:  # both change rarely
            self._phi_noise, self._phi_spread = noise, spread
            self._phi_val = self._phi(noise)
        scale = self._phi_val * noise * self._zden
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
        return median_of(vals[w0:w0 + q]) - m > bar and median_of(vals[w0 + q:]) - m > bar and self._beyond_past(step)

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

    def _below_gate_whatever_phi(self, ramp: float, noise: float, gate: float) -> bool:
        """Is the unclipped z (``ramp / (phi * noise * zden)``) at most ``gate`` for any ``phi`` the
        calibration can give? phi is at least ``min(1, PHI_UNCALIBRATED)``: a larger phi only
        shrinks a positive z (rounding is monotone), and a z <= 0 is under any gate >= 0. On a
        healthy run this decides nearly every verdict, so the calibration (a sort of the block
        medians' differences, ~10 us) is computed only for the few that it does not."""
        if ramp <= 0.0:
            return gate >= 0.0
        least = self.PHI_UNCALIBRATED if self.PHI_UNCALIBRATED < 1.0 else 1.0
        return ramp / (least * noise * self._zden) <= gate

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
        self._dirty, self._since_sync = False, 0

    def onset(self) -> int:
        return max(0, self._start - self.window)

    def rewind(self, keep_through_step: int) -> None:
        f = self._f
        while f and f[-1][0] > keep_through_step:
            f.pop()
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
        self._s0 = self._s1 = self._b = 0.0
        self._dirty, self._since_sync = True, 0
        self.n = 0
        self.z = self.rise = 0.0
        self._phi_val = self.PHI_UNCALIBRATED
        self._phi_noise, self._phi_spread = -1.0, None  # what ``_phi_val`` was last computed from
        self._last_noise = 0.0
        self._start = 0
        self._blocks: deque[tuple[int, float]] = deque(maxlen=self.BLOCKS)  # (last step, median)
        self._blk: list[float] = []  # the block being filled
        self._spread: float | None | object = None  # _STALE: the blocks changed since it was computed
        self._zpast: deque[tuple[int, float]] = deque(maxlen=256)  # (step, z) of the exact passes (near the bar: rare)

    def state_dict(self) -> dict[str, Any]:
        return {"window": [list(p) for p in self._f], "n": self.n, "blocks": [list(p) for p in self._blocks],
                "block": list(self._blk), "zpast": [list(p) for p in self._zpast]}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.reset()
        self._f.extend((int(s), float(v)) for s, v in d["window"])
        self.n = int(d["n"])
        self._blocks.extend((int(s), float(v)) for s, v in d.get("blocks", []))  # older state: uncalibrated
        self._blk = [float(v) for v in d.get("block", [])][: self.window - 1]
        self._spread = _STALE
        self._zpast.extend((int(s), float(z)) for s, z in d.get("zpast", []))  # older state: none
