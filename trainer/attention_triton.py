"""Causal attention whose backward is deterministic: fused Triton kernels without atomics.

Why: with ``deterministic: true`` a CUDA run may use only torch's math attention, because the
flash, memory-efficient and cuDNN kernels accumulate dQ across key blocks with atomic adds, whose
order changes from run to run (``trainer/determinism.py``). The math kernel keeps the T x T matrix
and cost ``gpt2-124m`` 2.9x its step time on an H100. These kernels follow FlashAttention-2's
algorithm (tiles, an online softmax, the rows' log-sum-exp kept for the backward), and split the
backward in two passes so that every output tile has one owner:

* ``_dkdv``: a program per key block walks the query blocks at or after it (causal) and sums its
  dK and dV in registers;
* ``_dq``: a program per query block walks the key blocks up to it and sums its dQ.

No tile is written by two programs and each sums in a fixed order, so the gradients repeat bit
for bit. The price is recomputing the scores once more than a kernel with atomics does.

``attention(q, k, v)`` takes (batch, heads, T, head_dim) tensors as ``F.scaled_dot_product_attention``
does (causal, no dropout, the default scale). It needs the ``triton`` package; on the CPU it runs
under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check it against
torch's math attention without a GPU. The model uses it on CUDA when ``model.attention`` is
``triton`` (``trainer/model.py``). There the trainer's autocast hands it bfloat16; fp32 tiles, given
directly, multiply in TF32 on a GPU (``tl.dot``'s default), not in full fp32 as the math kernel does.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from trainer.config import TRITON_HEAD_SIZES


@triton.jit
def _program(s_b, s_h, n_heads, T, BLOCK: tl.constexpr):
    """This program's head (its batch x heads index), where that head's (T, D) matrices start, and
    the rows of its block (with which are inside T)."""
    bh = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return bh, (bh // n_heads) * s_b + (bh % n_heads) * s_h, offs, offs < T


@triton.jit
def _row_stats(LSE, DELTA, bh, T, offs, inside):
    """The rows' log-sum-exp (from the forward) and delta = rowsum(dO * O)."""
    return tl.load(LSE + bh * T + offs, mask=inside, other=0.0), tl.load(DELTA + bh * T + offs, mask=inside, other=0.0)


@triton.jit
def _rows(ptr, base, offs, s_t, offs_d, inside):
    """Rows ``offs`` of one head's (T, D) matrix at ``ptr + base`` (zeros past T)."""
    return tl.load(ptr + base + offs[:, None] * s_t + offs_d[None, :], mask=inside[:, None], other=0.0)


@triton.jit
def _put_rows(ptr, base, offs, s_t, offs_d, inside, x):
    tl.store(ptr + base + offs[:, None] * s_t + offs_d[None, :], x.to(ptr.dtype.element_ty), mask=inside[:, None])


@triton.jit
def _p_and_ds(q, k, v, do, lse, delta, offs_m, offs_n, in_m, in_n, scale):
    """One tile's softmax P, recomputed from its rows' log-sum-exp, and dS = P * (dO V^T - delta),
    delta = rowsum(dO * O): what every backward pass needs of a (query block, key block) pair."""
    s = tl.dot(q, tl.trans(k)) * scale
    seen = (offs_m[:, None] >= offs_n[None, :]) & in_m[:, None] & in_n[None, :]
    p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)
    return p, p * (tl.dot(do, tl.trans(v)) - delta[:, None])


@triton.jit
def _fwd(Q, K, V, OUT, LSE, scale, s_b, s_h, s_t, n_heads, T,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    bh, base, offs_m, in_m = _program(s_b, s_h, n_heads, T, BLOCK_M)  # q, k, v and the output share one layout
    offs_d = tl.arange(0, D)
    q = _rows(Q, base, offs_m, s_t, offs_d, in_m)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(0, tl.minimum((tl.program_id(0) + 1) * BLOCK_M, T), BLOCK_N):  # causal: keys up to its last query
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_n = offs_n < T
        s = tl.dot(q, tl.trans(_rows(K, base, offs_n, s_t, offs_d, in_n))) * scale
        s = tl.where((offs_m[:, None] >= offs_n[None, :]) & in_n[None, :], s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        p = tl.exp(s - new_max[:, None])
        shrink = tl.exp(row_max - new_max)
        row_sum = row_sum * shrink + tl.sum(p, 1)
        v = _rows(V, base, offs_n, s_t, offs_d, in_n)
        acc = acc * shrink[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    _put_rows(OUT, base, offs_m, s_t, offs_d, in_m, acc / row_sum[:, None])
    tl.store(LSE + bh * T + offs_m, row_max + tl.log(row_sum), mask=in_m)


@triton.jit
def _dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, scale, s_b, s_h, s_t, n_heads, T,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    bh, base, offs_n, in_n = _program(s_b, s_h, n_heads, T, BLOCK_N)
    offs_d = tl.arange(0, D)
    k = _rows(K, base, offs_n, s_t, offs_d, in_n)
    v = _rows(V, base, offs_n, s_t, offs_d, in_n)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    for start_m in range((tl.program_id(0) * BLOCK_N // BLOCK_M) * BLOCK_M, T, BLOCK_M):  # causal: queries from here on
        offs_m = start_m + tl.arange(0, BLOCK_M)
        in_m = offs_m < T
        q = _rows(Q, base, offs_m, s_t, offs_d, in_m)
        do = _rows(DO, base, offs_m, s_t, offs_d, in_m)
        lse, delta = _row_stats(LSE, DELTA, bh, T, offs_m, in_m)
        p, ds = _p_and_ds(q, k, v, do, lse, delta, offs_m, offs_n, in_m, in_n, scale)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    _put_rows(DK, base, offs_n, s_t, offs_d, in_n, dk * scale)
    _put_rows(DV, base, offs_n, s_t, offs_d, in_n, dv)


@triton.jit
def _dq(Q, K, V, DO, LSE, DELTA, DQ, scale, s_b, s_h, s_t, n_heads, T,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    bh, base, offs_m, in_m = _program(s_b, s_h, n_heads, T, BLOCK_M)
    offs_d = tl.arange(0, D)
    q = _rows(Q, base, offs_m, s_t, offs_d, in_m)
    do = _rows(DO, base, offs_m, s_t, offs_d, in_m)
    lse, delta = _row_stats(LSE, DELTA, bh, T, offs_m, in_m)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in range(0, tl.minimum((tl.program_id(0) + 1) * BLOCK_M, T), BLOCK_N):  # causal: keys up to its last query
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_n = offs_n < T
        k = _rows(K, base, offs_n, s_t, offs_d, in_n)
        _, ds = _p_and_ds(q, k, _rows(V, base, offs_n, s_t, offs_d, in_n), do, lse, delta, offs_m, offs_n, in_m, in_n, scale)
        dq += tl.dot(ds.to(k.dtype), k)
    _put_rows(DQ, base, offs_m, s_t, offs_d, in_m, dq * scale)


# warps per program. The backward's programs hold two tiles of fp32 sums (dK and dV, or dQ and its
# inputs): at 4 warps ``_dkdv`` spilled registers on sm_90 in bfloat16 with head_dim 64 (255 registers
# and 224 bytes of stack, built ahead of time with triton's own ptxas), at 8 it does not (248). The
# forward needs no more than 4 (168). tests/trainer/test_attention_triton.py builds them so, no GPU.
FWD_WARPS, BWD_WARPS = 4, 8
# multiply-adds fused (FMA), as Triton 3.9 does by default and 3.10 will not: pinned, so the bits a
# run's kernels give do not change with Triton's default
FP_FUSION = True


def _block(T: int, D: int) -> int:
    """The tile size, queries and keys alike: 64 on a GPU (tensor-core tiles; 32 for head_dim 128, to
    fit the registers), smaller for short sequences; ``tl.dot`` needs 16 at least."""
    if D not in TRITON_HEAD_SIZES:
        raise ValueError(f"head_dim {D}: the Triton attention takes a power of two from 16 to 128")
    return 16 if T <= 16 else 32 if T <= 32 or D == 128 else 64


# Two custom operators (torch.library), so that torch.compile keeps the model in one graph: the graph
# treats each as one opaque call and compiles everything around it. The autograd.Function these replace
# cost a graph break per layer; on an H200, gpt2-124m's compiled deterministic step took 245 ms against
# 260 ms without compile (the fast path's: 145 against 188 ms). Both take q, k, v (and o, dO) contiguous
# with one set of strides, unit stride along D: ``attention`` makes them so, inside the graph.
@torch.library.custom_op("sentinel::causal_attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    block = _block(T, D)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, T), device=q.device, dtype=torch.float32)
    _fwd[(triton.cdiv(T, block), B * H)](q, k, v, o, lse, 1.0 / math.sqrt(D), q.stride(0), q.stride(1), q.stride(2), H, T,
                                         BLOCK_M=block, BLOCK_N=block, D=D, num_warps=FWD_WARPS, enable_fp_fusion=FP_FUSION)
    return o, lse


@_attention_fwd.register_fake
def _(q, k, v):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("sentinel::causal_attention_bwd", mutates_args=())
def _attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, T, D = q.shape
    block = _block(T, D)
    delta = (do.float() * o.float()).sum(-1)  # rowsum(dO * O): the softmax's backward term, per row
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (1.0 / math.sqrt(D), q.stride(0), q.stride(1), q.stride(2), H, T)
    tiles = dict(BLOCK_M=block, BLOCK_N=block, D=D, num_warps=BWD_WARPS, enable_fp_fusion=FP_FUSION)
    grid = (triton.cdiv(T, block), B * H)
    _dkdv[grid](q, k, v, do, lse, delta, dk, dv, *args, **tiles)
    _dq[grid](q, k, v, do, lse, delta, dq, *args, **tiles)
    return dq, dk, dv


@_attention_bwd.register_fake
def _(q, k, v, o, lse, do):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    return _attention_bwd(q, k, v, o, lse, do.to(q.dtype).contiguous())  # the strides of q, k, v and o


_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of (batch, heads, T, head_dim) tensors, scale 1/sqrt(head_dim), no
    dropout: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, with a backward that
    repeats bit for bit."""
    if not (q.shape == k.shape == v.shape and q.dim() == 4):
        raise ValueError(f"q, k and v must share one (batch, heads, T, head_dim) shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    _block(q.shape[2], q.shape[3])  # an unsupported head size is refused here, in one line
    # contiguous: one set of (B, H, T, D) strides for all, unit stride along D (the model's q, k and v are
    # transposed views of one projection; the copies cost less than the math kernel's T x T)
    o, _ = _attention_fwd(q.contiguous(), k.contiguous(), v.contiguous())
    return o
