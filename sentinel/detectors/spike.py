"""Spike verdicts on one stream (``SpikeDetector``) and the counts built on them: k of the last n
steps flagged (``KOfN``), a condition held long enough (``Persistence``)."""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from typing import Any

from sentinel.detectors.packed import pack, unpack
from sentinel.detectors.robust import MAD_TO_SIGMA, Ema, SortedWindow, abs_diff_sigma, median_of

# verdict codes returned by SpikeDetector.update (ints, not enums: this is the per-step hot path)
WARMUP = -1  # not enough history for a verdict
NORMAL = 0
ELEVATED = 1  # above the baseline by a modest margin: counts towards sustained divergence
SPIKE = 2  # far above the baseline
NONFINITE = 3  # NaN or inf


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
        "_alpha",
        "_dabs",
        "_fifo",
        "_gate",
        "_raw",
        "_refused",
        "_refused_count",
        "_size",
        "baseline",
        "ema",
        "min_history",
        "noise_cap",
        "noise_floor",
        "ratio",
        "ratio_elevated",
        "ratio_spike",
        "readmit_fraction",
        "readmit_window",
        "recent",
        "scale",
        "scale_floor",
        "window",
        "z",
        "z_elevated",
        "z_spike",
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
            return self._warmup(step, x, n, level)
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

    WARMUP_OUTLIER = 10.0  # in warmup: a value this many times the median of the ones before is refused as a spike

    def _warmup(self, step: int, x: float, n: int, level: float | None) -> int:
        """Admit ``x`` while the history is too short for a verdict, unless it is absurd.

        Every value is admitted here and averaged into the level, so one corrupt value (a loss of
        1e30 at step 10 of a log) would hold the level up for ~1300 steps (5 % a step), and every
        later spike would be a small ratio of it: measured, 4 of 10 spikes on a real curve went
        unflagged. So from the third value on, one over ``WARMUP_OUTLIER`` x the median of those
        before is a SPIKE, not admitted (unless most recent values were refused: then the level
        has moved), and a level already that far above the median (an absurd first value) is
        reset to the median. No sane loss or grad norm curve reaches the bar in its first steps."""
        w, ema = self.window, self.ema
        if n >= 3:
            med = w.median()
            if med > 0.0 and x > self.WARMUP_OUTLIER * med and self._refused_count + 1 < self.readmit_fraction * self.readmit_window:
                scale = MAD_TO_SIGMA * w.mad()
                floor = self.scale_floor * med
                self.z = (x - med) / (scale if scale > floor else floor)
                self.ratio, self.baseline, self.scale = x / med, med, scale
                self._note_refusal(True)
                return SPIKE
        w.push(step, x)
        ema.value = v = x if level is None else level + self._alpha * (x - level)
        if n >= 2:
            med = w.median()
            if med > 0.0 and v > self.WARMUP_OUTLIER * med:
                ema.value = med
        return WARMUP

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
            return abs_diff_sigma(self._dabs)  # = diff_sigma(self._raw): the same differences, kept per step
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
        # the recent values and their differences too: they set the local spread a spike is judged
        # by and the per-step noise; without them a restored detector judged its next steps otherwise
        return {"window": self.window.state_dict(), "ema": self.ema.value, "refused": list(self._refused),
                "raw": pack(self._raw, "f"), "dabs": pack(self._dabs, "f")}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.window.load_state_dict(d["window"])
        self.ema.value = d["ema"]
        self._refused.clear()
        self._refused_count = 0
        for r in d["refused"]:
            self._note_refusal(bool(r))
        self._raw.clear()
        self._dabs.clear()
        self._raw.extend(unpack(d.get("raw", []), "f"))  # older state: none (refilled within 2 x recent steps)
        self._dabs.extend(unpack(d.get("dabs", []), "f"))


class KOfN:
    """Fires when at least ``k`` of the last ``n`` observed steps were flagged.

    Keeps the flagged steps themselves, so the finding can name the onset (the oldest flagged step
    still in the window).
    """

    __slots__ = ("_flagged", "k", "n")

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

    __slots__ = ("count", "min_seconds", "min_steps", "since_step", "since_time")

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
