"""On CUDA, the pieces the first H200 pass changed (docs/benchmarks/checkpoint-cost.md, "On a GPU"):
our attention in bfloat16 against torch's math kernel and under ``torch.compile``, the fused optimizer
update's skip, and a sync save's staging of GPU tensors. The CPU suite checks each of them on the CPU
(the interpreter, ``fused=True``, ``HostStage("cpu")``); these check them where they run.

Needs a CUDA device: skipped on CPU-only machines (CI), run on a GPU machine with
``pytest tests/trainer/test_cuda_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU suite checks each on the CPU)")


def test_our_attention_in_bf16_matches_math_repeats_and_compiles_to_the_same_bits():
    """gpt2-124m's shapes cut to 2 x 12 x 1024 x 64: the gradients within flash's error of float32 math
    (3.9e-3 of the largest on an H200; 1e-2 allowed), the same bits on a second pass, and the same bits
    from a layer compiled with ``fullgraph=True`` (custom operators: one graph, the kernels as they are)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.attention_triton import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(2, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))

    def grads(fn, *xs):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        fn(*xs).backward(dout.to(xs[0].dtype))
        return torch.cat([x.grad.float().flatten() for x in xs])

    with sdpa_kernel([SDPBackend.MATH]):
        ref = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q.float(), k.float(), v.float())
    ours = grads(attention, q, k, v)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-2
    assert torch.equal(ours, grads(attention, q, k, v))
    compiled = torch.compile(lambda a, b, c: attention(a, b, c), fullgraph=True)
    assert torch.equal(ours, grads(compiled, q, k, v))


def test_the_fused_update_on_cuda_skips_bit_for_bit_and_follows_the_loop():
    from trainer.optim import SkipStepAdamW

    torch.manual_seed(0)
    shapes = [(256, 64), (64,), (33, 7)]
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    fused, loop = SkipStepAdamW(ps, weight_decay=0.1), SkipStepAdamW(twins, weight_decay=0.1, fused=False)
    assert fused.fused is None  # on CUDA by default
    for i in range(20):
        grads = [torch.randn_like(p) for p in ps]
        skip = i % 4 == 2
        if skip:
            grads[1][5] = float("nan")
        for a, b, gr in zip(ps, twins, grads):
            a.grad, b.grad = gr.clone(), gr.clone()
        before = [p.detach().clone() for p in ps] + [t.clone() for st in fused.state.values() for t in st.values()]
        factor = torch.tensor(0.0 if skip else 1.0, device="cuda")
        fused.step(1e-2, factor)
        loop.step(1e-2, factor)
        if skip and i > 2:
            after = [p.detach() for p in ps] + [t for st in fused.state.values() for t in st.values()]
            assert all(torch.equal(x, y) for x, y in zip(before, after))
    for a, b in zip(ps, twins):
        assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=0, atol=1e-5)


def test_a_sync_saves_stage_copies_gpu_tensors_once_into_kept_pinned_buffers():
    from trainer.checkpoint_thread import HostStage

    emb = torch.randn(100, 16, device="cuda")
    state = {"wte": emb, "lm_head": emb, "ln": torch.randn(16, device="cuda"), "step": 3}
    stage = HostStage()
    shared, _ = stage.stage(state, {})
    assert shared["wte"] is shared["lm_head"] and shared["wte"].device.type == "cpu" and shared["wte"].is_pinned()
    assert torch.equal(shared["wte"], emb.cpu()) and shared["step"] == 3
    ptrs = [b.data_ptr() for b in stage.buffers]
    emb.mul_(2)
    again, _ = stage.stage(state, {})
    assert [b.data_ptr() for b in stage.buffers] == ptrs and torch.equal(again["wte"], emb.cpu())
