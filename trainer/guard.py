"""In-process step guard: skip the update when loss or grad norm is non-finite or a robust outlier.

Everything stays on the device (no host sync): the verdict is a 0/1 tensor that the optimizer
multiplies into the update. Two lessons from OLMo-core's skip-step optimizer:
- the statistics are part of the checkpoint (``state_dict``), so a resumed run decides identically;
- a rejected step never enters the window, so one spike cannot inflate the baseline and hide the next.

The baseline is robust: median and MAD (scaled to sigma) over the last ``window`` accepted steps.
"""

from __future__ import annotations

import torch

from trainer.config import GuardConfig

# reason codes (device int): 0 ok, 1 non-finite, 2 loss spike, 3 grad spike, 4 forced by a fault/directive
REASONS = {0: None, 1: "nonfinite", 2: "loss_spike", 3: "grad_spike", 4: "directive"}
MAD_TO_SIGMA = 1.4826


class StepGuard:
    def __init__(self, cfg: GuardConfig, device: torch.device):
        self.cfg = cfg
        self.loss = torch.zeros(cfg.window, dtype=torch.float32, device=device)
        self.grad = torch.zeros(cfg.window, dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # accepted steps seen (capped by use)
        self.streak = torch.zeros((), dtype=torch.int64, device=device)  # outlier skips in a row

    def _outlier(self, buf: torch.Tensor, n: torch.Tensor, x: torch.Tensor, z: float) -> torch.Tensor:
        # masked median/MAD over the filled part of the ring buffer, computed without leaving the device
        w = buf.numel()
        valid = torch.arange(w, device=buf.device) < n.clamp(max=w)
        big = torch.finfo(buf.dtype).max
        filled = torch.where(valid, buf, torch.full_like(buf, big))
        srt, _ = torch.sort(filled)
        k = (n.clamp(max=w, min=1) - 1) // 2
        med = srt.gather(0, k.view(1)).squeeze(0)
        dev = torch.where(valid, (buf - med).abs(), torch.full_like(buf, big))
        dsrt, _ = torch.sort(dev)
        mad = dsrt.gather(0, k.view(1)).squeeze(0)
        sigma = torch.clamp(mad * MAD_TO_SIGMA, min=1e-3 * med.abs() + 1e-6)
        return x > med + z * sigma

    def check(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (factor, reason): factor is 1.0 to apply the update, 0.0 to skip it."""
        loss = loss.detach().float()
        grad_norm = grad_norm.detach().float()
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        reason = torch.where(finite, 0, 1)
        if self.cfg.enabled:
            warm = self.count >= self.cfg.min_history
            loss_bad = finite & warm & self._outlier(self.loss, self.count, loss, self.cfg.loss_z)
            grad_bad = finite & warm & self._outlier(self.grad, self.count, grad_norm, self.cfg.grad_z)
            # a level that persists is not a spike: after max_consecutive_skips outliers in a row, accept
            # it and rebuild the window from the new level (whether that level is damage worth a
            # rollback is the sentinel's call, not the guard's)
            give_up = self.streak >= self.cfg.max_consecutive_skips
            reason = torch.where(loss_bad & ~give_up, 2, reason)
            reason = torch.where(grad_bad & ~loss_bad & ~give_up, 3, reason)
            rebaseline = (loss_bad | grad_bad) & give_up
            self.count.copy_(torch.where(rebaseline, torch.zeros_like(self.count), self.count))
            outlier = (reason == 2) | (reason == 3)
            self.streak.copy_(torch.where(outlier, self.streak + 1, torch.zeros_like(self.streak)))
        ok = reason == 0
        # accepted values enter the ring buffer; rejected ones never do
        idx = (self.count % self.loss.numel()).view(1)
        self.loss.index_put_((idx,), torch.where(ok, loss, self.loss[idx]).view(1))
        self.grad.index_put_((idx,), torch.where(ok, grad_norm, self.grad[idx]).view(1))
        self.count.add_(ok.to(torch.int64))
        return ok.to(torch.float32), reason

    def rebaseline(self) -> None:
        """Forget the baseline (on the device, no sync): the next ``min_history`` accepted steps build a
        new one. For a planned change of the loss level: a new sequence length or mixture."""
        self.count.zero_()
        self.streak.zero_()

    def state_dict(self) -> dict:
        return {
            "window": self.loss.numel(),
            "loss": self.loss.cpu().tolist(),
            "grad": self.grad.cpu().tolist(),
            "count": int(self.count.item()),
            "streak": int(self.streak.item()),
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd["window"] != self.loss.numel():
            raise ValueError(f"guard window changed ({sd['window']} -> {self.loss.numel()}); cannot resume exactly")
        self.loss.copy_(torch.as_tensor(sd["loss"], dtype=torch.float32))  # a list, or a tensor (``GuardPiece.check``)
        self.grad.copy_(torch.as_tensor(sd["grad"], dtype=torch.float32))
        self.count.fill_(int(sd["count"]))
        self.streak.fill_(int(sd.get("streak", 0)))
