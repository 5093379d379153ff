"""The loss rules: spike, sustained divergence (level, jump, climb and early-jump tests, k of n) and non-finite
loss, over one robust baseline."""

from __future__ import annotations

import math
from typing import Any

from sentinel import detectors as d
from sentinel.rules.base import Evaluator, Fields, Finding, fmt
from sentinel.rules.config import Rules


class LossEval(Evaluator):
    """Loss spike, sustained divergence and non-finite loss share one robust baseline."""

    def __init__(self, rules: Rules):
        self.spike_cfg, self.div_cfg, self.nf_cfg = rules.loss_spike, rules.divergence, rules.nonfinite
        s, v = self.spike_cfg, self.div_cfg
        self.det = d.SpikeDetector(
            window=s.window, min_history=s.min_history, z_spike=s.threshold, ratio_spike=s.min_ratio,
            z_elevated=v.threshold, ratio_elevated=v.min_ratio, ema_alpha=s.ema_alpha, recent=s.recent_window,
        )
        self.kofn = d.KOfN(min(v.k, v.n), v.n)
        # warmup: the spike baseline's own plus one window, so the jump test has a clean window before
        # a jump at steps 60-75 (at two windows that one held the jump already; docs/benchmarks.md)
        self.shift = d.LevelShift(window=v.level_window, horizon=v.level_horizon, sigmas=v.level_sigmas,
                                  min_rise=v.min_rise, warmup=s.min_history + v.level_window, jump_sigmas=v.jump_sigmas,
                                  jump_detrend=v.jump_detrend)
        self.shift_long = d.LevelShift(window=2 * v.level_window, horizon=v.level_horizon, sigmas=v.level_long_sigmas,
                                       min_rise=v.min_rise, warmup=s.min_history + 4 * v.level_window)
        # warmup: the spike baseline's own, plus the climb's window and baseline (the early descent)
        self.climb = d.ClimbTrend(window=v.climb_window, baseline=v.climb_baseline, sigmas=v.climb_sigmas or math.inf,
                                  warmup=s.min_history + v.climb_window + v.climb_baseline,
                                  credit=v.climb_descent_credit, fit=v.climb_fit_window)
        self._det_update, self._shift_feed, self._long_feed = self.det.update, self.shift.feed, self.shift_long.feed
        self._climb_on = v.climb_sigmas > 0
        self.climb_long: d.ClimbTrend | None = None
        if v.climb_long_window >= 4 and v.climb_long_sigmas > 0:
            self.climb_long = d.ClimbTrend(window=v.climb_long_window, baseline=v.climb_long_baseline, sigmas=v.climb_long_sigmas,
                                           warmup=s.min_history + v.climb_long_window + v.climb_long_baseline)
        self.early: d.DescentJump | None = None
        self._early_last = -1  # the last step the early test reads (an int compare per step after it)
        if v.early_jump_sigmas > 0 and v.early_jump_until > 0:
            self.early = d.DescentJump(sigmas=v.early_jump_sigmas, until=v.early_jump_until)
            self._early_last = self.early.until + self.early.post
        # The level and climb tests judge only every few admitted losses (their strides); in
        # between, the losses wait here and are fed in one call per test at the next step any of
        # them judges (the same verdicts, one call instead of one per step per test).
        self._batched: list[d.LevelShift | d.ClimbTrend] = [self.shift, self.shift_long]
        self._batched += [t for t in (self.climb if self._climb_on else None, self.climb_long) if t is not None]
        self._pend_st: list[int] = []
        self._pend_x: list[float] = []
        self._pend_spk: list[int] = []  # the indices in _pend_x of losses the spike test flagged (the climb tests hold them)
        self._due = self._next_due()
        self.noise = 0.0  # robust per-step sigma of the admitted losses, refreshed every NOISE_EVERY steps
        self._noise_n = 0
        self._noise_every = self.NOISE_EVERY  # read per step: an instance attribute is the faster read in 3.11
        self.nf_run = 0  # consecutive non-finite losses
        self.spike_on = s.enabled
        self.div_on = v.enabled
        self.nf_on = self.nf_cfg.enabled

    FLOOR = 0.8  # x the per-step noise from first differences, which overstates the level's spread
    CAP = 1.5  # x the same noise: the most the spike test's spread may be (a MAD counts a descent as spread)
    SLOW_ALPHA = 1 / 16  # per refresh: the spike floor's average spans ~256 steps
    NOISE_EVERY = 16  # a refresh costs a sort of 64 differences; every 64 steps lost 2/144 timely rollbacks
    # The k-of-n count reads per-step anomalies. On a loss logged smoothed (an EMA, a running mean)
    # one spike is smeared over the next ~10-50 steps, each "anomalous" at per-step noise, and the
    # count fires on a recovered spike. Where the level wanders this much more than its per-step
    # noise says (``LevelShift.measure_wander``: 1-1.4 on the raw public curves, 2-30 smoothed) the count
    # is left to the level and jump tests, which judge at the wander.
    KOFN_WANDER_MAX = 2.0

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        step, x = r["step"], r["loss"]
        code = self._det_update(step, x)
        if code != 3:  # 3: NONFINITE
            self._noise_n += 1
            if self._noise_n >= self._noise_every and len(self.det.window) >= 8:
                self._noise_n = 0
                self.noise = self.det.noise()
                # the spike test's noise floor: a slow average of the per-step noise (~256 steps)
                slow, now = self.det.noise_floor, self.FLOOR * self.noise
                self.det.noise_floor = now if slow <= 0 else slow + self.SLOW_ALPHA * (now - slow)
                self.det.noise_cap = self.CAP * self.noise
            self._pend_st.append(step)
            px = self._pend_x
            px.append(x)
            if code == 2:  # SPIKE
                self._pend_spk.append(len(px) - 1)
            self._due -= 1
            if self._due:
                short = long_ = climb = slow = False
            else:
                short, long_, climb, slow = self._flush()
            early = step <= self._early_last and self.early.update(step, x, self.noise, code == 2)
            if (short or long_) and self.div_on:
                c, sh = self.div_cfg, (self.shift if short else self.shift_long)
                if sh.kind == "level":
                    ref = "the run's best"
                elif sh.credit:
                    ref = f"the median of the {sh.window} before less {fmt(sh.credit)} of expected descent,"
                else:
                    ref = f"the median of the {sh.window} before,"
                out.append(Finding("divergence", c.severity, c.action, step,
                                   f"loss level {fmt(sh.best + sh.excess)} (median of {sh.window}) is {fmt(sh.excess)} above "
                                   f"{ref} {fmt(sh.best)} (bar {fmt(sh.bar)})",
                                   value=x, onset_step=sh.onset(step), anomaly=True))
            elif (climb or slow) and self.div_on:
                c, cl = self.div_cfg, (self.climb if climb else self.climb_long)
                out.append(Finding("divergence", c.severity, c.action, step,
                                   f"loss climbing since step {cl.onset()}: up {fmt(cl.rise)} over the last {cl.window} steps, "
                                   f"ramp z={cl.z:.1f} against the level of the {cl.baseline} before (bar {cl.sigmas:g})",
                                   value=x, onset_step=cl.onset(), anomaly=True))
            elif early and self.div_on:
                c, ej = self.div_cfg, self.early
                out.append(Finding("divergence", c.severity, c.action, step,
                                   f"loss jumped {fmt(ej.rise)} at step {ej.onset()} against its early descent "
                                   f"(the line through the {ej.post} losses from it above the line through the "
                                   f"{ej.pre} before, both read there; z={ej.z:.1f}, bar {ej.sigmas:g})",
                                   value=x, onset_step=ej.onset(), anomaly=True))
        if code <= 0:
            self.nf_run = 0
            if self.kofn._flagged:
                self.kofn.update(step, False)
            return
        det = self.det
        if code == d.NONFINITE:
            self.nf_run += 1
            if self.nf_on:
                c = self.nf_cfg
                out.append(Finding("nonfinite", c.severity, c.action, step, f"loss is {x} ({self.nf_run} in a row)",
                                   value=x, onset_step=step - self.nf_run + 1, anomaly=True))
        else:
            self.nf_run = 0
            if code == d.SPIKE and self.spike_on:
                c = self.spike_cfg
                out.append(Finding("loss_spike", c.severity, c.action, step,
                                   f"loss {fmt(x)} vs baseline {fmt(det.baseline)}: z={det.z:.1f}, x{det.ratio:.2f} of recent level",
                                   value=x, onset_step=step, anomaly=True))
        if self.kofn.update(step, True) and self.div_on and not (out and out[-1].rule == "divergence" and out[-1].step == step) \
                and self.shift.measure_wander(self.noise) < self.KOFN_WANDER_MAX:
            c, kn = self.div_cfg, self.kofn
            out.append(Finding("divergence", c.severity, c.action, step,
                               f"{len(kn._flagged)} of the last {kn.n} steps anomalous (loss {fmt(x)}, baseline {fmt(det.baseline)})",
                               value=x, onset_step=kn.onset(), anomaly=True))

    def _flush(self) -> tuple[bool, bool, bool, bool]:
        """Feed the waiting losses to the level and climb tests: (short level, long level, climb,
        long climb)."""
        st, xs, spk, noise = self._pend_st, self._pend_x, self._pend_spk, self.noise
        short, long_ = self._shift_feed(st, xs, noise), self._long_feed(st, xs, noise)
        climb = self._climb_on and self.climb.feed(st, xs, spk, noise)
        slow = self.climb_long is not None and self.climb_long.feed(st, xs, spk, noise)
        self._pend_st, self._pend_x, self._pend_spk = [], [], []
        self._due = self._next_due()
        return short, long_, climb, slow

    def _next_due(self) -> int:
        """Losses until the next one at which any batched test judges (a multiple of its stride)."""
        return min(t.stride - t.n % t.stride for t in self._batched)

    def _settle(self) -> None:
        """Before the tests' state is read or changed between verdict steps: feed what waits (no
        verdict can be due: the next one is at the next multiple of the stride)."""
        if self._pend_x:
            self._flush()

    def level(self) -> float | None:
        return self.det.level()

    def rewind(self, keep_through_step: int) -> None:
        self._settle()
        self.det.rewind(keep_through_step)
        self.kofn.clear()
        self.shift.rewind(keep_through_step)
        self.shift_long.rewind(keep_through_step)
        self.climb.rewind(keep_through_step)
        if self.climb_long is not None:
            self.climb_long.rewind(keep_through_step)
        if self.early is not None:
            self.early.rewind(keep_through_step)
        self.nf_run = 0

    def reset(self) -> None:
        self._pend_st, self._pend_x, self._pend_spk = [], [], []
        self.det.reset()
        self.kofn.clear()
        self.shift.reset()
        self.shift_long.reset()
        self.climb.reset()
        if self.climb_long is not None:
            self.climb_long.reset()
        if self.early is not None:
            self.early.reset()
        self.noise, self._noise_n = 0.0, 0
        self.det.noise_floor = self.det.noise_cap = 0.0
        self.nf_run = 0
        self._due = self._next_due()

    def clear_episode(self) -> None:
        """After an incident has been opened, start counting divergence afresh."""
        self.kofn.clear()

    def rebaseline(self) -> None:
        """A planned change of the loss level (new data mixture, new sequence length): the spike,
        level, climb and early-jump baselines start again from the next loss, so the new level is not judged
        against the old one. The per-step noise and the climb test's calibration are kept (the
        noise of a run does not change with its level)."""
        self._settle()
        self.det.reset()
        self.kofn.clear()
        self.shift.reset()
        self.shift_long.reset()
        self.climb.restart()
        if self.climb_long is not None:
            self.climb_long.restart()
        if self.early is not None:
            self.early.reset()
        self._due = self._next_due()
        self.nf_run = 0

    def state_dict(self) -> dict[str, Any]:
        self._settle()
        return {"det": self.det.state_dict(), "kofn": self.kofn.state_dict(), "shift": self.shift.state_dict(),
                "shift_long": self.shift_long.state_dict(),
                "climb": self.climb.state_dict(),
                **({"climb_long": self.climb_long.state_dict()} if self.climb_long is not None else {}),
                **({"early": self.early.state_dict()} if self.early is not None else {}),
                "noise": self.noise, "noise_n": self._noise_n, "noise_floor": self.det.noise_floor, "nf_run": self.nf_run}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.det.load_state_dict(st["det"])
        self.kofn.load_state_dict(st["kofn"])
        if "shift" in st:  # state saved before the level-shift detector existed starts it afresh
            self.shift.load_state_dict(st["shift"])
        if "shift_long" in st:
            self.shift_long.load_state_dict(st["shift_long"])
        if "climb" in st:
            self.climb.load_state_dict(st["climb"])
        if self.climb_long is not None and "climb_long" in st:  # state saved before the long test starts it afresh
            self.climb_long.load_state_dict(st["climb_long"])
        if self.early is not None and "early" in st:  # state saved before the early test starts it afresh
            self.early.load_state_dict(st["early"])
        self.noise, self._noise_n = float(st.get("noise", 0.0)), int(st.get("noise_n", 0))
        self.det.noise_floor = float(st.get("noise_floor", 0.0))
        self.det.noise_cap = self.CAP * self.noise
        self.nf_run = int(st["nf_run"])
        self._pend_st, self._pend_x, self._pend_spk = [], [], []
        self._due = self._next_due()
