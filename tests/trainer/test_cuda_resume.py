"""On CUDA, a resumed run is bitwise the run that never stopped (``sentinel verify-resume``).

The CPU suite proves exact resume on gloo; a GPU adds what a CPU cannot show: optimizer state that
torch loads onto the host (the step counts), bf16 autocast, cuBLAS and the attention kernels. One
GPU cannot run a sharded (FSDP2, NCCL) resume: that needs a machine with two. The resume test trains a
tiny run on the GPU with a checkpoint every 4 steps, then resumes from step 4 in process and
compares 4 steps with the step log: loss, grad norm, guard verdict, batch fingerprint and the
parameter digest (``==``: a digest has no tolerance).

Needs a CUDA device: skipped on CPU-only machines (CI), run on a GPU machine with
``pytest tests/trainer/test_cuda_resume.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU suite covers resume on gloo)")


def test_a_run_resumed_on_cuda_is_bitwise_equivalent(tmp_path):
    from sentinel.cli import main as cli
    from trainer.data import ensure_prepared

    data, run = ensure_prepared(tmp_path / "data"), tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer", "--preset", "tiny", "--run-dir", str(run), "--max-steps", "12", "--ckpt-every", "4",
           "--telemetry", "off", "--data", str(data), "--device", "cuda", "--set", "model.dropout=0.1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    r = CliRunner().invoke(cli, ["verify-resume", str(run), "--from-step", "4", "--steps", "4", "--json"])
    assert r.exit_code == 0, r.output[-3000:]
    res = json.loads(r.stdout)
    assert res["equivalent"] is True and res["first_divergence"] is None and res["steps"] == 4
    assert all(row["mismatch"] == [] for row in res["rows"])


def test_attention_backward_is_bitwise_repeatable_once_deterministic(numerics_flags):
    """At gpt2-124m's attention shapes (bf16, 16 x 12 heads x 1024 x 64, causal) the fused kernels'
    backward differs from pass to pass (measured on an H100: flash, memory-efficient and cuDNN
    alike), and a resumed gpt2-124m run parted from the original at its first step. The tiny
    presets above are too small to show it. ``make_deterministic("cuda")`` must leave only a
    kernel whose gradients repeat bit for bit."""
    import torch.nn.functional as F

    from trainer.determinism import make_deterministic

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(16, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(16, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=g)

    def grads() -> torch.Tensor:
        for t in (q, k, v):
            t.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
        return torch.cat([t.grad.flatten() for t in (q, k, v)])

    make_deterministic("cuda")
    first = grads()
    assert all(torch.equal(first, grads()) for _ in range(4))
