"""Robust statistics over a stream of numbers: a sorted window with O(1) median and O(log n)
MAD, an EMA, medians, per-step noise from first differences, and the run's own past maximum.

Cost: ``SortedWindow`` keeps its values sorted with ``bisect`` (an O(log n) search and a memmove of
at most ``size`` floats, which for the window sizes used here is a few hundred nanoseconds). The
median is O(1) and the MAD is O(log n) (a k-th-smallest search over two sorted runs).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice
from operator import itemgetter, sub
from typing import Any

import numpy as np

from sentinel.detectors.packed import pack, unpack

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

    __slots__ = ("_fifo", "_mad_cache", "_sorted", "_stale", "size")

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
        return {"size": self.size, "items": pack(self._fifo, "if")}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.size = int(d["size"])
        self.clear()
        for st, x in unpack(d["items"], "if"):
            self.push(st, x)


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


def diff_sigma(xs: Sequence[float]) -> float:
    """Robust per-step noise sigma from first differences: a trend (a falling loss) cancels out,
    which a MAD around the median does not (it counts the descent as spread)."""
    # |difference| about zero, not about the median difference: the per-step drift of a loss
    # curve (~1e-4 nats) is nothing next to its noise, and one sort instead of two
    return abs_diff_sigma(map(abs, map(sub, islice(xs, 1, None), xs)))


def abs_diff_sigma(abs_diffs) -> float:
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


_PAIRS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # n -> (i, j, j - i) of every pair i < j
HALF_MAX = 8.0e307  # two floats under this in magnitude differ by a finite float


def slope_median(v: list[float], bounded: bool = False) -> float:
    """The Theil-Sen slope of ``v`` against its index: the median of every pairwise slope
    ``(v[j] - v[i]) / (j - i)``, ``i < j``, as ``median_of`` gives it (the same float: each slope is
    one IEEE subtraction and division, and the middle two are averaged as there).

    In numpy: for 24 losses, 276 slopes in ~4 µs against ~45 µs in a Python comprehension, which
    was the largest single cost of a sentinel watching a young fleet (``DescentJump``,
    docs/benchmarks/daemon-scale.md). ``bounded``: the caller knows every value is under
    ``HALF_MAX`` in magnitude (no difference can overflow), which spares the look (a fifth of the cost)."""
    n = len(v)
    if n < 2:
        raise ValueError("a slope needs at least two values")
    pairs = _PAIRS.get(n)
    if pairs is None:
        i, j = np.triu_indices(n, 1)
        pairs = _PAIRS[n] = (i, j, (j - i).astype(np.float64))
    i, j, lag = pairs
    a = np.array(v, dtype=np.float64)
    if bounded or (min(v) > -HALF_MAX and max(v) < HALF_MAX):  # no difference can overflow: numpy's error state
        s = a.take(j)  # left alone (setting it costs as much as the slopes: ~2 µs a call)
        s -= a.take(i)
        s /= lag
    else:
        with np.errstate(over="ignore", invalid="ignore"):  # past the float range: inf (or NaN), silently, as in Python
            s = (a[j] - a[i]) / lag
    h = len(s) >> 1
    if len(s) & 1:
        s.partition(h)
        return float(s[h])
    s.partition((h - 1, h))
    return 0.5 * (float(s[h - 1]) + float(s[h]))


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
