"""MFU formula against a hand calculation for GPT-2 124M, and the peak-FLOP/s table."""

from __future__ import annotations

import pytest

from trainer.telemetry.mfu import (
    count_non_embedding_params,
    flops_per_token,
    gpt_non_embedding_params,
    mfu,
    normalize_dtype,
    peak_flops,
)

# GPT-2 124M (nanoGPT "gpt2"): 12 layers, d_model 768, 12 heads, vocab 50257, context 1024, biases on.
L, D, V, T = 12, 768, 50257, 1024


def test_gpt2_non_embedding_params_by_hand():
    # One block:
    #   ln_1            weight + bias                    2·768            =      1,536
    #   attn.c_attn     768×2304 + 2304                                   =  1,771,776
    #   attn.c_proj     768×768  + 768                                    =    590,592
    #   ln_2            weight + bias                    2·768            =      1,536
    #   mlp.c_fc        768×3072 + 3072                                   =  2,362,368
    #   mlp.c_proj      3072×768 + 768                                    =  2,360,064
    #   block total     12·768² + 13·768 = 7,077,888 + 9,984              =  7,087,872
    # 12 blocks = 85,054,464; + ln_f (2·768 = 1,536)                      = 85,056,000
    block = 1_536 + 1_771_776 + 590_592 + 1_536 + 2_362_368 + 2_360_064
    assert block == 12 * D * D + 13 * D == 7_087_872
    assert gpt_non_embedding_params(n_layer=L, d_model=D) == 12 * block + 1_536 == 85_056_000
    # + wte 50257·768 = 38,597,376 + wpe 1024·768 = 786,432 → the well-known 124,439,808 total
    assert 85_056_000 + V * D + T * D == 124_439_808


def test_gpt2_flops_per_token_by_hand():
    n = 85_056_000
    # 6·N                 = 6 · 85,056,000            = 510,336,000
    # LM head 6·d·V       = 6 · 768 · 50,257          = 231,584,256
    # attention 12·L·d·T  = 12 · 12 · 768 · 1,024     = 113,246,208
    # total                                           = 855,166,464
    assert 6 * n == 510_336_000
    assert 6 * D * V == 231_584_256
    assert 12 * L * D * T == 113_246_208
    fpt = flops_per_token(n_params_non_embedding=n, n_layer=L, d_model=D, seq_len=T, vocab_size=V)
    assert fpt == 855_166_464
    # equals nanoGPT's estimate_mfu: 6·(N incl. tied wte, excl. wpe) + 12·L·H·Q·T
    assert fpt == 6 * (124_439_808 - T * D) + 12 * L * 12 * (D // 12) * T
    # variants
    assert flops_per_token(n_params_non_embedding=n, n_layer=L, d_model=D, seq_len=T, vocab_size=V,
                           include_lm_head=False) == 510_336_000 + 113_246_208
    assert flops_per_token(n_params_non_embedding=n, n_layer=L, d_model=D, seq_len=T, vocab_size=V,
                           causal_halving=True) == 510_336_000 + 231_584_256 + 56_623_104


def test_mfu_by_hand():
    # 1,000,000 tokens/s (global) on 8 × A100 bf16 (312e12 each):
    # 855,166,464 · 1e6 / (8 · 312e12) = 8.55166464e14 / 2.496e15 = 0.342614769...
    got = mfu(1_000_000, 855_166_464, 312e12, 8)
    assert got == pytest.approx(0.3426147692307692, rel=1e-12)
    # one H100 SXM at 400k tok/s: 3.420665856e14 / 9.895e14 = 0.345696...
    assert mfu(400_000, 855_166_464, 989.5e12, 1) == pytest.approx(0.3456964, rel=1e-6)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 0.0, 1)
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, 1e12, 0)


@pytest.mark.parametrize(
    "name,dtype,want",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
        ("NVIDIA H100 PCIe", "bfloat16", 756e12),
        ("NVIDIA H100 NVL", "bf16", 835e12),
        ("NVIDIA H200", "torch.bfloat16", 989.5e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA A100-PCIE-40GB", "float16", 312e12),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156e12),
        ("NVIDIA L4", "bf16", 121e12),
        ("NVIDIA L40S", "bf16", 362.05e12),
        ("NVIDIA A10G", "bf16", 70e12),
        ("NVIDIA A10", "bf16", 125e12),
        ("Tesla V100-SXM2-16GB", "fp16", 125e12),
        ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 tensor cores: no made-up number
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
        ("Some Future GPU", "bf16", None),
        ("cpu", "bf16", None),
        (None, "bf16", None),
    ],
)
def test_peak_flops_table(name, dtype, want):
    assert peak_flops(name, dtype, None) == want


def test_peak_flops_override_wins():
    assert peak_flops(None, "fp32", 1.5e12) == 1.5e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16", 1e15) == 1e15
    with pytest.raises(ValueError):
        peak_flops("cpu", "bf16", 0.0)


def test_normalize_dtype():
    assert normalize_dtype("torch.bfloat16") == normalize_dtype("bf16") == "bf16"
    assert normalize_dtype("half") == "fp16" and normalize_dtype("float32") == "fp32"


def test_count_non_embedding_params_excludes_tied_embedding():
    torch = pytest.importorskip("torch")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(50, 8)
            self.wpe = torch.nn.Embedding(16, 8)
            self.block = torch.nn.Linear(8, 8)  # 72
            self.ln_f = torch.nn.LayerNorm(8)  # 16
            self.lm_head = torch.nn.Linear(8, 50, bias=False)
            self.lm_head.weight = self.wte.weight  # tied: counted once, as an embedding

    assert count_non_embedding_params(Tiny()) == 72 + 16
