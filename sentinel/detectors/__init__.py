"""Detector building blocks: small, pure state machines over the numbers in a StepRecord.

Nothing here knows about rules files, runs or Redis. Each class answers one question about one
stream of numbers ("is this value a spike against its own recent history?", "has this value been
below its band for long enough?") and can save and restore its state as plain JSON, so a restarted
daemon picks up with the same baselines it had. One module per question:

- ``robust``: the statistics the others share (a sorted window with O(1) median and O(log n) MAD,
  an EMA, medians, per-step noise from first differences, the run's own past maximum);
- ``spike``: is this value a spike (``SpikeDetector``)? k of the last n flagged (``KOfN``)? a
  condition held for long enough (``Persistence``)?
- ``level``: has the loss's level moved up and stayed there (``LevelShift``)?
- ``climb``: is the loss climbing as a ramp (``ClimbTrend``)?
- ``descent``: did the loss jump against its own early descent (``DescentJump``)?
- ``ranks``: is one rank slower than the others (``straggler``), or its loss apart (``rank_outlier``)?

Why a robust, *self-excluding* baseline: OLMo-core's skip-step compares a loss with the mean and
standard deviation of the last 128 losses, and the spike then enters that window, inflating sigma
so that a second spike a few steps later hides behind the first. ``SpikeDetector`` keeps anomalous
values out of its own window, and measures spread with the median absolute deviation, which a few
outliers cannot move.

Cost: the MAD is only computed when a cheap ratio gate says the value might be anomalous.
``SpikeDetector`` goes one step further: on the common path it only appends to the window's FIFO and
leaves the sorted copy stale, which is rebuilt (one C sort) when a verdict or a reader needs it, a
few times per hundred steps.
"""

from sentinel.detectors.climb import ClimbTrend
from sentinel.detectors.descent import DescentJump
from sentinel.detectors.level import LevelShift
from sentinel.detectors.ranks import rank_outlier, straggler
from sentinel.detectors.robust import (
    MAD_TO_SIGMA,
    Ema,
    SortedWindow,
    diff_sigma,
    is_nonfinite,
    largest_between,
    median_of,
    slope_median,
)
from sentinel.detectors.spike import ELEVATED, NONFINITE, NORMAL, SPIKE, WARMUP, KOfN, Persistence, SpikeDetector

__all__ = [
    "ELEVATED",
    "MAD_TO_SIGMA",
    "NONFINITE",
    "NORMAL",
    "SPIKE",
    "WARMUP",
    "ClimbTrend",
    "DescentJump",
    "Ema",
    "KOfN",
    "LevelShift",
    "Persistence",
    "SortedWindow",
    "SpikeDetector",
    "diff_sigma",
    "is_nonfinite",
    "largest_between",
    "median_of",
    "rank_outlier",
    "slope_median",
    "straggler",
]
