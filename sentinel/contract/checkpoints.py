"""Strict schemas of a checkpoint's ``manifest.json`` and ``train_state.json``: the one validator.

The trainer (``trainer.checkpoint.verify``) and the torch-free on-call views (``sentinel.rundir``)
both call ``check_manifest``, so a checkpoint listed ``checksum_ok`` by ``sentinel checkpoints`` is
one the trainer will load.

A checksum only proves a file is the one the writer meant; it says nothing about whether the writer
(or whoever re-signed the manifest) wrote something sane. Everything a resume trusts is therefore
typed and range-checked here before any of it touches the model, the optimizer or the sampler:
``"step": -5``, a cursor past the end of the epoch, a skip range beyond int64 or a world size that
disagrees with the manifest all make the checkpoint invalid, so the loader falls back to the
previous one instead of training from a nonsense state.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator, model_validator

from sentinel.contract.limits import INT64_MAX, MAX_WORLD_SIZE
from sentinel.contract.parsing import plain_error
from sentinel.contract.rundir import CHECKPOINT_FORMAT, STEP_DIR_RE, checkpoint_required_files

SHA256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
# a file's checksum in a manifest: ``blake3:<64 hex>``, or a bare sha256 in manifests written before (fsio.file_checksum)
FileChecksum = Annotated[str, Field(pattern=r"^(blake3:)?[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _finite(v: float) -> float:
    if not math.isfinite(v):
        raise ValueError("must be finite")
    return v


class Manifest(BaseModel):
    # extra keys allowed: the trainer adds run metadata (run, timeline, tokens, ...) beside these
    model_config = ConfigDict(strict=True, extra="allow")

    format: Literal[1]
    step: Count
    files: dict[str, FileChecksum]
    bytes: Count = 0
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
    created: float

    @field_validator("files")
    @classmethod
    def _safe_names(cls, files: dict[str, str]) -> dict[str, str]:
        for name in files:  # as PurePosixPath would see them (absolute, "..") at a tenth of the cost
            if not name or name[0] == "/" or ".." in name.split("/") or "\\" in name or "\x00" in name:
                raise ValueError(f"unsafe file name {name!r}")
        return files

    _created = field_validator("created")(_finite)


class SamplerState(_Strict):
    epoch: Count
    position: Count
    seed: Count
    num_samples: Annotated[int, Field(ge=1, le=INT64_MAX)]
    dataset_fingerprint: str

    @model_validator(mode="after")
    def _cursor_in_epoch(self) -> SamplerState:
        if self.position > self.num_samples:
            raise ValueError(f"cursor position {self.position} is past the epoch's {self.num_samples} samples")
        return self


class SourceCursor(_Strict):
    """One source's cursor in a mixture sampler (``trainer.data.mixture``)."""

    name: Annotated[str, Field(pattern=r"^[a-z0-9_]{1,32}$")]
    num_samples: Count
    epoch: Count
    position: Count

    @model_validator(mode="after")
    def _cursor_in_epoch(self) -> SourceCursor:
        if self.position > self.num_samples:
            raise ValueError(f"source {self.name}: cursor {self.position} is past its {self.num_samples} samples")
        return self


class MixtureSamplerState(_Strict):
    kind: Literal["mixture"]
    slot: Count
    seed: Count
    num_samples: Annotated[int, Field(ge=1, le=INT64_MAX)]
    dataset_fingerprint: str
    sources: Annotated[list[SourceCursor], Field(min_length=1, max_length=16)]

    @model_validator(mode="after")
    def _sources_add_up(self) -> MixtureSamplerState:
        if sum(s.num_samples for s in self.sources) != self.num_samples:
            raise ValueError("the sources' sample counts do not add up to num_samples")
        return self


class GuardState(_Strict):
    window: Annotated[int, Field(ge=1, le=1 << 20)]
    loss: list[float]
    grad: list[float]
    count: Count
    streak: Count

    @field_validator("loss", "grad")
    @classmethod
    def _finite_history(cls, xs: list[float]) -> list[float]:
        if not all(map(math.isfinite, xs)):  # the guard records accepted (finite) steps only
            raise ValueError("the guard history holds a value that is not finite")
        return xs

    @model_validator(mode="after")
    def _lengths(self) -> GuardState:
        if len(self.loss) != self.window or len(self.grad) != self.window:
            raise ValueError(f"guard history lengths {len(self.loss)}/{len(self.grad)} differ from its window {self.window}")
        return self


class SchedulerState(_Strict):
    kind: Literal["warmup_cosine"]
    step: Count
    max_steps: Count


class TrainStateFile(_Strict):
    """``train_state.json``: the host-side half of S_t (see trainer/train.py)."""

    run: str
    step: Count
    tokens: Count
    timeline: Count
    grad_accum_pos: Literal[0]  # checkpoints are only taken at optimizer-step boundaries
    sampler: Annotated[  # tagged by "kind", so an error names the real problem, not the other variant's
        Annotated[MixtureSamplerState, Tag("mixture")] | Annotated[SamplerState, Tag("plain")],
        # a dict when validating, the model when serializing (model_dump): both must pick the same variant
        Discriminator(lambda v: "mixture" if (v.get("kind") if isinstance(v, dict) else getattr(v, "kind", None)) == "mixture"
                      else "plain"),
    ]
    skiplist: list[Annotated[list[Count], Field(min_length=2, max_length=2)]]
    guard: GuardState
    scheduler: SchedulerState
    world_size: Annotated[int, Field(ge=1, le=MAX_WORLD_SIZE)]
    dataset_fingerprint: str
    faults: list[dict]
    last_checkpoint_time: float
    # data mixtures (absent in checkpoints written before them)
    source_faults: list[dict] = []
    mixture_weights: dict[Annotated[str, Field(pattern=r"^[a-z0-9_]{1,32}$")], float] | None = None
    seq_len: Annotated[int, Field(ge=1)] | None = None
    # the seq_len the checkpointed step trained at (data.seq_len_schedule; absent before schedules existed)
    train_seq_len: Annotated[int, Field(ge=1)] | None = None

    _time = field_validator("last_checkpoint_time")(_finite)

    @model_validator(mode="after")
    def _consistent(self) -> TrainStateFile:
        if self.scheduler.step != self.step:
            raise ValueError(f"scheduler step {self.scheduler.step} differs from step {self.step}")
        if self.sampler.dataset_fingerprint != self.dataset_fingerprint:
            raise ValueError("sampler and train state name different datasets")
        for lo, hi in self.skiplist:
            if hi <= lo:
                raise ValueError(f"empty or reversed skip range [{lo}, {hi})")
        return self


def first_error(e: ValidationError) -> str:
    """One line out of a pydantic error: ``field.path: message``."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "(top level)"
    return f"{where}: {err['msg']}"


class ManifestError(ValueError):
    """A checkpoint manifest that is not one the trainer wrote (or can load): one line, no path."""


def check_manifest(raw: object, dir_name: str | None = None) -> Manifest:
    """``raw`` (a parsed ``manifest.json``) as a ``Manifest``, or ``ManifestError`` saying what is wrong:
    an unsupported format, a field of the wrong type or out of range, an unsafe file name, a step
    other than its directory's (``dir_name``, ``step-NNNNNNNN``), or a file the step needs that the
    manifest does not list. It checks the document only, not the files it names."""
    if not isinstance(raw, dict):
        raise ManifestError("manifest is malformed (expected a JSON object)")
    if "format" in raw and raw["format"] != CHECKPOINT_FORMAT:
        shown = repr(raw["format"])
        raise ManifestError(f"unsupported checkpoint format {shown if len(shown) <= 40 else shown[:40] + '...'}")
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"][:1]) or "(top level)"
        raise ManifestError(f"manifest {where} is invalid ({plain_error(err)})") from None
    m = STEP_DIR_RE.match(dir_name or "")
    if m and int(m.group(1)) != manifest.step:
        raise ManifestError(f"manifest names step {manifest.step}, not the step of its directory")
    sharded = any(n.startswith("dcp/") for n in manifest.files)
    # a framework's checkpoint (``framework`` in its manifest: sentinel.client.checkpoints) holds that
    # framework's files, all listed and hashed; only our trainer's must hold the trainer's files
    legacy = "rng-rank0.pt" in manifest.files  # written before tensor files: torch's format, the same pieces
    required = [] if "framework" in raw else checkpoint_required_files(manifest.world_size, sharded, legacy=legacy)
    for name in required:
        if name not in manifest.files:
            raise ManifestError(f"{name} is not in the manifest (incomplete or tampered)")
    return manifest


def manifest_digest(manifest: dict) -> str:
    """``manifest_sha256`` of a checkpoint: the sha256 of its sorted ``files`` map (what the bus carries)."""
    return hashlib.sha256(json.dumps(manifest["files"], sort_keys=True).encode()).hexdigest()
