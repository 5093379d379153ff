"""Process-group setup that works the same under plain ``python`` and ``torchrun``."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    control_group: object | None = None  # a gloo group for host-side control traffic (CPU tensors)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.control_group)

    def all_ok(self, ok: bool) -> bool:
        """True iff ``ok`` on every rank (a host-side collective, used off the hot path)."""
        if not self.distributed:
            return ok
        t = torch.tensor([0 if ok else 1], dtype=torch.int64)
        dist.all_reduce(t, group=self.control_group)
        return int(t.item()) == 0

    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank (control decisions)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]


def init(device_pref: str = "auto") -> DistEnv:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    control = None
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if use_cuda else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
        # control traffic (directives, checkpoint votes) stays on a CPU gloo group: no device syncs
        control = dist.new_group(backend="gloo") if use_cuda else dist.group.WORLD
    return DistEnv(rank=rank, local_rank=local, world_size=world, device=device, control_group=control)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
