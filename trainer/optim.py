"""AdamW whose whole update can be cancelled by a 0/1 tensor on the device, plus the LR schedule.

Why our own AdamW: the in-process guard decides *on the device* whether a step is healthy. To skip a
bad update without a host sync, the decision must scale everything the step touches — the moments,
the decoupled weight decay, the parameter update and the step count — the way OLMo-core's skip-step
optimizer does. A skipped step leaves the optimizer state bit-for-bit as it was. Non-finite
gradients are masked with ``where`` (``nan * 0`` is still NaN).
"""

from __future__ import annotations

import math

import torch

from trainer.config import OptimConfig


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

    def __init__(self, params, *, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0):
        super().__init__(params, dict(betas=betas, eps=eps, weight_decay=weight_decay))

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

    def load_state_dict(self, state_dict: dict) -> None:
        """Load as torch does, then give every state tensor memory of its own, on its parameter's device.

        * Where this optimizer already holds a moment of the same shape and dtype (an in-process
          rollback), the loaded values are copied into it: no fresh memory, and nothing keeps the
          checkpoint's tensors, which may map its file (``trainer.checkpoint.load_torch(mmap=True)``).
          Elsewhere a CPU tensor is cloned, for the same reason.
        * ``step`` goes to its parameter's device. torch moves the moments there but leaves ``step``
          where it was loaded (the CPU), as its own optimizers count steps on the host. Ours counts on
          the device (``t.add_(factor)``, no host sync): left on the CPU, the first step after a resume
          on CUDA failed with "Expected all tensors to be on the same device" (found on an H100 by
          ``sentinel verify-resume``; CPU runs cannot see it)."""
        live = {p: dict(st) for p, st in self.state.items()}
        super().load_state_dict(state_dict)
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
                        st[key] = o.copy_(v)
                    elif v.device != p.device:
                        st[key] = v.to(p.device)
                    else:
                        st[key] = v.clone()

    def _init_state(self, p: torch.Tensor) -> dict:
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st


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
