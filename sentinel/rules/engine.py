"""``RuleEngine``: a RuleSet's enabled rules, evaluated in a fixed order. Pure: no clock, no I/O."""

from __future__ import annotations

from typing import Any

from sentinel.protocol import StepRecord
from sentinel.rules.base import Evaluator, Finding
from sentinel.rules.config import RuleSet
from sentinel.rules.loss import LossEval
from sentinel.rules.slices import SliceRegressionEval
from sentinel.rules.telemetry import (
    BandEval,
    CheckpointAgeEval,
    DataWaitEval,
    GradEval,
    RankLossEval,
    StragglerEval,
    ValEval,
)


class RuleEngine:
    """All enabled rules of a RuleSet, evaluated in a fixed order. Pure: no clock, no I/O."""

    def __init__(self, ruleset: RuleSet):
        r = ruleset.rules
        self.ruleset = ruleset
        self.loss = LossEval(r)
        self._grad = GradEval(r.grad_norm_spike, r.nonfinite)
        self._evals: dict[str, Evaluator] = {
            "loss": self.loss,
            "grad_norm": self._grad,
            "val_divergence": ValEval(r.val_divergence, self.loss.det),
            "throughput_low": BandEval(r.throughput_low, "throughput_low", "tokens_per_second", " tok/s"),
            "mfu_low": BandEval(r.mfu_low, "mfu_low", "mfu"),
            "checkpoint_age": CheckpointAgeEval(r.checkpoint_age, "checkpoint_age"),
            "data_wait_high": DataWaitEval(r.data_wait_high),
            "rank_straggler": StragglerEval(r.rank_straggler),
            "rank_loss_outlier": RankLossEval(r.rank_loss_outlier),
            "slice_regression": SliceRegressionEval(r.slice_regression),
        }
        enabled = {n for n, c in r.items() if c.enabled}
        need = {
            "loss": bool(enabled & {"loss_spike", "divergence", "nonfinite", "val_divergence"}),
            "grad_norm": bool(enabled & {"grad_norm_spike", "nonfinite"}),
        }
        # bound __call__ methods: one attribute lookup less per rule per step. Two lists in the
        # same order: records of evaluation steps see every rule; the others skip the rules that
        # read only evaluation fields (they would return at once: this saves the calls)
        on = [(n, ev.__call__) for n, ev in self._evals.items() if need.get(n, n in enabled)]
        self._calls_eval = [call for _, call in on]
        self._calls = [call for n, call in on if n not in self.EVAL_ONLY]
        self.tick_ckpt, self.tick_hb = r.checkpoint_age, r.heartbeat_stale

    EVAL_ONLY = ("val_divergence", "slice_regression")  # silent unless a record carries an evaluation field

    def evaluate(self, rec: StepRecord) -> list[Finding]:
        r = rec.__dict__  # the field values: a dict read is ~3x faster than a pydantic attribute read
        out: list[Finding] = []
        if r["val_loss"] is None and r["val_ppl"] is None and not r["val_slice_loss"] and not r["probe_loss"]:
            for ev in self._calls:
                ev(r, out)
        else:
            for ev in self._calls_eval:
                ev(r, out)
        return out

    def evaluate_tick(self, now: float, heartbeat_time: float | None, last_checkpoint_time: float | None,
                      step: int | None = None) -> list[Finding]:
        """Clock-driven rules: a stale heartbeat (hang) and the age of the newest known checkpoint."""
        out: list[Finding] = []
        hb = self.tick_hb
        if hb.enabled and heartbeat_time is not None and now - heartbeat_time > hb.stale_seconds:
            age = now - heartbeat_time
            out.append(Finding("heartbeat_stale", hb.severity, hb.action, step,
                               f"no heartbeat for {age:.0f}s (max {hb.stale_seconds:.0f}s): trainer hung or dead", value=age))
        ck = self.tick_ckpt
        if ck.enabled and last_checkpoint_time is not None and now - last_checkpoint_time > ck.max_age_seconds:
            age = now - last_checkpoint_time
            out.append(Finding("checkpoint_age", ck.severity, ck.action, step,
                               f"newest checkpoint {age:.0f}s old (max {ck.max_age_seconds:.0f}s)", value=age))
        return out

    def loss_level(self) -> float | None:
        """The current robust loss baseline (median of admitted losses)."""
        return self.loss.level()

    def rewind(self, keep_through_step: int) -> None:
        """A rollback/resume restored ``keep_through_step``: forget what came after it."""
        for ev in self._evals.values():
            ev.rewind(keep_through_step)

    def reset(self) -> None:
        for ev in self._evals.values():
            ev.reset()

    def clear_episode(self) -> None:
        self.loss.clear_episode()

    def rebaseline(self) -> None:
        """A planned change of the loss level (see ``LossEval.rebaseline``)."""
        self.loss.rebaseline()

    def state_dict(self) -> dict[str, Any]:
        return {n: ev.state_dict() for n, ev in self._evals.items()}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        for n, ev in self._evals.items():
            if n in st:
                ev.load_state_dict(st[n])
