"""What ``deterministic: true`` switches on: bitwise-reproducible numerics, for the trainer and the
offline tools (replay-batch, verify-resume) alike, so a resumed or replayed step computes exactly
what the original did."""

from __future__ import annotations

import os

import torch


def make_deterministic(device_type: str) -> None:
    """Deterministic kernels everywhere torch has them, and on CUDA no attention kernel whose
    backward is not deterministic.

    - ``torch.use_deterministic_algorithms(True, warn_only=True)``: deterministic variants where
      they exist (embedding backward, scatter/index ops); a warning, not an error, for an op with
      none, so a run never dies of it. Without its NaN fill of uninitialised memory.
    - ``CUBLAS_WORKSPACE_CONFIG``: cuBLAS picks the same reduction order every call.
    - Scaled-dot-product attention on CUDA: the flash, memory-efficient and cuDNN kernels all
      accumulate their backward with atomics. Measured on an H100 at gpt2-124m's shapes (bf16,
      16 x 12 heads x 1024 x 64, causal): seven identical forward+backward passes gave different
      gradients with each of the three, the same with the math kernel; and a run resumed from a
      checkpoint parted from the original at the first step (``sentinel verify-resume``: loss and
      grad norm equal, parameter digest not). So the math kernel is the only one left on. It is
      slower (9.1 ms against 0.95 ms for flash per layer's forward+backward at those shapes) and
      keeps the T x T attention matrix: docs/benchmarks.md has what it costs a whole step, and
      ``deterministic: false`` gives the fast kernels back (resumes then match within tolerance,
      not bit for bit). ``model.attention: triton`` replaces it with our fused kernels, whose
      backward has no atomics (``trainer/attention_triton.py``). The CPU kernels are deterministic
      and stay as they are.
    """
    torch.use_deterministic_algorithms(True, warn_only=True)
    # which torch pairs with filling every torch.empty with NaN, a debugging aid against reads of
    # uninitialised memory; it changes no result of code that writes before it reads, and it cost
    # ~2,900 fill kernels and ~21 ms a step of gpt2-124m on an H200 (docs/benchmarks/checkpoint-cost.md, "On a GPU")
    torch.utils.deterministic.fill_uninitialized_memory = False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if device_type == "cuda":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
