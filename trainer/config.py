"""Validated training configuration: presets < YAML file < command-line flags.

The resolved config is written to ``RUN_DIR/config.yaml``. Restarting with the same run dir and
no ``--config``/``--preset`` reuses it, so ``python -m trainer --run-dir X`` is a plain resume.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sentinel.contract.yamlio import YamlError, read_yaml
from sentinel.protocol import MAX_SAMPLE_ID, MAX_STATE_BYTES

MAX_SEED = 2**62  # seed + 1000003 * rank must stay an int64 for torch.manual_seed
MAX_LR = 10.0  # AdamW's peak LR: far above any recipe (3e-3 .. 6e-4); 1e300 is a typo, not a schedule


class ConfigError(ValueError):
    """One-line configuration error (the CLI prints it without a traceback)."""


class _Strict(BaseModel):
    # allow_inf_nan=False: every float field refuses inf and NaN (JSON/YAML ``.inf``, ``1e999``, ``--lr inf``).
    # A bound like ``gt=0`` alone lets inf through (and NaN only because every comparison with it fails).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# the head sizes trainer/attention_triton.py has tiles for (tl.dot needs 16 at least; 128 fills the registers)
TRITON_HEAD_SIZES = (16, 32, 64, 128)


class ModelConfig(_Strict):
    # upper bounds far past any model one process builds: a typo (1e11 layers) is a one-line error,
    # not an allocator traceback or the kernel's OOM killer
    n_layer: int = Field(2, ge=1, le=1024)
    n_head: int = Field(2, ge=1, le=1024)
    d_model: int = Field(64, ge=8, le=65536)
    seq_len: int = Field(64, ge=4)
    vocab_size: int | None = Field(None, ge=2, le=1 << 24, description="None: taken from the dataset")
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = False
    attention: Literal["sdpa", "triton"] = Field(
        "sdpa", description="sdpa: torch's kernels (with deterministic: true on CUDA, the math one); triton: our fused "
        "kernels, whose backward repeats bit for bit (trainer/attention_triton.py), on CUDA; needs the triton package "
        "and dropout 0; elsewhere sdpa")

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.attention == "triton":
            hd = self.d_model // self.n_head
            if self.dropout:
                raise ValueError("model.attention: triton has no attention dropout; set model.dropout to 0")
            if hd not in TRITON_HEAD_SIZES:
                raise ValueError(f"model.attention: triton takes a head size (d_model / n_head) that is a power of two "
                                 f"from 16 to 128, not {hd}")
        return self


class OptimConfig(_Strict):
    lr: float = Field(3e-3, gt=0, le=MAX_LR, description="peak learning rate (AdamW); above MAX_LR it is a typo, not a recipe")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine floor, as a fraction of lr")
    warmup_steps: int = Field(10, ge=0)
    decay_steps: int | None = Field(None, ge=1, description="None: max_steps")
    weight_decay: float = Field(0.1, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="global-norm clip; 0 disables")


class DataConfig(_Strict):
    dir: str | None = Field(None, description="prepared dataset dir; None: the default Shakespeare corpus")
    micro_batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    skip: list[tuple[int, int]] = Field(default_factory=list, description="initial skip list [lo, hi)")
    mixture: dict[str, float] | None = Field(
        None, description="mixture datasets: sampling weight per source name (None: the weights it was prepared with)"
    )
    seq_len_schedule: list[tuple[int, int]] = Field(
        default_factory=list, description="[[FROM_STEP, SEQ_LEN], ...]: train at SEQ_LEN once FROM_STEP steps are done "
        "(before the first entry: model.seq_len); see trainer/seqlen.py",
    )

    @field_validator("skip")
    @classmethod
    def _skip_ranges(cls, v):
        # what `sentinel skip-list` and `sentinel rollback --skip` refuse too: a reversed range is a typo
        for lo, hi in v:
            if not 0 <= lo < hi <= MAX_SAMPLE_ID:
                raise ValueError(f"range [{lo}, {hi}]: need 0 <= LO < HI <= {MAX_SAMPLE_ID} (HI excluded)")
        return v

    @field_validator("seq_len_schedule")
    @classmethod
    def _schedule_ordered(cls, v):
        steps = [s for s, _ in v]
        if any(s < 0 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"FROM_STEP values must be >= 0 and strictly increasing (got {steps})")
        if any(n < 1 for _, n in v):
            raise ValueError(f"SEQ_LEN values must be >= 1 (got {[n for _, n in v]})")
        return v


class EvalConfig(_Strict):
    every: int = Field(50, ge=0, description="validate every N steps; 0 disables")
    batches: int = Field(4, ge=1, description="val batches per slice (a plain dataset is one slice)")
    probe_samples: int = Field(4, ge=1, description="fixed probe windows per slice, evaluated with every validation")


class CheckpointConfig(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        """``verify_whole_max_bytes`` (2026-11-29 to 11-30) chose between two ways of verifying a load on
        several ranks; since every load hashes in shares with one vote, it has nothing to choose. A run
        directory saved with it (every ``config.yaml`` of those days) still resumes: it is dropped."""
        if isinstance(data, dict) and "verify_whole_max_bytes" in data:
            data = {k: v for k, v in data.items() if k != "verify_whole_max_bytes"}
        return data

    every: int = Field(50, ge=0, description="save every K steps; 0 disables periodic saves")
    keep_last: int = Field(3, ge=1)
    keep_every: int = Field(0, ge=0, description="also keep every K-th step forever; 0 disables")
    initial: bool = Field(
        True, description="on a fresh start, also save the initial state (step 0) before the first step, so that "
        "damage in the first interval can be rolled back (a restart that skips its data) instead of only paged; "
        "retention treats it like any other checkpoint. Saved synchronously even with async_save, so that a run "
        "killed in its first steps resumes from it",
    )
    async_save: bool = False
    async_priority: Literal["idle", "normal"] = Field(
        "idle", description="the CPU priority of an async save's thread (Linux). idle: SCHED_IDLE, it runs on what "
        "training leaves free, so the next collective does not wait for a rank it displaced (docs/benchmarks/"
        "checkpoint-cost.md); a save still finishes, at the latest when the loop waits for it at the next save or at "
        "exit. normal: for nodes whose training keeps every core busy (CPU training), where an idle save would "
        "finish only then",
    )
    async_writer: Literal["process", "thread"] = Field(
        "process", description="who serialises, hashes and writes an async save's files (not FSDP2's, which DCP "
        "writes). process: this rank's writer process, over a copy of the state in shared memory, so that none of "
        "that work holds the training process's GIL (the step after a save: 6.1 ms against 9.5 with a thread, "
        "tiny on CPU; docs/benchmarks/checkpoint-cost.md); it starts when training does (importing torch while the "
        "trainer loads its checkpoint), at async_priority, and dies with it. thread: the save's own thread, in the "
        "training process. A writer process that cannot start or dies leaves thread for the rest of the run (said "
        "in one line)",
    )
    max_age_steps: int = Field(
        0, ge=0, description="when saves fail, stop (non-zero exit) once the newest valid checkpoint is more than N "
        "steps old; 0: the save interval (one failed save is retried at the next interval)",
    )
    max_age_seconds: float = Field(
        0.0, ge=0, allow_inf_nan=False, description="when saves fail, also stop once the newest valid checkpoint is "
        "older than this; 0: no time bound",
    )


class GuardConfig(_Strict):
    enabled: bool = True
    window: int = Field(64, ge=8, le=1_000_000)
    min_history: int = Field(16, ge=2)
    loss_z: float = Field(8.0, gt=0, description="robust z (median/MAD) above which the update is skipped")
    grad_z: float = Field(12.0, gt=0)
    max_consecutive_skips: int = Field(
        8, ge=1, description="after this many outlier skips in a row the new level is accepted (non-finite is always skipped)"
    )


class TelemetryConfig(_Strict):
    enabled: bool = True
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(0, ge=0, le=65535, description="base port (+ local rank); 0 picks free ports")
    redis_url: str | None = Field(None, description="control bus; 'embedded' starts one in the run dir; None: off")
    param_digest_every: int = Field(1, ge=0)
    log_every: int = Field(10, ge=1)
    peak_flops: float | None = Field(None, gt=0, description="override the device peak FLOP/s for MFU")

    @field_validator("redis_url")
    @classmethod
    def _url_ok(cls, v):
        # checked here, before the run dir is created, with the bus's own rules (sentinel.bus.connect):
        # a typo must not leave a run dir with a lock and an empty step log behind
        if v is None or v == "embedded":
            return v
        from sentinel.bus import url_problem  # the bus's own rules, and its redaction: no password in the error

        bad = url_problem(v)
        if bad:
            raise ValueError(bad)
        return v


# sample-id ranges are half-open LO:HI everywhere (--inject-fault, --skip, skip-list, directives)
FAULT_RE = re.compile(r"^(garbage|lr|nan)@(\d+)(?::(\d+))?(?::([0-9.eE+-]+))?$")
# the old inclusive LO-HI form: still accepted, with a warning that spells out its half-open equivalent
LEGACY_FAULT_RE = re.compile(r"^(garbage|lr|nan)@(\d+)-(\d+)(?::([0-9.eE+-]+))?$")
FAULT_SYNTAX = ("KIND@ID or KIND@LO:HI (sample ids, HI exclusive); lr takes a factor: lr@ID:FACTOR or "
                "lr@LO:HI:FACTOR; KIND one of garbage, lr, nan; or slow@RANK:SECONDS")
# the one drill keyed to a rank, not to samples: that rank sleeps SECONDS in every step (a straggler)
SLOW_RE = re.compile(r"^slow@(\d+):([0-9.eE+-]+)$")


class Fault(_Strict):
    """A drill keyed to data positions: skipping those samples removes the fault, like real bad data.

    ``slow`` is keyed to a rank instead: ``lo`` is the rank, ``factor`` the seconds it sleeps per step."""

    kind: Literal["garbage", "lr", "nan", "slow"]
    lo: int = Field(ge=0, le=MAX_SAMPLE_ID)
    hi: int = Field(le=MAX_SAMPLE_ID, description="exclusive")
    factor: float = 1.0

    @classmethod
    def parse(cls, text: str) -> Fault:
        """``KIND@ID``, ``KIND@LO:HI`` (half-open, like ``--skip``), ``lr@ID:F`` or ``lr@LO:HI:F``.

        ``lr@A:B`` is an id and a factor (the long-standing form), never a range: an lr range always
        carries its factor. The deprecated ``KIND@LO-HI`` means LO..HI *inclusive* and warns."""
        t = text.strip()
        slow = SLOW_RE.match(t)
        if slow:
            seconds = float(slow.group(2))
            if not 0 < seconds <= 3600:
                raise ConfigError(f"--inject-fault {text!r}: SECONDS must be in (0, 3600]")
            return cls(kind="slow", lo=int(slow.group(1)), hi=int(slow.group(1)) + 1, factor=seconds)
        legacy = LEGACY_FAULT_RE.match(t)
        if legacy:
            kind, lo, hi, factor = legacy.groups()
            lo_i, hi_i = int(lo), int(hi) + 1
            fac = f":{factor}" if factor else ""
            warnings.warn(f"--inject-fault {text!r}: LO-HI is deprecated and inclusive (ids {lo_i}..{hi_i - 1}); "
                          f"write {kind}@{lo_i}:{hi_i}{fac} (half-open LO:HI, like --skip)", FutureWarning, stacklevel=2)
        else:
            m = FAULT_RE.match(t)
            if not m:
                raise ConfigError(f"--inject-fault {text!r}: expected {FAULT_SYNTAX}")
            kind, lo, second, third = m.groups()
            lo_i = int(lo)
            if kind == "lr" and second is not None and third is None:
                hi_i, factor = lo_i + 1, second  # lr@ID:FACTOR
            elif kind != "lr" and third is not None:
                raise ConfigError(f"--inject-fault {text!r}: only lr takes a factor; expected {FAULT_SYNTAX}")
            else:
                hi_i, factor = (int(second) if second is not None else lo_i + 1), third
        if hi_i <= lo_i:
            raise ConfigError(f"--inject-fault {text!r}: empty range; need LO < HI (HI exclusive)")
        f = float(factor) if factor else (30.0 if kind == "lr" else 1.0)
        try:
            return cls(kind=kind, lo=lo_i, hi=hi_i, factor=f)
        except ValidationError as e:  # a factor of 1e999 (inf), an id past int64
            raise ConfigError(f"--inject-fault {text!r}: {_format_validation(e, 'fault').removeprefix('fault: ')}") from None

    def hits(self, ids) -> bool:
        return self.kind != "slow" and any(self.lo <= i < self.hi for i in ids)


SOURCE_FAULT_RE = re.compile(r"^(corrupt_source|reweight)@([a-z0-9_]{1,32}):(?:([0-9.eE+-]+):)?(\d+)$")
SOURCE_FAULT_SYNTAX = "corrupt_source@NAME:FROM_STEP or reweight@NAME:FACTOR:FROM_STEP"


class SourceFault(_Strict):
    """A mixture drill keyed to a data source from a step on (``trainer.faults`` applies it):
    ``corrupt_source`` replaces that source's samples by garbage (seeded by sample id, so skipping
    them removes it); ``reweight`` multiplies its sampling weight by ``factor``."""

    kind: Literal["corrupt_source", "reweight"]
    source: str = Field(pattern=r"^[a-z0-9_]{1,32}$")
    from_step: int = Field(ge=1, description="first (1-based) step it applies to")
    factor: float = Field(1.0, ge=0)

    @classmethod
    def parse(cls, text: str) -> SourceFault:
        m = SOURCE_FAULT_RE.match(text.strip())
        if not m:
            raise ConfigError(f"--inject-fault {text!r}: expected {SOURCE_FAULT_SYNTAX}")
        kind, source, factor, step = m.groups()
        if (kind == "reweight") != (factor is not None):
            raise ConfigError(f"--inject-fault {text!r}: expected {SOURCE_FAULT_SYNTAX}")
        try:
            return cls(kind=kind, source=source, from_step=int(step), factor=float(factor) if factor else 1.0)
        except (ValueError, ValidationError):
            raise ConfigError(f"--inject-fault {text!r}: step must be >= 1 and the factor a number >= 0") from None

    @staticmethod
    def matches(text: str) -> bool:
        return text.strip().startswith(("corrupt_source@", "reweight@"))


class TrainConfig(_Strict):
    run_id: str | None = Field(None, description="defaults to the run dir's name")
    preset: str | None = None
    seed: int = Field(1337, ge=0, le=MAX_SEED, description="torch takes an int64 seed (plus 1000003 x rank)")
    max_steps: int = Field(100, ge=1)
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    deterministic: bool = Field(True, description="bitwise-reproducible steps (exact resume and replay); on CUDA this "
                                "means the math attention kernel, ~3x slower for gpt2-124m on an H100 (trainer/determinism.py), "
                                "or model.attention: triton, 0.75x the fast path's throughput compiled and 0.83x eager on an H200")
    compile: bool = Field(False, description="torch.compile the model (inductor): each transformer block on its own with "
                          "FSDP2, else the whole model; the first steps of a process pay the compilation (trainer/build.py)")
    model: ModelConfig = ModelConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    guard: GuardConfig = GuardConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    faults: list[Fault] = Field(default_factory=list)
    source_faults: list[SourceFault] = Field(default_factory=list)

    @field_validator("run_id")
    @classmethod
    def _run_id_ok(cls, v):
        if v is not None and not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", v):
            raise ValueError("run_id: use letters, digits, '-', '_' or '.'")
        return v

    @model_validator(mode="after")
    def _schedule_fits(self):
        # every scheduled length cuts each model.seq_len sample into whole pieces, and a micro-batch
        # into whole samples (trainer/seqlen.py): sample ids and the data cursor never depend on it
        full, mb = self.model.seq_len, self.data.micro_batch_size
        for step, n in self.data.seq_len_schedule:
            if n > full or full % n or mb % (full // n):
                raise ValueError(
                    f"data.seq_len_schedule: seq_len {n} (from step {step}) must divide model.seq_len {full}, and "
                    f"model.seq_len / seq_len ({full / n:g}) must divide data.micro_batch_size {mb}")
        return self


PRESETS: dict[str, dict] = {
    # CPU smoke: a dozen steps in a few seconds
    "tiny": {
        "model": {"n_layer": 2, "n_head": 2, "d_model": 64, "seq_len": 64},
        "data": {"micro_batch_size": 4},
        "optim": {"lr": 3e-3, "warmup_steps": 10},
        "eval": {"every": 50, "batches": 2},
    },
    # a few M params: CPU minutes
    "small": {
        "model": {"n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 128},
        "data": {"micro_batch_size": 8},
        "optim": {"lr": 1e-3, "warmup_steps": 50},
        "eval": {"every": 100, "batches": 4},
    },
    # GPT-2 small, for GPUs
    "gpt2-124m": {
        "model": {"n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024, "vocab_size": 50304},
        "data": {"micro_batch_size": 16, "grad_accum": 4},
        "optim": {"lr": 6e-4, "warmup_steps": 700, "min_lr_ratio": 0.1, "weight_decay": 0.1},
        "eval": {"every": 500, "batches": 20},
        "checkpoint": {"every": 1000, "keep_last": 3, "keep_every": 10000, "async_save": True},
    },
}


def _deep_merge(base: dict, over: dict) -> dict:
    """A new dict: nested dicts are copied, so setting a flag later never writes into a preset."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k] if isinstance(out.get(k), dict) else {}, v) if isinstance(v, dict) else v
    return out


def _set_path(d: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    for i, k in enumerate(keys[:-1]):
        d = d.setdefault(k, {})
        if not isinstance(d, dict):  # --set seed.x=1: seed is a number, not a section
            raise ConfigError(f"--set {dotted}: {'.'.join(keys[:i + 1])} is not a section")
    d[keys[-1]] = value


def _format_validation(e: ValidationError, source: str) -> str:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    # a check across sections (a model validator) has no location: its message names the fields
    return f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}"


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    try:  # bounded: a FIFO, /dev/zero or a huge file is refused in one line, not read until OOM
        data = read_yaml(p, MAX_STATE_BYTES) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except OSError as e:
        raise ConfigError(f"{p}: unreadable ({e.strerror or e})") from None
    except YamlError as e:  # not UTF-8, not YAML, [[[[... 50,000 deep
        raise ConfigError(f"{p}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return data


def resolve(
    *,
    preset: str | None = None,
    config_file: str | None = None,
    saved: dict | None = None,
    overrides: dict | None = None,
) -> TrainConfig:
    """Build the config: saved run config (resume) or preset, then the YAML file, then flag overrides."""
    layers: list[tuple[str, dict]] = []
    if saved is not None and preset is None and config_file is None:
        layers.append(("saved config.yaml", saved))
    else:
        name = preset or (saved or {}).get("preset") or "tiny"
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
        layers.append((f"preset {name}", {**PRESETS[name], "preset": name}))
        if config_file:
            layers.append((str(config_file), load_yaml(config_file)))
    merged: dict = {}
    for source, layer in layers:
        merged = _deep_merge(merged, layer)
        try:  # validate each layer as it lands, so the error names the file that caused it
            TrainConfig.model_validate(merged)
        except ValidationError as e:
            raise ConfigError(_format_validation(e, source)) from None
    for dotted, value in (overrides or {}).items():
        _set_path(merged, dotted, value)
    try:
        return TrainConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, "flags")) from None


def dump(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def load_run_config(run_dir: str | Path) -> TrainConfig:
    """The resolved config a run was started with (``RUN_DIR/config.yaml``)."""
    p = Path(run_dir) / "config.yaml"
    if not p.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    try:
        return TrainConfig.model_validate(load_yaml(p))
    except ValidationError as e:
        raise ConfigError(_format_validation(e, str(p))) from None
