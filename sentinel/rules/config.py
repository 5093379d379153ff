"""The rules file: its schema (one section per built-in rule, plus the ``policy`` knobs), and
parsing it: ``parse_rules`` (text), ``default_rules`` (the shipped ``sentinel/default_rules.yaml``).
Reading an operator's file is I/O and lives at the edge: ``sentinel.rules_file.load_rules``. Errors are one line (``RulesError``)."""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sentinel.protocol import plain_error

DEFAULT_RULES_PATH = Path(__file__).resolve().parent.parent / "default_rules.yaml"  # sentinel/default_rules.yaml

Severity = Literal["info", "warning", "critical"]
RuleAction = Literal["rollback", "page", "checkpoint-now", "pause", "none"]


class RulesError(ValueError):
    """A rules file is unreadable or invalid. The message is one line: file, field path, problem."""


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # .inf / .nan / "1e999" are never a threshold: every float setting must be finite
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Sanity bounds on every numeric setting (on top of each field's own lower bound): a typo such as
# a 1e21 window must be an error, not a detector that allocates or never warms up.
MAX_SETTING_INT = 10**9  # steps, counts, seconds
MAX_SETTING_WINDOW = 10**6  # window / history / horizon sizes: values held in memory
MAX_SETTING_FLOAT = 1e9
MAX_YAML_DEPTH = 16  # a rules file is 3 levels deep; a deeper document is an error, not a RecursionError


def _check_bounds(model: BaseModel, path: str = "") -> None:
    for name, value in model:
        where = f"{path}.{name}" if path else name
        if isinstance(value, BaseModel):
            _check_bounds(value, where)
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            sized = any(w in name for w in ("window", "history", "horizon"))
            limit = MAX_SETTING_WINDOW if sized else MAX_SETTING_INT
            if abs(value) > limit:
                raise ValueError(f"{where} = {value} is out of range (at most {limit:,})")
        elif isinstance(value, float) and abs(value) > MAX_SETTING_FLOAT:
            raise ValueError(f"{where} = {value:g} is out of range (at most {MAX_SETTING_FLOAT:g})")


def _depth(obj, limit: int) -> int:
    """Nesting depth of parsed YAML, iteratively (stops counting past ``limit``)."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            if d > limit:
                return d
            todo.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


class RuleBase(_Strict):
    enabled: bool = True
    severity: Severity = "warning"
    # what the policy does about it: "rollback" findings feed the incident state machine,
    # "page"/"checkpoint-now"/"pause" become that action, "none" only records an event
    action: RuleAction = "none"
    cooldown_steps: int = Field(0, ge=0)  # no new event/action from this rule for this many steps
    cooldown_seconds: float = Field(0.0, ge=0)  # ... nor for this many seconds (tick rules)


class NonFiniteRule(RuleBase):
    severity: Severity = "critical"
    action: RuleAction = "rollback"
    persist_steps: int = Field(3, ge=1)  # consecutive non-finite steps before it counts as damage even if skipped


class _WindowedRule(RuleBase):
    """A rule with a baseline ``window`` and a warmup of ``min_history`` values in it."""

    @model_validator(mode="after")
    def _history_fits_the_window(self):
        # the baseline never holds more than `window` values: a warmup longer than that never ends,
        # and the rule (and the divergence tests that wait on it) would be silently off
        if self.min_history > self.window:
            raise ValueError(f"min_history = {self.min_history} is more than window = {self.window}: "
                             "the warmup would never end and the rule never judge")
        return self


class LossSpikeRule(_WindowedRule):
    severity: Severity = "warning"
    action: RuleAction = "rollback"
    window: int = Field(128, ge=8)  # admitted losses in the robust baseline
    min_history: int = Field(50, ge=3)  # no verdicts before this many losses (warmup)
    threshold: float = Field(6.0, gt=0)  # robust z (median/MAD) for a spike
    min_ratio: float = Field(1.08, ge=1)  # ... and loss / recent level (EMA) at least this
    ema_alpha: float = Field(0.05, gt=0, le=1)
    recent_window: int = Field(32, ge=0)  # noise-aware: level and local spread of the last N admitted losses (0: off)


class GradNormSpikeRule(_WindowedRule):
    severity: Severity = "warning"
    action: RuleAction = "none"  # clipping usually absorbs it; the loss rules decide on damage
    window: int = Field(128, ge=8)
    min_history: int = Field(50, ge=3)
    threshold: float = Field(8.0, gt=0)
    min_ratio: float = Field(2.0, ge=1)
    ema_alpha: float = Field(0.05, gt=0, le=1)


class DivergenceRule(RuleBase):
    """Damage that persists: the loss stays above the run's own best level (a level shift, a slow
    decay, a climb), or most recent steps are anomalous (it keeps getting worse)."""

    severity: Severity = "critical"
    action: RuleAction = "rollback"
    cooldown_steps: int = Field(50, ge=0)
    k: int = Field(12, ge=1)  # fast path: at least k ...
    n: int = Field(16, ge=1)  # ... of the last n steps anomalous
    threshold: float = Field(3.0, gt=0)  # robust z that makes a step "anomalous" here
    min_ratio: float = Field(1.02, ge=1)
    # level shift: median of the last level_window losses above the lowest such median of the last
    # level_horizon steps by more than max(min_rise x that level, level_sigmas x per-step noise sigma)
    level_window: int = Field(24, ge=4)
    level_horizon: int = Field(500, ge=10)
    level_sigmas: float = Field(3.0, gt=0)
    # ... or the median of twice that window above its own best by level_long_sigmas (smaller, slower
    # shifts: a 0.25-nat jump in 0.1-nat noise; the longer median is steadier, so the bar can be lower)
    level_long_sigmas: float = Field(2.2, gt=0)
    min_rise: float = Field(0.02, ge=0)
    # jump: the median of the last level_window losses above the median of the level_window before
    # them by jump_sigmas x the sd of that difference (from the per-step noise); 0 turns it off
    jump_sigmas: float = Field(5.0, ge=0)
    # ... crediting the window after with this fraction of the run's recent descent (the slowest of
    # three spans of the last ~100 steps): healthy, a falling loss makes the window after lower; 0: off
    jump_detrend: float = Field(0.5, ge=0, le=1)
    # climb: the last climb_window losses rise as a ramp above the clipped mean of the climb_baseline
    # losses before them by a ramp-matched z > climb_sigmas (detectors.ClimbTrend, which divides z by
    # the run's own slow-noise factor, so a run whose loss wanders raises its own bar); 0 turns it off
    climb_window: int = Field(48, ge=4)
    climb_baseline: int = Field(100, ge=4)
    climb_sigmas: float = Field(5.5, ge=0)
    # ... crediting the window with this fraction of the healthy descent, a + b * step^-0.5 fitted
    # over the climb_fit_window losses before the window (a falling loss makes the window lower, so
    # the flat baseline subtracted the descent from every climb); 0: off
    climb_descent_credit: float = Field(0.5, ge=0, le=1)
    climb_fit_window: int = Field(400, ge=4)
    # ... and the same test over a longer window, for climbs too slow for the short one (the issue's
    # 0.3 nats over 200 steps): caught ~130-160 steps in instead of not within 200; 0 turns it off
    climb_long_window: int = Field(144, ge=0)
    climb_long_baseline: int = Field(144, ge=4)
    climb_long_sigmas: float = Field(6.0, ge=0)
    # early jump: in the early descent (onsets up to early_jump_until, run steps), the line through
    # the 24 losses after an onset stands above the line through the 24 before, both read at the
    # onset, by early_jump_sigmas x the noise (detectors.DescentJump); 0 turns it off
    early_jump_sigmas: float = Field(5.0, ge=0)
    early_jump_until: int = Field(250, ge=0)

    @field_validator("climb_long_window")
    @classmethod
    def _long_window_off_or_real(cls, v: int) -> int:
        if 0 < v < 4:
            raise ValueError("must be 0 (off) or at least 4")
        return v

    @model_validator(mode="after")
    def _k_of_n(self) -> DivergenceRule:
        # "k of the last n steps" with k > n can never hold: the fast path would be silently off
        if self.k > self.n:
            raise ValueError(f"k = {self.k} is more than n = {self.n} (at least k of the last n steps must be anomalous)")
        return self


class ValDivergenceRule(RuleBase):
    severity: Severity = "warning"
    action: RuleAction = "page"
    cooldown_steps: int = Field(1000, ge=0)
    max_gap_increase: float = Field(0.1, gt=0)  # nats: (val - train) gap above its best so far
    consecutive: int = Field(2, ge=1)  # evaluations in a row (the gap is taken against the loss rule's spike-free level)
    warmup_evals: int = Field(2, ge=0)  # evaluations ignored at first: the train level lags a fast early descent


class BandRule(_WindowedRule):
    """Below a band for a duration: an absolute floor, or a fraction of the run's own median."""

    severity: Severity = "warning"
    action: RuleAction = "page"
    cooldown_seconds: float = Field(1800.0, ge=0)
    min_value: float | None = Field(None, ge=0)  # absolute target; None = relative to the run's median
    min_fraction: float = Field(0.7, gt=0, le=1)  # of the median of the last `window` steps
    window: int = Field(200, ge=8)
    min_history: int = Field(20, ge=1)
    min_steps: int = Field(10, ge=1)
    duration_seconds: float = Field(300.0, ge=0)


class MfuBandRule(BandRule):
    """``BandRule`` for MFU: informational by default (a low MFU costs money, it is no outage), so a
    partial ``mfu_low:`` section keeps the shipped severity."""

    severity: Severity = "info"


class CheckpointAgeRule(RuleBase):
    severity: Severity = "warning"
    action: RuleAction = "checkpoint-now"
    cooldown_seconds: float = Field(900.0, ge=0)
    max_age_seconds: float = Field(7200.0, gt=0)


class HeartbeatRule(RuleBase):
    severity: Severity = "critical"
    action: RuleAction = "page"
    cooldown_seconds: float = Field(900.0, ge=0)
    stale_seconds: float = Field(300.0, gt=0)


class DataWaitRule(RuleBase):
    severity: Severity = "warning"
    action: RuleAction = "page"
    cooldown_seconds: float = Field(1800.0, ge=0)
    max_fraction: float = Field(0.2, gt=0, le=1)  # data_wait / step_seconds, smoothed
    ema_alpha: float = Field(0.1, gt=0, le=1)
    min_steps: int = Field(20, ge=1)


class StragglerRule(RuleBase):
    severity: Severity = "warning"
    action: RuleAction = "page"
    cooldown_seconds: float = Field(1800.0, ge=0)
    max_skew: float = Field(1.3, gt=1)  # slowest rank / median rank busy time (step time minus all-reduce wait)
    min_steps: int = Field(10, ge=1)


class RankLossRule(RuleBase):
    severity: Severity = "warning"
    action: RuleAction = "page"
    cooldown_steps: int = Field(500, ge=0)
    max_deviation: float = Field(0.25, gt=0)  # |rank loss - median of others| / median of others
    min_steps: int = Field(3, ge=1)


SliceField = Literal["val_slice_loss", "probe_loss"]


class SliceRegressionRule(RuleBase):
    """One slice keeps regressing while the others improve (seed 003 §5.4 "slice eval": a mixture,
    tokenizer or contamination problem; first move "localize to bucket first"). Aggregate val PPL
    hides it. A page, never a rollback: the weights are not damaged, the data mixture is in question,
    and only a human can decide what to do with a domain."""

    severity: Severity = "warning"
    action: Literal["page", "none"] = "page"
    fields: list[SliceField] = Field(default_factory=lambda: ["val_slice_loss", "probe_loss"], min_length=1)
    consecutive: int = Field(3, ge=2)  # evaluations in a row; 1 would page on one noisy eval
    min_rise: float = Field(0.1, gt=0)  # nats (~10% PPL) above its best level of its last HISTORY evaluations ...
    noise_factor: float = Field(3.0, ge=0)  # ... and above this many sigmas of its eval-to-eval noise
    noise_window: int = Field(48, ge=3)  # evaluations in that noise estimate
    drift_lag: int = Field(6, ge=2)  # slow drift: its noise at this lag over lag 1, median of the slices ...
    drift_power: float = Field(3.0, ge=0)  # ... raises the noise bar by (that ratio) ** this (0: off)
    warmup_evals: int = Field(2, ge=0)  # evaluations of a slice before it can count as regressing

    @field_validator("fields")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("fields must not repeat")
        return v


class Rules(_Strict):
    nonfinite: NonFiniteRule = NonFiniteRule()
    loss_spike: LossSpikeRule = LossSpikeRule()
    grad_norm_spike: GradNormSpikeRule = GradNormSpikeRule()
    divergence: DivergenceRule = DivergenceRule()
    val_divergence: ValDivergenceRule = ValDivergenceRule()
    throughput_low: BandRule = BandRule()
    mfu_low: MfuBandRule = MfuBandRule()
    checkpoint_age: CheckpointAgeRule = CheckpointAgeRule()
    heartbeat_stale: HeartbeatRule = HeartbeatRule()
    data_wait_high: DataWaitRule = DataWaitRule()
    rank_straggler: StragglerRule = StragglerRule()
    rank_loss_outlier: RankLossRule = RankLossRule()
    slice_regression: SliceRegressionRule = SliceRegressionRule()

    def items(self) -> list[tuple[str, RuleBase]]:
        return [(name, getattr(self, name)) for name in type(self).model_fields]


class PolicyConfig(_Strict):
    rollback_margin_steps: int = Field(100, ge=0)  # M: roll back to a checkpoint <= onset - M (PaLM: ~100)
    skip_margin_steps: int = Field(10, ge=0)  # skip samples of steps [onset - margin, detection] (+ steps trained before the rollback took effect)
    max_rollbacks_per_hour: int = Field(2, ge=0)  # R real rollbacks per hour; one more escalates ...
    rollback_window_steps: int = Field(1000, ge=1)  # ... and per this many trained steps (dry runs never count)
    verify_window_steps: int = Field(300, ge=1)  # W: steps after the restore for the loss to come back
    verify_tolerance: float = Field(0.05, ge=0)  # back means median of recent loss <= baseline * (1 + tol)
    verify_recent_steps: int = Field(5, ge=1)
    suspect_clear_steps: int = Field(30, ge=1)  # quiet steps after which a spike episode closes as recovered
    episode_gap_steps: int = Field(20, ge=1)  # an anomaly this long after the previous one starts a new episode
    sample_history_steps: int = Field(2048, ge=1)  # sample ids kept for skip lists
    page_on_increasing_spikes: bool = True  # ever more frequent (recovered) spikes page a human
    require_approval: bool = False  # pause, page, and wait for `sentinel approve` before rolling back
    dry_run: bool = False


class RuleSet(_Strict):
    version: Literal[1] = 1
    policy: PolicyConfig = PolicyConfig()
    rules: Rules = Rules()

    @model_validator(mode="after")
    def _bounded(self) -> RuleSet:
        _check_bounds(self)
        return self


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def _one_line(source: str, e: ValidationError) -> str:
    errs = e.errors()
    err = errs[0]
    loc = ".".join(str(p) for p in err["loc"])
    more = f" ({len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})" if len(errs) > 1 else ""
    msg = plain_error(err)
    if err.get("type") == "extra_forbidden" and len(err["loc"]) == 1 and err["loc"][0] in Rules.model_fields:
        msg += " at the top level: rules go under `rules:`"
    return f"{source}: {loc}: {msg}{more}" if loc else f"{source}: {msg}{more}"


_YAML_CACHE_CHARS = 65536  # rules texts up to this size are parsed once per process
MAX_RULES_BYTES = 1 << 20  # the shipped defaults are ~10 KB; a rules file of megabytes is not one


class _RulesLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (no Python objects from tags) that also refuses what a rules file never
    needs and a hostile one abuses:

    - aliases (``*name``, and so ``<<: *name`` merges): nine levels of nine aliases each are 396
      bytes that stand for 9**9 values, and every walk over them (the depth check, the schema)
      never ends. A rules file is small enough to write out.
    - a key twice in one mapping: YAML lets the last one win silently, so the first setting an
      operator reads in the file is not the one in force."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"alias *{event.anchor} (YAML aliases are not allowed in "
                                              "a rules file: write the value out)", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    dup = key in seen
                    seen.add(key)
                except TypeError:  # unhashable: the base class says so, with its mark
                    continue
                if dup:
                    raise yaml.constructor.ConstructorError(None, None, f"duplicate key {str(key)[:60]!r} (each setting "
                                                            "may appear once)", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        return self._no_sexagesimal(node) or super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        return self._no_sexagesimal(node) or super().construct_yaml_float(node)

    def _no_sexagesimal(self, node) -> None:
        """YAML 1.1 reads ``1:30`` as 90 (base 60, for times): in a rules file it is a typo."""
        if ":" in str(node.value):
            raise yaml.constructor.ConstructorError(None, None, f"{str(node.value)[:40]!r} is read as a base-60 number by "
                                                    "YAML 1.1: write the number you mean", node.start_mark)
        return None


_RulesLoader.add_constructor("tag:yaml.org,2002:int", _RulesLoader.construct_yaml_int)
_RulesLoader.add_constructor("tag:yaml.org,2002:float", _RulesLoader.construct_yaml_float)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_RulesLoader)  # noqa: S506 (a SafeLoader subclass)


@functools.lru_cache(maxsize=8)
def _safe_load_cached(text: str) -> Any:
    return _yaml_load(text)


def _load_yaml(text: str) -> Any:
    """The rules loader (``_RulesLoader``), remembered for small texts: every engine built from the
    same rules (the defaults, once per run, per backtest, per drill) parsed them again, 7 ms of
    pure-Python YAML each time. A deep copy per call, so no caller can change what the next one gets."""
    if len(text) > _YAML_CACHE_CHARS:
        return _yaml_load(text)
    return copy.deepcopy(_safe_load_cached(text))


def parse_rules(text: str, source: str = "<rules>", allow_empty: bool = True) -> RuleSet:
    """Parse rules YAML text; ``source`` names it in error messages. An empty document means "all
    defaults" unless ``allow_empty`` is False (a rules *file* that is empty is almost always a
    mistake: a truncated copy, a wrong path in a ConfigMap)."""
    try:
        data = _load_yaml(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise RulesError(f"{source}: {where}invalid YAML: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise RulesError(f"{source}: invalid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise RulesError(f"{source}: invalid rules: nested more than {MAX_YAML_DEPTH} levels deep") from None
    except ValueError as e:  # an integer of more than 4,300 digits (Python refuses to convert it), a bad timestamp
        raise RulesError(f"{source}: invalid YAML: a value no setting can hold ({' '.join(str(e).split(': ')[0].split())[:120]})") from None
    except MemoryError:
        raise RulesError(f"{source}: invalid YAML: too large to read") from None
    if _depth(data, MAX_YAML_DEPTH) > MAX_YAML_DEPTH:
        raise RulesError(f"{source}: invalid rules: nested more than {MAX_YAML_DEPTH} levels deep")
    if data is None or data == {}:
        if not allow_empty:
            raise RulesError(f"{source}: the rules file is empty (no rules, no policy); "
                             "start from sentinel/default_rules.yaml")
        data = {}
    if not isinstance(data, dict):
        raise RulesError(f"{source}: <root>: expected a mapping of settings, got {type(data).__name__}")
    if data and not set(data) & set(RuleSet.model_fields):
        # a wrong file (a credentials file, another tool's config): its keys are not echoed, they may be secrets
        raise RulesError(f"{source}: not a rules file: none of {', '.join(sorted(RuleSet.model_fields))} at its top "
                         f"({len(data)} other key(s)); start from sentinel/default_rules.yaml")
    try:
        return RuleSet.model_validate(data)
    except ValidationError as e:
        raise RulesError(_one_line(source, e)) from None


def rules_yaml(ruleset: RuleSet) -> str:
    """``ruleset`` as a rules file, every setting written out: ``parse_rules`` reads it back equal."""
    return yaml.safe_dump(ruleset.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def default_rules() -> RuleSet:
    """The defaults the daemon uses: ``sentinel/default_rules.yaml`` (shipped with the package;
    a file an operator names is read at the edge, by ``sentinel.rules_file.load_rules``)."""
    return parse_rules(DEFAULT_RULES_PATH.read_text(encoding="utf-8"), str(DEFAULT_RULES_PATH), allow_empty=False)


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------
