"""Capture and restore every RNG a rank uses, as tensors and plain values (a tensor file holds them: ``trainer/tensor_file.py``)."""

from __future__ import annotations

import random
from typing import NamedTuple

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


class Prepared(NamedTuple):
    """A captured state, converted to what each generator's setter takes (``prepare``)."""

    python: tuple
    numpy: tuple
    torch: torch.Tensor
    cuda: list | None


def prepare(st: dict) -> Prepared:
    """``st`` (``capture``'s form) in the form ``apply`` sets; raises what the conversions raise on a
    malformed state (``trainer.checkpoint_checks.check_rng`` dry-runs it before anything is applied)."""
    p, n = st["python"], st["numpy"]
    return Prepared((p["version"], tuple(p["state"].tolist()), p["gauss"]),
                    # the keys as a list: numpy's setter reads a list in 2 us, an array in 34 us
                    (n["kind"], n["keys"].tolist(), n["pos"], n["has_gauss"], n["gauss"]),
                    st["torch"], st.get("cuda"))


def apply(pr: Prepared) -> None:
    random.setstate(pr.python)
    np.random.set_state(pr.numpy)
    torch.set_rng_state(pr.torch)
    if pr.cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(pr.cuda)


def restore(st: dict | Prepared) -> None:
    apply(st if isinstance(st, Prepared) else prepare(st))


def seed_all(seed: int, rank: int) -> None:
    """Distinct streams per rank (dropout must differ across ranks), reproducible per (seed, rank)."""
    s = seed + 1000003 * rank
    random.seed(s)
    np.random.seed(s % (2**32))
    torch.manual_seed(s)
