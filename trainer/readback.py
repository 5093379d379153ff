"""Get per-step scalars (loss, grad norm, guard verdict, digest) to the host without a sync per step.

On CUDA, step t's scalars are packed into one device tensor and copied non-blocking into pinned
memory behind a CUDA event; they are read at step t+1, after step t+1's work is already queued, so
the host never waits on the device it is feeding (one-step lag). On CPU there is nothing to wait
for and values are returned immediately.
"""

from __future__ import annotations

from collections import deque

import torch


class StepReadback:
    def __init__(self, device: torch.device):
        self.lagged = device.type == "cuda"
        self._pending: deque = deque()

    def submit(self, tensors: dict[str, torch.Tensor], meta: dict) -> list[tuple[dict, dict]]:
        """Queue this step's device tensors; return (host_values, meta) for steps now readable."""
        # floats travel as float64, integers (the param digest) as int64: both exact
        parts = {
            kind: [(n, t) for n, t in tensors.items() if (t.dtype.is_floating_point or t.dtype == torch.bool) == (kind == "f")]
            for kind in ("f", "i")
        }
        packed = []
        for kind, items in parts.items():
            dtype = torch.float64 if kind == "f" else torch.int64
            device = next(iter(tensors.values())).device
            flat = torch.cat([t.detach().reshape(-1).to(dtype) for _, t in items]) if items else torch.empty(0, dtype=dtype, device=device)
            packed.append(([n for n, _ in items], [t.numel() for _, t in items], flat))
        if not self.lagged:
            return [(self._unpack(packed), meta)]
        host_packed = []
        for names, sizes, flat in packed:
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            host_packed.append((names, sizes, host))
        ev = torch.cuda.Event()
        ev.record()
        self._pending.append((host_packed, ev, meta))
        out = []
        while len(self._pending) > 1:  # everything but the step just queued
            out.append(self._pop())
        return out

    def drain(self) -> list[tuple[dict, dict]]:
        out = []
        while self._pending:
            out.append(self._pop())
        return out

    def _pop(self):
        packed, ev, meta = self._pending.popleft()
        ev.synchronize()  # recorded a step ago: already complete, so this does not stall the GPU
        return self._unpack(packed), meta

    @staticmethod
    def _unpack(packed) -> dict:
        out = {}
        for names, sizes, flat in packed:
            vals = flat.tolist()
            i = 0
            for n, s in zip(names, sizes):
                out[n] = vals[i] if s == 1 else vals[i : i + s]
                i += s
        return out
