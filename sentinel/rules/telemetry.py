"""The rules over the other per-step signals: grad norm, validation gap, throughput and MFU bands,
checkpoint age, data wait, the straggler rank and the rank whose loss stands apart."""

from __future__ import annotations

import math
from itertools import islice
from typing import Any

from sentinel import detectors as d
from sentinel.protocol import BUSY_PHASES
from sentinel.rules.base import Evaluator, Fields, Finding, fmt
from sentinel.rules.config import (
    BandRule,
    CheckpointAgeRule,
    DataWaitRule,
    GradNormSpikeRule,
    NonFiniteRule,
    RankLossRule,
    StragglerRule,
    ValDivergenceRule,
)


class GradEval(Evaluator):
    def __init__(self, cfg: GradNormSpikeRule, nf_cfg: NonFiniteRule):
        super().__init__(cfg, "grad_norm_spike")
        self.nf_cfg = nf_cfg
        self.det = d.SpikeDetector(
            window=cfg.window, min_history=cfg.min_history, z_spike=cfg.threshold, ratio_spike=cfg.min_ratio,
            z_elevated=cfg.threshold, ratio_elevated=cfg.min_ratio, ema_alpha=cfg.ema_alpha,
        )
        self._update = self.det.update
        self.nf_since: int | None = None  # the first step of the current run of non-finite grad norms

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        g = r["grad_norm"]
        if g == 0.0:  # not reported
            return
        step = r["step"]
        code = self._update(step, g)
        if code != d.NONFINITE:
            self.nf_since = None
        if code <= 0:
            return
        if code == d.NONFINITE:
            if self.nf_since is None:
                self.nf_since = step
            if self.nf_cfg.enabled and math.isfinite(r["loss"]):  # a non-finite loss was reported already
                c = self.nf_cfg
                # the onset is the run's first: the policy judges persistence from it (an inf grad
                # norm on every step, every update skipped, is damage however finite the loss)
                out.append(Finding("nonfinite", c.severity, c.action, step, f"grad norm is {g} "
                                   f"({step - self.nf_since + 1} step(s) in a row)",
                                   value=g, onset_step=self.nf_since, anomaly=True))
        elif code == d.SPIKE and self.cfg.enabled:
            det = self.det
            out.append(self.finding(step, f"grad norm {fmt(g)} vs baseline {fmt(det.baseline)}: z={det.z:.1f}, x{det.ratio:.2f}",
                                    value=g, onset_step=step, anomaly=self.cfg.action == "rollback"))

    def rewind(self, keep_through_step: int) -> None:
        self.det.rewind(keep_through_step)
        self.nf_since = None

    def reset(self) -> None:
        self.det.reset()
        self.nf_since = None

    def state_dict(self) -> dict[str, Any]:
        return {"det": self.det.state_dict(), "nf_since": self.nf_since}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.det.load_state_dict(st["det"])
        v = st.get("nf_since")
        self.nf_since = v if type(v) is int else None


class ValEval(Evaluator):
    """Validation loss pulling away from train loss: the gap (val - train level) exceeds its best
    value so far by ``max_gap_increase`` on ``consecutive`` evaluations. Uses ``val_loss``, else
    ``log(val_ppl)``. The train level is the median of the last ``RECENT`` losses the loss detector
    admitted (spikes never enter): an EMA lags a fast descent by ~1/alpha steps, which would make
    the early gap look falsely good and page later for nothing; a short median lags ~RECENT/2 steps.
    Read only at evaluation steps, so the rule costs nothing on the other steps."""

    RECENT = 16

    def __init__(self, cfg: ValDivergenceRule, loss_detector: d.SpikeDetector):
        super().__init__(cfg, "val_divergence")
        self.fifo = loss_detector.window._fifo  # (step, loss) of admitted losses, oldest first
        self.best_gap: float | None = None
        self.run = 0
        self.evals = 0

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        v = r["val_loss"]
        if v is None:
            p = r["val_ppl"]
            if p is None or not p > 0:
                return
            v = math.log(p)
        if not self.fifo or not math.isfinite(v):
            return
        srt = sorted(x for _, x in islice(reversed(self.fifo), self.RECENT))
        t = srt[len(srt) // 2]
        gap = v - t
        self.evals += 1
        if self.evals <= self.cfg.warmup_evals:
            return
        if self.best_gap is None or gap < self.best_gap:
            self.best_gap = gap
        if gap - self.best_gap > self.cfg.max_gap_increase:
            self.run += 1
            if self.run >= self.cfg.consecutive:
                out.append(self.finding(r["step"], f"val-train gap {gap:.3f} nats, best {self.best_gap:.3f} ({self.run} evals)", value=v))
        else:
            self.run = 0

    def rewind(self, keep_through_step: int) -> None:
        self.run = 0

    def state_dict(self) -> dict[str, Any]:
        return {"best_gap": self.best_gap, "run": self.run, "evals": self.evals}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.best_gap, self.run, self.evals = st["best_gap"], int(st["run"]), int(st.get("evals", 0))


_INF = math.inf


class BandEval(Evaluator):
    """A value below its band (absolute floor, or a fraction of its own recent median) for long enough.

    The relative floor is the median of recent healthy values. It moves slowly, so the reference
    window takes every ``REFRESH``-th healthy value (``window`` samples then span ``REFRESH * window``
    steps) and the floor is refreshed only then: the per-step cost is a compare.
    """

    REFRESH = 8

    def __init__(self, cfg: BandRule, name: str, field: str, unit: str = ""):
        super().__init__(cfg, name)
        self.field, self.unit = field, unit
        self.win = d.SortedWindow(cfg.window)
        self.hold = d.Persistence(cfg.min_steps, cfg.duration_seconds)
        self.floor: float | None = cfg.min_value
        self.relative = cfg.min_value is None
        self._n = 0
        self._refresh = self.REFRESH  # an instance attribute: Python 3.11 reads a class one through self slower

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        x = r[self.field]
        if x is None or not -_INF < x < _INF:  # NaN or infinite: no measurement (+inf once counted as in band)
            return
        floor = self.floor
        if floor is None or x >= floor:  # in band (no floor: a relative band still warming up)
            if self.relative:
                self._n += 1
                if floor is None or self._n % self._refresh == 0:
                    win = self.win
                    win.push(r["step"], x)  # only healthy values set the band
                    self.floor = self.cfg.min_fraction * win.median() if len(win) >= self.cfg.min_history else None
            if self.hold.count:
                self.hold.reset()
            return
        step = r["step"]
        if self.hold.update(step, r["time"], True):
            out.append(self.finding(step, f"{self.field} {fmt(x)}{self.unit} below {fmt(floor)} for "
                                    f"{self.hold.count} steps since step {self.hold.since_step}",
                                    value=x, onset_step=self.hold.since_step))

    def rewind(self, keep_through_step: int) -> None:
        self.win.rewind(keep_through_step)
        self.hold.reset()
        c = self.cfg
        self.floor = c.min_value if c.min_value is not None or len(self.win) < c.min_history else c.min_fraction * self.win.median()

    def state_dict(self) -> dict[str, Any]:
        return {"win": self.win.state_dict(), "hold": self.hold.state_dict(), "floor": self.floor, "n": self._n}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.win.load_state_dict(st["win"])
        self.hold.load_state_dict(st["hold"])
        self.floor, self._n = st["floor"], int(st["n"])


class CheckpointAgeEval(Evaluator):
    def __init__(self, cfg: CheckpointAgeRule, name: str):
        super().__init__(cfg, name)
        self.max_age = cfg.max_age_seconds

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        a = r["checkpoint_age_seconds"]
        if a is not None and a > self.max_age:
            out.append(self.finding(r["step"], f"last checkpoint {a:.0f}s old (max {self.cfg.max_age_seconds:.0f}s)", value=a))


class DataWaitEval(Evaluator):
    def __init__(self, cfg: DataWaitRule):
        super().__init__(cfg, "data_wait_high")
        self.ema = d.Ema(cfg.ema_alpha)
        self.alpha, self.max_fraction, self.min_steps = cfg.ema_alpha, cfg.max_fraction, cfg.min_steps
        self.n = 0

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        ph, st = r["phases"], r["step_seconds"]
        # a step time or a data wait that is NaN, infinite or out of range is no measurement: one
        # NaN let into the average would keep it NaN, and the rule silent, for the rest of the run
        if not ph or st is None or not 0.0 < st < _INF:
            return
        try:
            w = ph["data_wait"]  # one lookup, no method call; a missing phase is the rare case
        except KeyError:
            return
        if w is None or not 0.0 <= w < _INF:
            return
        q = w / st
        if q == _INF:  # a step time so small that the ratio overflows: no measurement either
            return
        e = self.ema
        v = e.value
        e.value = frac = q if v is None else v + self.alpha * (q - v)
        if self.n < self.min_steps:  # warm-up count stops mattering (and costing) once it is reached
            self.n += 1
            if self.n < self.min_steps:
                return
        if frac > self.max_fraction:
            out.append(self.finding(r["step"], f"data wait {frac:.0%} of step time (max {self.max_fraction:.0%})", value=frac))

    def rewind(self, keep_through_step: int) -> None:
        self.ema.value, self.n = None, 0

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema.value, "n": self.n}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.ema.value, self.n = st["ema"], int(st["n"])


_BUSY_1, _BUSY_2, _BUSY_3 = BUSY_PHASES  # spelled out in _rank_busy (this fails loudly if their number changes)


def _rank_busy(r: Fields) -> list[float] | None:
    """Each rank's own work in the step: the sum of its BUSY_PHASES (wall time minus waiting for the
    other ranks), or the older ``rank_step_seconds`` when a record has no per-rank phases."""
    rp = r["rank_phases"]
    if rp and len(rp) > 1:
        out = []
        for ph in rp:
            if "forward_backward" not in ph:
                return None  # not measured yet on some rank (the first step)
            # = sum(ph.get(p, 0.0) for p in BUSY_PHASES) without the generator: the same additions in
            # the same order from sum's start 0 (0.0 + x is what 0 + x gives a float, -0.0 included)
            out.append(0.0 + ph.get(_BUSY_1, 0.0) + ph.get(_BUSY_2, 0.0) + ph.get(_BUSY_3, 0.0))
        return out
    return r["rank_step_seconds"]


def _slow_phase(r: Fields, rank: int) -> tuple[str, float] | None:
    """(phase, seconds over the median of the other ranks) where ``rank`` loses the most time."""
    rp = r["rank_phases"]
    if not rp or len(rp) < 2 or rank >= len(rp):
        return None
    best = None
    for p in BUSY_PHASES:
        others = [ph.get(p, 0.0) for k, ph in enumerate(rp) if k != rank]
        extra = rp[rank].get(p, 0.0) - d.median_of(others)
        if best is None or extra > best[1]:
            best = (p, extra)
    return best


class StragglerEval(Evaluator):
    """One rank persistently busier than the median rank. Synchronous data parallelism makes every
    rank's wall step time equal (the others wait for the slow one in the all-reduce), so the skew is
    measured on busy time, and the finding names the rank and the phase it loses its time in."""

    def __init__(self, cfg: StragglerRule):
        super().__init__(cfg, "rank_straggler")
        self.max_skew = cfg.max_skew
        self.hold = d.Persistence(cfg.min_steps)
        self.rank: int | None = None

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        rp = r["rank_phases"]
        rs = _rank_busy(r) if rp else r["rank_step_seconds"]  # the common case without a call
        if not rs:
            return
        if not self.hold.count:
            # max(rs) <= max_skew * min(rs): the median is >= the minimum, so no rank can be over
            # the skew bar. With every time finite (t - t is NaN otherwise) a sorted copy's ends are
            # the min and max, and a sort compares floats natively where min() and max() do not;
            # with a NaN or an inf, min() and max() themselves (their NaN results depend on order)
            t = sum(rs)
            if t - t == 0.0:
                s = [*rs]  # = sorted(rs), without a call's overhead (and sorted()'s keyword call to sort)
                s.sort()
                if s[-1] <= self.max_skew * s[0]:
                    self.rank = None
                    return
            elif max(rs) <= self.max_skew * min(rs):
                self.rank = None
                return
        worst = d.straggler(rs)
        if worst is None:
            return
        rank, skew = worst
        bad = skew > self.cfg.max_skew and (self.rank is None or rank == self.rank)
        self.rank = rank if skew > self.cfg.max_skew else None
        if self.hold.update(r["step"], r["time"], bad):
            slow = _slow_phase(r, rank)
            where = f", mostly in {slow[0]} (+{slow[1]:.3g}s/step); the other ranks wait for it in the all-reduce" if slow else ""
            out.append(self.finding(r["step"], f"rank {rank} straggles: busy x{skew:.2f} of the median rank for "
                                    f"{self.hold.count} steps{where}", value=skew, rank=rank,
                                    onset_step=self.hold.since_step, phase=slow[0] if slow else None))

    def rewind(self, keep_through_step: int) -> None:
        self.hold.reset()
        self.rank = None

    def state_dict(self) -> dict[str, Any]:
        return {"hold": self.hold.state_dict(), "rank": self.rank}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.hold.load_state_dict(st["hold"])
        self.rank = st["rank"]


class RankLossEval(StragglerEval):
    def __init__(self, cfg: RankLossRule):
        Evaluator.__init__(self, cfg, "rank_loss_outlier")
        self.max_dev = cfg.max_deviation
        self.hold = d.Persistence(cfg.min_steps)
        self.rank = None

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        rl = r["rank_losses"]
        if not rl:
            return
        if not self.hold.count:
            t = sum(rl)
            if t - t == 0.0:  # NaN unless every rank loss is finite
                # min and max from one sort: a sort compares floats natively, min() and max() do not
                s = [*rl]  # = sorted(rl), see StragglerEval
                s.sort()
                lo = s[0]
                if lo > 0.0 and s[-1] - lo <= self.max_dev * lo:
                    self.rank = None  # every median-of-others lies in [lo, hi]: no deviation can exceed the bar
                    return
        worst = d.rank_outlier(rl)
        if worst is None:
            return
        rank, dev = worst
        over = dev > self.cfg.max_deviation
        bad = over and (self.rank is None or rank == self.rank)
        self.rank = rank if over else None
        if self.hold.update(r["step"], r["time"], bad):
            out.append(self.finding(r["step"], f"rank {rank} loss {fmt(rl[rank])} deviates {dev:.0%} from the other ranks "
                                    f"for {self.hold.count} steps", value=rl[rank], rank=rank, onset_step=self.hold.since_step))
