"""The checks a loaded checkpoint piece passes before anything live is touched: a state dict against
the model, an optimizer state against the optimizer's layout, an RNG state by a dry run.

Each raises ``CheckpointError`` with one line; ``trainer/state.py``'s pieces call them from ``check``, so a
checkpoint that cannot be loaded whole is refused before ``load_state_dict`` could fail halfway."""

from __future__ import annotations

import functools
from typing import Any

import torch

from trainer.checkpoint import CheckpointError


def check_tensors(saved: Any, reference: dict[str, torch.Tensor], what: str) -> None:
    """``saved`` must be a state dict with exactly ``reference``'s keys, shapes and dtypes, so that
    ``load_state_dict`` cannot fail halfway (it copies tensor by tensor and raises at the end)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{what} is not a state dict")
    missing, extra = set(reference) - set(saved), set(saved) - set(reference)
    if missing or extra:
        name = sorted(missing or extra)[0]
        raise CheckpointError(f"{what} {'lacks' if missing else 'has an unknown'} entry {name!r}")
    for k, ref in reference.items():
        t = saved[k]
        if not isinstance(t, torch.Tensor) or t.shape != ref.shape or t.dtype != ref.dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"{what}: {k} is {got}, expected {tuple(ref.shape)} {ref.dtype}")


def check_optimizer_state(saved: Any, opt: torch.optim.Optimizer, what: str) -> None:
    """Groups, hyper-parameter keys and every moment tensor must match the live optimizer's layout."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or not isinstance(saved.get("param_groups"), list):
        raise CheckpointError(f"{what} is not an optimizer state dict")
    groups = saved["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"{what} has {len(groups)} parameter groups, expected {len(opt.param_groups)}")
    shapes: dict[int, torch.Size] = {}
    for i, (g, live) in enumerate(zip(groups, opt.param_groups)):
        if not isinstance(g, dict) or set(g) != set(live) or not isinstance(g["params"], list) or len(g["params"]) != len(live["params"]):
            raise CheckpointError(f"{what}: parameter group {i} does not match this model")
        for idx, p in zip(g["params"], live["params"]):
            if not isinstance(idx, int) or idx in shapes:
                raise CheckpointError(f"{what}: parameter group {i} has a bad parameter index {idx!r}")
            shapes[idx] = p.shape
    for idx, st in saved["state"].items():
        if idx not in shapes or not isinstance(st, dict):
            raise CheckpointError(f"{what}: state for unknown parameter {idx!r}")
        for key, want in (("step", torch.Size([])), ("exp_avg", shapes[idx]), ("exp_avg_sq", shapes[idx])):
            t = st.get(key)
            if not isinstance(t, torch.Tensor) or t.shape != want or not t.is_floating_point():
                raise CheckpointError(f"{what}: parameter {idx} {key} does not match the parameter's shape")


@functools.cache
def _scratch_generators() -> tuple:
    """The throwaway generators of ``check_rng``, made once: seeded from the OS's entropy on every
    check, numpy's and Python's cost 0.2 ms of a 3 ms load of ``tiny``. Only ever overwritten."""
    import random

    import numpy as np

    return random.Random(0), np.random.RandomState(0), torch.Generator()


def check_rng(saved: Any, what: str) -> Any:
    """Dry-run every RNG restore on throwaway generators, so the live restore cannot fail; returns the
    states converted (``trainer.rng.prepare``), for that restore to set without converting them again."""
    from trainer import rng

    py, npy, tg = _scratch_generators()
    try:
        keys = saved["numpy"]["keys"]
        if not isinstance(keys, torch.Tensor) or keys.numel() != 624 or keys.min() < 0 or keys.max() >= 2**32:
            raise ValueError("numpy keys")
        prepared = rng.prepare(saved)
        py.setstate(prepared.python)
        npy.set_state(prepared.numpy)
        tg.set_state(prepared.torch)
        if prepared.cuda is not None and not (isinstance(prepared.cuda, list) and all(isinstance(t, torch.Tensor) for t in prepared.cuda)):
            raise ValueError("cuda")
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, OverflowError):
        raise CheckpointError(f"{what} is not a valid RNG state") from None
    return prepared
