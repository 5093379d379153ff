"""Model FLOPs Utilisation (MFU), done the PaLM / nanoGPT way, against a peak we actually know.

MFU = achieved model FLOP/s / peak FLOP/s of the hardware. "Model" FLOPs are the FLOPs the
*model* needs per token (a fixed function of the architecture), not the FLOPs the kernels happen to
execute: activation recomputation, padding and masked-out attention work are not credited. That
makes the number comparable across implementations, which is its whole point.

Conventions (see docs/metrics.md, "MFU"):

* ``N`` = non-embedding parameters: everything in the transformer blocks plus the final norm.
  The token embedding (``wte``) and the position embedding (``wpe``) are excluded: a lookup is a
  gather, not a matmul, so it costs no FLOPs worth counting.
* The LM head *is* a matmul (``d_model x vocab`` per token), whether or not its weight is tied to
  ``wte``: ``2·d·V`` forward + ``4·d·V`` backward = ``6·d·V`` per token. Counted by default
  (``include_lm_head=True``). This equals nanoGPT's ``estimate_mfu``, which counts the tied ``wte``
  inside ``N`` and excludes only ``wpe``.
* Attention scores and the weighted sum add ``2·2·d·T`` forward FLOPs per token per layer
  (``QK^T`` and ``AV``), ×3 for forward+backward = ``12·n_layer·d_model·seq_len``. No causal
  halving by default (PaLM and nanoGPT don't halve), so numbers compare with published MFU; a
  causal flash-attention kernel executes about half of that term.

Peak FLOP/s come from a small table of dense (no 2:4 sparsity) tensor-core peaks from NVIDIA data
sheets, keyed by a substring of ``torch.cuda.get_device_name()`` and the matmul dtype. Unknown
device, CPU, or a dtype the table lacks → ``None``: MFU is then not exported at all rather than made
up. An explicit override always wins.
"""

from __future__ import annotations

# (substring of the CUDA device name, {dtype: dense peak FLOP/s}). Ordered most specific first:
# "H100 PCIe" must match before "H100", "L40S" before "L4", "A10G" before "A10".
# Sources: NVIDIA data sheets (dense tensor-core numbers; fp32 = non-tensor CUDA-core rate).
_PEAK_TABLE: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIE", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12, "fp8": 1513e12}),
    ("H100 NVL", {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12, "fp8": 1670e12}),
    ("H100", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.7e12, "fp32": 66.9e12, "fp8": 1979e12}),  # SXM
    ("H200", {"bf16": 989.5e12, "fp16": 989.5e12, "tf32": 494.7e12, "fp32": 66.9e12, "fp8": 1979e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12, "fp8": 733e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12, "fp8": 242.5e12}),
    ("A10G", {"bf16": 70e12, "fp16": 70e12, "fp32": 31.2e12}),  # AWS g5; approximate, override if known
    ("A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),  # no bf16 tensor cores: bf16 → None
    ("RTX 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),  # fp32 accumulate
    ("RTX 3090", {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),  # fp32 accumulate
)

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "tf32": "tf32",
    "fp8": "fp8", "float8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
}


def normalize_dtype(dtype: str) -> str:
    """Map ``"bfloat16"``, ``"torch.bfloat16"``, ``"bf16"`` ... to the table's short key."""
    key = str(dtype).lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


def flops_per_token(
    *,
    n_params_non_embedding: int,
    n_layer: int,
    d_model: int,
    seq_len: int,
    vocab_size: int,
    include_lm_head: bool = True,
    causal_halving: bool = False,
) -> float:
    """Training (forward + backward) model FLOPs per token.

    ``6·N  +  6·d_model·vocab (LM head)  +  12·n_layer·d_model·seq_len (attention; ×½ if halved)``.
    Defaults reproduce nanoGPT's ``estimate_mfu`` exactly (see the module docstring).
    """
    for name, v in (("n_params_non_embedding", n_params_non_embedding), ("n_layer", n_layer),
                    ("d_model", d_model), ("seq_len", seq_len), ("vocab_size", vocab_size)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    dense = 6.0 * n_params_non_embedding
    head = 6.0 * d_model * vocab_size if include_lm_head else 0.0
    attention = 12.0 * n_layer * d_model * seq_len
    if causal_halving:
        attention /= 2.0
    return dense + head + attention


def gpt_non_embedding_params(*, n_layer: int, d_model: int, bias: bool = True, mlp_ratio: int = 4) -> int:
    """Non-embedding parameters of a GPT-2-style model (pre-LN blocks with LayerNorm, final LN).

    Per block: attention ``4·d²`` (qkv + proj), MLP ``2·mlp_ratio·d²``, two LayerNorm weights ``2d``;
    with bias also the qkv/proj/fc/proj biases ``(3 + 1 + mlp_ratio + 1)·d`` and LN biases ``2d``.
    Plus the final LayerNorm. For a model that differs, count its parameters instead
    (:func:`count_non_embedding_params`).
    """
    d = d_model
    per_block = (4 + 2 * mlp_ratio) * d * d + 2 * d
    final_ln = d
    if bias:
        per_block += (3 + 1 + mlp_ratio + 1) * d + 2 * d
        final_ln += d
    return n_layer * per_block + final_ln


def count_non_embedding_params(model) -> int:
    """Parameters of ``model`` that are not owned by an ``nn.Embedding`` (tied weights count once).

    A tied LM head shares the embedding's weight, so it is excluded here and counted by
    :func:`flops_per_token` through ``include_lm_head`` instead.
    """
    import torch  # lazy: this module is imported by code paths that never touch torch

    embedding_params = {
        id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters(recurse=False)
    }
    return sum(p.numel() for p in model.parameters() if id(p) not in embedding_params)


def peak_flops(device_name: str | None, dtype: str, override: float | None) -> float | None:
    """Dense peak FLOP/s of one device for matmuls in ``dtype``, or ``None`` when unknown.

    ``override`` (e.g. from the config) wins. ``device_name`` is what
    ``torch.cuda.get_device_name()`` returns; ``None`` or a CPU yields ``None`` without an override:
    a CPU has no meaningful tensor-core peak and we'd rather export no MFU than a made-up one.
    """
    if override is not None:
        if not override > 0:
            raise ValueError(f"peak FLOP/s override must be > 0, got {override}")
        return float(override)
    if not device_name:
        return None
    name = device_name.upper()
    if name.startswith("CPU"):
        return None
    key = normalize_dtype(dtype)
    for substring, peaks in _PEAK_TABLE:
        if substring in name:
            return peaks.get(key)
    return None


def mfu(tokens_per_second: float, flops_per_token: float, peak: float, world_size: int) -> float:
    """Fraction of the cluster's peak used by the model: ``tps · fpt / (peak · world_size)``.

    ``tokens_per_second`` is the *global* throughput (all ranks) and ``peak`` is *per device*.
    """
    if not peak > 0:
        raise ValueError(f"peak must be > 0, got {peak}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return tokens_per_second * flops_per_token / (peak * world_size)
