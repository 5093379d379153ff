"""Capture and restore every RNG a rank uses, as tensors and plain values (a tensor file holds them: ``trainer/tensor_file.py``)."""

from __future__ import annotations

import random

import numpy as np
import torch


def capture() -> dict:
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {
        "python": {"version": py_version, "state": torch.from_numpy(np.array(py_state, dtype=np.int64)), "gauss": py_gauss},
        "numpy": {
            "kind": np_kind,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore(st: dict) -> None:
    p = st["python"]
    random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss"]))
    n = st["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def seed_all(seed: int, rank: int) -> None:
    """Distinct streams per rank (dropout must differ across ranks), reproducible per (seed, rank)."""
    s = seed + 1000003 * rank
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
