"""Kept for compatibility: the checkpoint schemas live in ``sentinel.contract.checkpoints`` (the one
validator the trainer and the torch-free on-call views share). Import from there."""

from sentinel.contract.checkpoints import (  # noqa: F401  (re-exported)
    INT64_MAX,
    MAX_WORLD_SIZE,
    SHA256,
    Count,
    GuardState,
    Manifest,
    ManifestError,
    MixtureSamplerState,
    SamplerState,
    SchedulerState,
    SourceCursor,
    TrainStateFile,
    check_manifest,
    first_error,
)
from sentinel.contract.rundir import checkpoint_required_files as required_files  # noqa: F401  (re-exported)
