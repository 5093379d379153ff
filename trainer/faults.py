"""Fault drills keyed to sample ids (``--inject-fault KIND@LO:HI``, half-open like ``--skip``;
``lr@ID:FACTOR`` or ``lr@LO:HI:FACTOR``; parsed by ``trainer.config.Fault.parse``).

Each drill reproduces a real failure mode, and because it is keyed to data positions, skipping the
samples removes it exactly as skipping real bad data would:
- ``garbage``: the samples' tokens are replaced by uniform noise (seeded by the sample id);
- ``lr``: the learning rate is multiplied by FACTOR on steps that train those samples;
- ``nan``: the loss of a micro-batch holding those samples becomes NaN.

``slow@RANK:SECONDS`` is the exception, keyed to a rank: that rank sleeps SECONDS inside its
forward/backward phase every step, like a throttled GPU or a noisy neighbour, so the other ranks
wait for it in the gradient all-reduce (a straggler drill).
"""

from __future__ import annotations

import time

import numpy as np

from trainer.config import Fault, SourceFault


def corrupt_tokens(faults: list[Fault], ids: list[int], tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Return ``tokens`` (B, T+1) with garbage-drilled rows replaced; the input is not modified."""
    out = tokens
    for f in faults:
        if f.kind != "garbage":
            continue
        for row, sid in enumerate(ids):
            if f.lo <= sid < f.hi:
                if out is tokens:
                    out = tokens.copy()
                out[row] = np.random.default_rng(sid).integers(0, vocab_size, size=tokens.shape[1])
    return out


def lr_multiplier(faults: list[Fault], ids: list[int]) -> float:
    m = 1.0
    for f in faults:
        if f.kind == "lr" and f.hits(ids):
            m *= f.factor
    return m


def poisons_loss(faults: list[Fault], ids: list[int]) -> bool:
    return any(f.kind == "nan" and f.hits(ids) for f in faults)


def straggle(faults: list[Fault], rank: int) -> float:
    """Sleep as a ``slow`` drill on ``rank`` says; return the seconds slept (0.0 when not drilled)."""
    seconds = sum(f.factor for f in faults if f.kind == "slow" and f.lo == rank)
    if seconds > 0:
        time.sleep(seconds)
    return seconds


# ------------------------------------------------------------------------------------------------
# mixture drills (``--inject-fault corrupt_source@NAME:FROM_STEP`` / ``reweight@NAME:FACTOR:FROM_STEP``,
# parsed by ``trainer.config.SourceFault``): keyed to a data source from a step on
# ------------------------------------------------------------------------------------------------

_SOURCE_GARBAGE_KEY = 0x5EED  # keeps corrupt_source noise distinct from the garbage drill's


def corrupt_source_tokens(source_faults: list[SourceFault], step: int, ids: list[int], sources: list[str],
                          tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """Rows of ``tokens`` whose sample comes from a corrupted source (``sources[row]`` names it)
    become noise seeded by the sample id, on (1-based) steps ``>= from_step``; the input is not
    modified. Keyed by id, so skipping those samples removes the fault, like real bad data."""
    out = tokens
    for f in source_faults:
        if f.kind != "corrupt_source" or step < f.from_step:
            continue
        for row, (sid, src) in enumerate(zip(ids, sources)):
            if src == f.source:
                if out is tokens:
                    out = tokens.copy()
                rng = np.random.default_rng([int(sid), _SOURCE_GARBAGE_KEY])
                out[row] = rng.integers(0, vocab_size, size=tokens.shape[1])
    return out


def source_weight_factors(source_faults: list[SourceFault], step: int) -> dict[str, float]:
    """Sampling-weight multiplier per source on (1-based) ``step`` (sources without a drill: absent)."""
    out: dict[str, float] = {}
    for f in source_faults:
        if f.kind == "reweight" and step >= f.from_step:
            out[f.source] = out.get(f.source, 1.0) * f.factor
    return out
