"""AdamW whose whole update can be cancelled by a 0/1 tensor on the device, plus the LR schedule.

Why our own AdamW: the in-process guard decides *on the device* whether a step is healthy. To skip a
bad update without a host sync, the decision must scale everything the step touches — the moments,
the decoupled weight decay, the parameter update and the step count — the way OLMo-core's skip-step
optimizer does. A skipped step leaves the optimizer state bit-for-bit as it was. Non-finite
gradients are masked with ``where`` (``nan * 0`` is still NaN).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from trainer.config import OptimConfig
from trainer.flat_state import FlatCopy, tiled_base


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``decay_steps``.

    ``step`` is the 0-based index of the optimizer step about to run. Pure function of the step,
    so the scheduler's state is just the step counter saved in the checkpoint.
    """
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay = cfg.decay_steps or max_steps
    if step >= decay:
        return floor
    span = max(1, decay - cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / span
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - floor)


class SkipStepAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) driven by ``step(lr, factor)`` where ``factor`` is a 0-dim
    float tensor on the parameters' device: 1 applies the update, 0 makes the step a no-op."""

    def __init__(self, params, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, fused: bool | None = None):
        super().__init__(params, dict(betas=betas, eps=eps, weight_decay=weight_decay))
        self._flat_done = False  # the first state made is every parameter's (``_init_flat``)
        # torch's fused AdamW kernel (one multi-tensor launch per group) where the parameters are plain CUDA
        # tensors: the loop below costs ~18 launches a parameter, 16-21 ms a step of gpt2-124m on an H200
        # (docs/benchmarks/checkpoint-cost.md, "On a GPU"). None: on CUDA only; the CPU keeps the loop
        self.fused = fused

    @torch.no_grad()
    def step(self, lr: float | None = None, factor: torch.Tensor | None = None, closure=None):  # type: ignore[override]
        """Apply one update scaled by ``factor``. Called without ``lr`` (as torch.distributed.checkpoint
        does to materialise optimizer state before loading), it only creates the state: no update."""
        if lr is None:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and not self.state[p]:
                        self._init_state(p)
            return None
        if factor is None:
            factor = torch.ones((), dtype=torch.float32, device=self.param_groups[0]["params"][0].device)
        keep = factor > 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            if self._fused_step(group, lr, factor):
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p] or self._init_state(p)
                g = torch.where(keep, p.grad, torch.zeros_like(p.grad))
                m, v, t = st["exp_avg"], st["exp_avg_sq"], st["step"]
                t.add_(factor)
                m.lerp_(g, (1 - beta1) * factor)
                v.mul_(1 - (1 - beta2) * factor).addcmul_(g, g, value=1 - beta2)
                tc = t.clamp(min=1.0)
                bc1 = 1 - beta1**tc
                bc2 = 1 - beta2**tc
                step_size = lr * factor / bc1
                denom = (v / bc2).sqrt_().add_(group["eps"])
                if wd:
                    p.mul_(1 - lr * wd * factor)
                p.sub_(step_size * m / denom)

    def _fused_step(self, group: dict, lr: float, factor: torch.Tensor) -> bool:
        """The update of ``group`` by ``torch._fused_adamw_``, or False where it does not apply (then the
        loop runs). The same update as the loop's, to rounding (a max difference of ~1e-7 in 50 steps of
        float32, tests/trainer/test_checkpoint.py), and the same skip: ``found_inf`` = (factor == 0) makes the
        kernel return before it touches anything, and the step counts were advanced by ``factor`` (0), so a
        skipped step leaves the state bit for bit as it was, non-finite gradients included."""
        ps = [p for p in group["params"] if p.grad is not None]
        if not ps:
            return True
        fused = self.fused if self.fused is not None else ps[0].device.type == "cuda"
        if not fused or factor.dim() != 0:
            return False
        device, dtype = ps[0].device, ps[0].dtype
        if not all(type(p.data) is torch.Tensor and p.device == device and p.dtype == dtype and p.grad.dtype == dtype
                   and p.is_contiguous() and p.grad.is_contiguous() for p in ps):
            return False  # sharded (DTensor), mixed devices or dtypes, strided: the loop
        states = [self.state[p] or self._init_state(p) for p in ps]
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, factor)  # the kernel reads the advanced counts, as torch's AdamW does
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(ps, [p.grad for p in ps], [st["exp_avg"] for st in states], [st["exp_avg_sq"] for st in states], [],
                            steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                            amsgrad=False, maximize=False, grad_scale=None, found_inf=(factor == 0).to(torch.float32))
        return True

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as torch does, then give every state tensor memory of its own, on its parameter's device.

        * Where this optimizer already holds a moment of the same shape and dtype (an in-process
          rollback; or a cold resume, whose moments are laid out first, as a fresh run's), the loaded
          values are copied into it, one copy per key where both sides are flat: no fresh memory,
          the moments stay flat for the next save, and nothing keeps the checkpoint's tensors, which
          may map its file (``trainer.piece_files.load_file(mapped=True)``). Elsewhere a CPU tensor is
          cloned, for the same reason.
        * ``step`` goes to its parameter's device. torch moves the moments there but leaves ``step``
          where it was loaded (the CPU), as its own optimizers count steps on the host. Ours counts on
          the device (``t.add_(factor)``, no host sync): left on the CPU, the first step after a resume
          on CUDA failed with "Expected all tensors to be on the same device" (found on an H100 by
          ``sentinel verify-resume``; CPU runs cannot see it)."""
        if not self._flat_done:  # a cold resume: the state to copy into, laid out as a fresh run's
            self._init_flat()
        live = {p: dict(st) for p, st in self.state.items()}
        super().load_state_dict(state_dict)
        copies: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state.get(p)
                if not st:
                    continue
                old = live.get(p, {})
                for key, v in list(st.items()):
                    if not isinstance(v, torch.Tensor):
                        continue
                    o = old.get(key)
                    if isinstance(o, torch.Tensor) and o.shape == v.shape and o.dtype == v.dtype and o.device == p.device:
                        copies.setdefault(key, []).append((o, v))
                        st[key] = o
                    elif v.device != p.device:
                        st[key] = v.to(p.device)
                    else:
                        st[key] = v.clone()
        for pairs in copies.values():  # one copy per key where both sides are flat (trainer/flat_state.py)
            dst, src = tiled_base([o for o, _ in pairs]), tiled_base([v for _, v in pairs])
            if dst is not None and src is not None and dst.numel() == src.numel():
                dst.copy_(src)
            else:
                for o, v in pairs:
                    o.copy_(v)

    @torch.no_grad()
    def load_flat(self, plan: FlatCopy) -> None:
        """``load_state_dict`` of a file laid out as this optimizer holds its state
        (``trainer.flat_state.copy_plan``): torch's hyper-parameters (a deep copy of the file's, with
        the live parameters, as torch builds them), then one copy into each flat tensor."""
        self.param_groups = [{k: live["params"] if k == "params" else _copied(v) for k, v in saved.items()}
                             for live, saved in zip(self.param_groups, plan.param_groups)]
        for live, saved in plan.copies:
            live.copy_(saved)

    def _init_state(self, p: torch.Tensor) -> dict:
        """``p``'s state, zero; on the first call, every parameter's at once (``_init_flat``)."""
        if not self._flat_done:
            self._init_flat()
            if self.state[p]:
                return self.state[p]
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    def _init_flat(self) -> None:
        """Give every plain, contiguous parameter without state its zero state at once, as views of
        three flat tensors per device and dtype, in parameter order: ``step``, ``exp_avg``, ``exp_avg_sq``.
        The values and the update are as with a tensor each; what changes is that the checkpoint's
        format (``trainer/flat_state.py``) writes each flat tensor as it is, without a copy. Sharded
        (DTensor) parameters keep a tensor each: DCP saves those."""
        self._flat_done = True
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if type(p.data) is torch.Tensor and p.is_contiguous() and not self.state.get(p):  # .get: no empty entries
                    by_kind.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), ps in by_kind.items():
            total = sum(p.numel() for p in ps)
            steps = torch.zeros(len(ps), dtype=torch.float32, device=device)
            m = torch.zeros(total, dtype=dtype, device=device)
            v = torch.zeros(total, dtype=dtype, device=device)
            offset = 0
            for i, p in enumerate(ps):
                n = p.numel()
                self.state[p].update(step=steps[i], exp_avg=m[offset:offset + n].view(p.shape),
                                     exp_avg_sq=v[offset:offset + n].view(p.shape))
                offset += n


_IMMUTABLE = (int, float, bool, str, type(None))


def _copied(v: Any) -> Any:
    """``copy.deepcopy(v)``, without its machinery for the immutable values hyper-parameters are (a float,
    a tuple of floats): those are themselves."""
    if type(v) in _IMMUTABLE or (type(v) is tuple and all(type(x) in _IMMUTABLE for x in v)):
        return v
    return copy.deepcopy(v)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> SkipStepAdamW:
    """Weight decay on matrices only (not on norms, biases or embeddings' 1-D params)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return SkipStepAdamW(groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
