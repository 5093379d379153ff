"""Reading a checkpoint's piece files (their checksums: ``trainer.checkpoint_verify``).

``model.safetensors``, ``optim.safetensors`` and ``rng-rankN.safetensors`` are tensor files
(``trainer/tensor_file.py``): a JSON header and the tensors' bytes, no pickle. A checkpoint written
before them holds ``.pt`` files of torch's format instead, and still loads: through
``torch.load(weights_only=True)``, which refuses every global but tensors and plain containers, and
only once its checksum passed (a tensor file's header may be parsed while the file is hashed:
``trainer.checkpointing.TrainerCheckpoints._parse_early``).
Either way a file that cannot be read whole is one line (``CheckpointError``) naming the checkpoint
and the file.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from trainer import tensor_file
from trainer.checkpoint import TORCH_SUFFIX, CheckpointError


def legacy_name(name: str) -> str:
    """The name a tensor file had in a checkpoint of torch's format (``model.safetensors`` -> ``model.pt``)."""
    return name.removesuffix(tensor_file.SUFFIX) + TORCH_SUFFIX if name.endswith(tensor_file.SUFFIX) else name


def piece_path(checkpoint: Path, name: str, files=None) -> Path:
    """Where a checkpoint keeps the piece file ``name`` (``model.safetensors``): that file, or in a
    checkpoint written before tensor files, torch's ``.pt`` of the same piece. ``files``: the names
    its manifest lists, which decide; without them, the file that exists does."""
    if files is not None:
        return checkpoint / (name if name in files else legacy_name(name))
    return checkpoint / name if (checkpoint / name).exists() else checkpoint / legacy_name(name)


def load_torch(path: Path, *, mmap: bool = False) -> Any:
    """A torch file: tensors and plain containers, never arbitrary pickle. ``mmap``: the tensors map the
    file's pages instead of being read into fresh memory; the caller copies them out before it lets
    go, so no tensor keeps a checkpoint file mapped."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # weights_only refused a global: a tampered or foreign file
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), "not plain tensors/containers")
        raise CheckpointError(f"{path.parent.name}: {path.name} refused by torch.load(weights_only=True): {why}") from None
    except (RuntimeError, EOFError, ValueError, OSError, RecursionError, MemoryError):  # not a torch zip, truncated inside
        raise CheckpointError(f"{path.parent.name}: {path.name} is not a readable torch file") from None


def load_file(path: Path, *, mapped: bool = False, mapping=None) -> Any:
    """The object in a piece file, by its suffix: a tensor file, else torch's format. ``mapped``: the
    tensors are views of the file's pages (copy them into live tensors, then let them go); a tensor
    file's ``mapping``, when its checksum made one (``trainer.checkpoint.verify_share(keep=...)``)."""
    if path.suffix != tensor_file.SUFFIX:
        return load_torch(path, mmap=mapped)
    try:
        return tensor_file.load(path, mapped=mapped, mapping=mapping)
    except tensor_file.TensorFileError as e:
        raise CheckpointError(f"{path.parent.name}: {path.name} is not a readable tensor file ({e})") from None
    except (OSError, ValueError, MemoryError) as e:
        raise CheckpointError(f"{path.parent.name}: {path.name} could not be read ({type(e).__name__})") from None
