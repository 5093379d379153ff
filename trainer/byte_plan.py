"""A tensor file restored by its bytes: when a checkpoint's tensor file has the very header of one that
was read, checked and restored into the same live tensors before, its load is one view of the file's
data, cut at the same offsets, and one ``torch._foreach_copy_`` into the same live bytes.

Why: a checkpoint's tensor files keep their header for the whole run (names, dtypes, shapes, offsets,
and the tree around them: the optimizer's hyper-parameters in the file, ``weight_decay``, ``betas``,
``eps``, never the learning rate, which is a function of the step). Reading one the plain way parses
and decodes that tree, makes a view per tensor, walks the live model's state dict and the optimizer's
state, and checks each tensor against its live one: on ``tiny``, 0.6 of a 2.3 ms load, for work whose
outcome the header's bytes and the live tensors decide alone (docs/benchmarks/checkpoint-cost.md,
change 27). A rollback restores a checkpoint of its own run, so the plan made by the run's first
load serves every load after it.

What makes a plan stand (``BytePlan.sources``): the file's header, length prefix included, is byte for
byte the one it was made for, and the file is as long; then parsing it gives the same tensors at the
same offsets and the same tree, so the piece's ``check`` would pass as it did. What the live side must
keep is each piece's to say (``trainer/state.py``: ``ModelPiece.planned``, ``OptimizerPiece.planned``):
the same live tensors, at the same addresses, shapes and dtypes, and for a model no parameter, buffer
or submodule registered anywhere since (``registrations``). A plan that does not stand is dropped
and the file takes the plain path, which makes a new one.
"""

from __future__ import annotations

import torch

_generation = [0]  # bumped by every parameter, buffer or submodule registered (or reassigned) anywhere
_hooked = [False]


def _bump(*_args) -> None:  # a registration hook: returning None leaves the registered value as it is
    _generation[0] += 1


def registrations() -> int:
    """A number that changes whenever any module registers or reassigns a parameter, a buffer or a
    submodule (torch's global registration hooks, installed on the first call)."""
    if not _hooked[0]:
        from torch.nn.modules import module

        _hooked[0] = True
        module.register_module_parameter_registration_hook(_bump)
        module.register_module_buffer_registration_hook(_bump)
        module.register_module_module_registration_hook(_bump)
    return _generation[0]


def signature(tensors) -> list[tuple]:
    """Where each live tensor's bytes are and what they hold: address, shape, dtype."""
    return [(t.data_ptr(), t.shape, t.dtype) for t in tensors]


def _address(mapping) -> int:
    view = torch.frombuffer(mapping, dtype=torch.uint8, count=1)
    try:
        return view.data_ptr()
    finally:
        del view


class BytePlan:
    """How one tensor file's bytes go into live tensors: ``head`` (its first ``len(head)`` bytes: the
    length prefix and the header), ``size`` (the file's), ``sizes`` (each tensor's bytes, in the
    file's order, tiling its data) and ``dst`` (the live tensors' bytes, 1-D ``uint8`` views, in that
    order). ``make`` builds one from a checked read; ``sources`` cuts a file's data the same way."""

    def __init__(self, head: bytes, size: int, sizes: list[int], dst: list[torch.Tensor]) -> None:
        self.head, self.size, self.sizes, self.dst = head, size, sizes, dst

    @classmethod
    def make(cls, mapping, pairs) -> BytePlan | None:
        """The plan of ``pairs`` (live tensor, the file's tensor: a view of ``mapping``, a tensor file
        mapped), or None where bytes alone cannot restore them: a tensor not contiguous, of another
        dtype or size than its live one, a file tensor that is no view of ``mapping``, or tensors that
        leave a gap in the file's data or overlap in it. A tensor stored once for several live names
        (tied weights: the same live bytes) is copied once."""
        size = len(mapping)
        if size < 8:
            return None
        start = 8 + int.from_bytes(mapping[:8], "little")
        base = _address(mapping)
        spans: dict[int, tuple[int, torch.Tensor]] = {}
        for live, saved in pairs:
            if (not isinstance(live, torch.Tensor) or not isinstance(saved, torch.Tensor) or live.dtype != saved.dtype
                    or live.nbytes != saved.nbytes or not live.is_contiguous() or not saved.is_contiguous()):
                return None
            if saved.nbytes == 0:  # nothing to copy (and no view of the file: ``tensor_file.read`` makes it empty)
                continue
            at = saved.data_ptr() - base
            if at in spans:
                if spans[at][1].data_ptr() != live.data_ptr() or spans[at][0] != saved.nbytes:
                    return None  # one stored tensor for two live ones that are not the same bytes
                continue
            spans[at] = (saved.nbytes, live)
        end, sizes, dst = start, [], []
        for at in sorted(spans):
            nbytes, live = spans[at]
            if at != end:
                return None
            end += nbytes
            sizes.append(nbytes)
            dst.append(live.detach().reshape(-1).view(torch.uint8))
        if end != size or not sizes:
            return None
        return cls(bytes(mapping[:start]), size, sizes, dst)

    def sources(self, mapping) -> list[torch.Tensor] | None:
        """``mapping``'s data cut as the plan's (views of it, in ``dst``'s order), if its header and
        size are the plan's; else None."""
        head = self.head
        if len(mapping) != self.size or mapping[:len(head)] != head:
            return None
        data = torch.frombuffer(mapping, dtype=torch.uint8, count=self.size - len(head), offset=len(head))
        return list(torch.split_with_sizes(data, self.sizes))
