"""The optimizer file's format: its state as a few flat tensors, not one tensor per parameter and key.

``torch.load(weights_only=True)`` runs a pure-Python unpickler, and rebuilding each tensor costs it
tens of microseconds. An AdamW state dict holds three tensors per parameter (``step``, ``exp_avg``,
``exp_avg_sq``): on ``small`` (27 parameters) unpickling ``optim.pt`` took 3.7 ms of a 34 ms load, and
0.6 ms once its 81 tensors are three (0.2 ms more to rebuild the views). The file is now a tensor file
(``optim.safetensors``, ``trainer/tensor_file.py``: no unpickler at all), and still holds three: fewer
tensors to lay out and copy. It holds::

    {"format": FORMAT,
     "param_groups": [...],                   # torch's, as they are
     "groups": [{"key": "exp_avg",            # one per (state key, dtype), in first-seen order
                 "params": [0, 1, ...],       # the parameter indices, in order
                 "shapes": [[256, 768], ...], # each one's shape; its values follow the last one's
                 "data": <1-D tensor>}, ...],
     "other": {index: {key: value}}}          # what is not a tensor (none for SkipStepAdamW)

``pack`` takes torch's optimizer state dict and copies nothing when each group's tensors are, in
order, contiguous views that tile one storage (``SkipStepAdamW``'s moments are: ``trainer/optim.py``).
``unpack`` gives torch's state dict back, each tensor a view of its group's data, after checking the
file's structure; the checks against the live optimizer are ``check_optimizer_state``'s. A state dict
in torch's own format (a checkpoint written before this format) is returned by ``unpack`` as it is;
another ``format`` is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.checkpoint import CheckpointError

FORMAT = "sentinel.flat-optimizer/1"


def tiled_base(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D tensor over the storage ``ts`` tile in order (contiguous, back to back from its start,
    covering all of it), or None. Live allocations never overlap, so addresses alone tell the tiling."""
    first = ts[0]
    if first.storage_offset():
        return None
    size, start, n = first.element_size(), first.data_ptr(), 0
    for t in ts:
        if t.dtype != first.dtype or t.device != first.device or t.data_ptr() != start + n * size or not t.is_contiguous():
            return None
        n += t.numel()
    if n * size != first.untyped_storage().nbytes():
        return None
    return first.as_strided((n,), (1,), 0)


def pack(sd: dict) -> dict:
    """torch's optimizer state dict -> this file's format (see the module's docstring)."""
    groups: dict[tuple[str, torch.dtype], dict] = {}
    tensors: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}
    other: dict = {}
    for idx, st in sd["state"].items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                g = groups.setdefault((key, v.dtype), {"key": key, "params": [], "shapes": []})
                g["params"].append(idx)
                g["shapes"].append(list(v.shape))
                tensors.setdefault((key, v.dtype), []).append(v)
            else:
                other.setdefault(idx, {})[key] = v
    for gk, g in groups.items():
        ts = tensors[gk]
        base = tiled_base(ts)
        g["data"] = base if base is not None else torch.cat([t.reshape(-1) for t in ts])
    return {"format": FORMAT, "param_groups": sd["param_groups"], "groups": list(groups.values()), "other": other}


def _is_index(x: Any) -> bool:
    return type(x) is int and x >= 0


def unpack(saved: Any, what: str) -> Any:
    """This file's format -> torch's optimizer state dict (views of the groups' data); anything else is
    returned as it is, for ``check_optimizer_state`` to judge. Refuses a malformed file in one line."""
    if not (isinstance(saved, dict) and "format" in saved):
        return saved
    if saved["format"] != FORMAT:
        raise CheckpointError(f"{what} has format {str(saved['format'])[:80]!r}; this trainer reads {FORMAT!r}")
    groups, other = saved.get("groups"), saved.get("other")
    if not isinstance(groups, list) or not isinstance(other, dict) or not isinstance(saved.get("param_groups"), list):
        raise CheckpointError(f"{what} is not an optimizer state dict")
    state: dict = {}
    for i, g in enumerate(groups):
        bad = f"{what}: state group {i}"
        if not isinstance(g, dict) or not isinstance(g.get("key"), str):
            raise CheckpointError(f"{bad} is malformed")
        params, shapes, data = g.get("params"), g.get("shapes"), g.get("data")
        if not isinstance(data, torch.Tensor) or data.dim() != 1:
            raise CheckpointError(f"{bad} has no 1-D data")
        if (not isinstance(params, list) or not isinstance(shapes, list) or len(params) != len(shapes)
                or not all(map(_is_index, params))
                or not all(isinstance(s, list) and len(s) <= 8 and all(map(_is_index, s)) for s in shapes)):
            raise CheckpointError(f"{bad} has malformed parameter indices or shapes")
        offset = 0
        for idx, shape in zip(params, shapes):
            n = 1
            for d in shape:
                n *= d
            if offset + n > data.numel():
                raise CheckpointError(f"{bad} is shorter than its shapes say ({data.numel()} values)")
            st = state.setdefault(idx, {})
            if g["key"] in st:
                raise CheckpointError(f"{bad} repeats {g['key']} of parameter {idx}")
            st[g["key"]] = data.narrow(0, offset, n).view(shape)
            offset += n
        if offset != data.numel():
            raise CheckpointError(f"{bad} holds {data.numel()} values, its shapes {offset}")
    for idx, st in other.items():
        if not _is_index(idx) or not isinstance(st, dict):
            raise CheckpointError(f"{what}: state of parameter {idx!r} is malformed")
        state.setdefault(idx, {}).update(st)
    return {"state": state, "param_groups": saved["param_groups"]}


@dataclass(frozen=True)
class FlatCopy:
    """A file laid out exactly as the live optimizer holds its state (``copy_plan``): its hyper-parameters,
    and the copies that load it, one per flat tensor (live, the file's)."""

    param_groups: list
    copies: list[tuple[torch.Tensor, torch.Tensor]]


def copy_plan(saved: Any, opt: torch.optim.Optimizer) -> FlatCopy | None:
    """The load of ``saved`` (this file's format) as a few copies, when what ``pack`` would write of the
    live optimizer has the same layout: the same groups of hyper-parameters and parameters (by
    position, as torch maps them), and the same state groups, in the same order, with the same keys,
    parameter indices, shapes and dtypes, each of whose live tensors tiles one flat tensor. It is then
    exactly what ``SkipStepAdamW.load_state_dict`` gives, without unpacking a view per parameter and
    key or torch's walk of the state (on ``tiny``, 0.4 of a 2.6 ms load). Else None, and the file takes
    that path, which checks it in full and says what is wrong with it."""
    if (not isinstance(saved, dict) or saved.get("format") != FORMAT or saved.get("other") != {}
            or getattr(opt, "_optimizer_load_state_dict_pre_hooks", None) or getattr(opt, "_optimizer_load_state_dict_post_hooks", None)):
        return None
    saved_groups, groups = saved.get("param_groups"), opt.param_groups
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        return None
    index: dict[torch.Tensor, int] = {}
    for g, sg in zip(groups, saved_groups):
        first = len(index)
        if (not isinstance(sg, dict) or sg.keys() != g.keys() or not isinstance(sg["params"], list)
                or not all(type(i) is int for i in sg["params"]) or sg["params"] != list(range(first, first + len(g["params"])))):
            return None
        index.update((p, first + k) for k, p in enumerate(g["params"]))
    expect: dict[tuple[str, torch.dtype], tuple[list[int], list[torch.Tensor]]] = {}
    for p, st in opt.state.items():  # as ``pack`` walks torch's state dict: the live state's order
        if p not in index:
            return None
        for key, v in st.items():  # torch casts a moment to its parameter's dtype: only where it is already
            if not isinstance(v, torch.Tensor) or (key != "step" and v.dtype != p.dtype):
                return None
            idxs, ts = expect.setdefault((key, v.dtype), ([], []))
            idxs.append(index[p])
            ts.append(v)
    state_groups = saved.get("groups")
    if not isinstance(state_groups, list) or len(state_groups) != len(expect):
        return None
    copies = []
    for sg, ((key, dtype), (idxs, ts)) in zip(state_groups, expect.items()):
        data = sg.get("data") if isinstance(sg, dict) else None
        if (not isinstance(data, torch.Tensor) or data.dim() != 1 or data.dtype != dtype or sg.get("key") != key
                or sg.get("params") != idxs or not all(type(i) is int for i in sg["params"])
                or sg.get("shapes") != [list(t.shape) for t in ts] or not all(type(d) is int for s in sg["shapes"] for d in s)):
            return None
        base = tiled_base(ts)
        if base is None or base.numel() != data.numel():
            return None
        copies.append((base, data))
    return FlatCopy(saved_groups, copies)
