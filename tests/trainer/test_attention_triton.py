"""``trainer/attention_triton.py``, the fused causal attention whose backward repeats bit for bit, run
on the CPU by Triton's interpreter: its output and its gradients against torch's math attention,
across shapes that end inside a tile, and the same gradients on every pass. On a GPU the same
kernels are compiled; the last test builds them for sm_90 ahead of time, without a GPU, and checks
that they spill no registers; their speed is ``bench/determinism_cost.py``'s to measure.

The interpreter is chosen when triton is imported (``TRITON_INTERPRET=1``: its own ``tl.max`` and
``tl.sum`` are kernels too), so one child process runs every case of the tables below, and each
test reads its case's result. bfloat16 is not checked here: the interpreter multiplies bfloat16
tiles wrongly (a 16 x 16 ``tl.dot`` of bfloat16 came out ~1e10 off), which a GPU does in hardware."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.services import skip_or_fail

ROOT = Path(__file__).resolve().parents[2]

# (batch, heads, T, head_dim): tiles of 16, 32 and 64; T inside one tile, across several, ending mid-tile
SHAPES = [(1, 1, 5, 16), (2, 3, 40, 16), (1, 2, 64, 32), (1, 1, 17, 16), (2, 2, 128, 64), (1, 2, 100, 64),
          (1, 1, 33, 128)]
DTYPES = {"fp32": 1e-5, "fp16": 3e-3}  # the largest relative error allowed (of the norm, against fp32 math)
BAD = {  # shapes it cannot take: (q, k) -> what the one-line error says
    "k-longer": ((1, 1, 8, 16), (1, 1, 9, 16), "share one"),
    "not-4d": ((8, 16), (8, 16), "share one"),
    "head-24": ((1, 1, 8, 24), (1, 1, 8, 24), "power of two"),
    "head-256": ((1, 1, 8, 256), (1, 1, 8, 256), "power of two"),
}


def _cases() -> dict:  # in the child, under the interpreter
    import torch
    import torch.nn.functional as F

    from trainer.attention_triton import attention

    def run(fn, q, k, v, dout):
        q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = fn(q, k, v)
        out.backward(dout)
        return [out.detach(), q.grad, k.grad, v.grad]

    out: dict = {}
    for shape in SHAPES:
        B, H, T, D = shape
        for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
            g = torch.Generator().manual_seed(sum(shape))
            qkv = torch.randn(B, T, 3 * H * D, generator=g).to(dtype)  # as the model hands them over: views
            q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
            dout = torch.randn(B, H, T, D, generator=g).to(dtype)
            got = run(attention, q, k, v, dout)
            want = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                       q.float(), k.float(), v.float(), dout.float())
            errors = {n: ((a.float() - b).norm() / b.norm()).item() for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
            same = all(all(torch.equal(a, b) for a, b in zip(run(attention, q, k, v, dout), got)) for _ in range(2))
            out[f"{name}-{'x'.join(map(str, shape))}"] = {"errors": errors, "bitwise": same,
                                                         "dtypes": sorted({str(t.dtype) for t in got})}
    # torch.compile keeps it in one graph (custom operators, not a graph break per layer): traced with
    # fullgraph=True, forward and backward through AOT autograd, the same bits as eagerly
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(3))
    dout = torch.randn(2, 2, 40, 16, generator=g)
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    layer = lambda a, b, c: attention(a * 1.5, b, c) * 2  # noqa: E731  (ops on both sides of it, in the graph)
    eager = run(layer, q, k, v, dout)
    traced = run(torch.compile(layer, backend=count, fullgraph=True), q, k, v, dout)
    aot = run(torch.compile(layer, backend="aot_eager", fullgraph=True), q, k, v, dout)
    out["compiled"] = {"graphs": len(graphs), "same_bits": all(torch.equal(a, b) for a, b in zip(eager, traced)),
                       "aot_same_bits": all(torch.equal(a, b) for a, b in zip(eager, aot))}
    for name, (qs, ks, _) in BAD.items():
        try:
            attention(torch.zeros(qs), torch.zeros(ks), torch.zeros(ks))
            out[name] = "accepted"
        except ValueError as e:
            out[name] = str(e)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    try:
        import triton  # noqa: F401
    except ImportError:
        skip_or_fail("the triton package (the test extra installs it)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_matches_torch_attention_and_repeats_bit_for_bit(results, shape, dtype):
    """Output, dQ, dK and dV as torch's causal ``scaled_dot_product_attention`` computes them in fp32,
    from q, k and v laid out as the model hands them over (transposed views of one projection), in
    the inputs' dtype; and three passes give the same bits."""
    r = results[f"{dtype}-{'x'.join(map(str, shape))}"]
    assert r["dtypes"] == [{"fp32": "torch.float32", "fp16": "torch.float16"}[dtype]]
    assert all(err < DTYPES[dtype] for err in r["errors"].values()), r["errors"]
    assert r["bitwise"], "a second pass gave other bits"


def test_torch_compile_traces_it_in_one_graph_with_the_same_bits(results):
    """``torch.compile(fullgraph=True)`` of a layer around it: one graph (a graph break would raise), and
    the output and the three gradients as the eager call gives them, bit for bit, with Dynamo alone and
    with AOT autograd's traced backward."""
    assert results["compiled"] == {"graphs": 1, "same_bits": True, "aot_same_bits": True}, results["compiled"]


@pytest.mark.parametrize("case", sorted(BAD))
def test_shapes_it_cannot_take_are_one_line_errors(results, case):
    assert BAD[case][2] in results[case] and "\n" not in results[case], results[case]


SM90_SHARED_BYTES = 227 * 1024  # the most shared memory one program may take on an H100 / H200


@pytest.mark.parametrize("head_dim", [64, 128])  # gpt2-124m's, and the largest the launcher takes
def test_the_kernels_build_for_hopper_without_spilling_registers(head_dim):
    """Ahead of time, without a GPU: triton's compiler and the ptxas it ships build each kernel for
    sm_90 (H100, H200) in bfloat16, at the tile size and warps the launcher uses for a long sequence.
    ``cuobjdump`` then reports no stack (registers spilled to local memory slow a kernel several
    fold), and each takes shared memory an SM has. The interpreter above checks what they compute;
    this checks that a GPU can run them as built."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        skip_or_fail("the triton package (the test extra installs it)")
    import shutil
    import tempfile

    from trainer import attention_triton as at

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists() and not shutil.which("cuobjdump"):
        skip_or_fail("cuobjdump (triton's NVIDIA backend ships it)")
    block = at._block(1024, head_dim)
    kernels = {at._fwd: ("Q K V OUT", at.FWD_WARPS), at._dkdv: ("Q K V DO DK DV", at.BWD_WARPS),
               at._dq: ("Q K V DO DQ", at.BWD_WARPS)}
    for kernel, (tensors, warps) in kernels.items():
        signature = {n: "constexpr" if n in ("BLOCK_M", "BLOCK_N", "D") else "*fp32" if n in ("LSE", "DELTA")
                     else "fp32" if n == "scale" else "*bf16" if n in tensors.split() else "i32" for n in kernel.arg_names}
        built = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs={"BLOCK_M": block, "BLOCK_N": block, "D": head_dim}),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "enable_fp_fusion": at.FP_FUSION})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(built.asm["cubin"])
            f.flush()
            usage = subprocess.run([str(cuobjdump) if cuobjdump.exists() else "cuobjdump", "-res-usage", f.name],
                                   capture_output=True, text=True, check=True).stdout
        fields = dict(kv.split(":", 1) for line in usage.splitlines() if "REG:" in line for kv in line.split() if ":" in kv)
        assert fields and fields["STACK"] == "0" and fields["LOCAL"] == "0", (kernel.__name__, usage)
        assert int(fields["REG"]) <= 255 and built.metadata.shared <= SM90_SHARED_BYTES, (kernel.__name__, usage, built.metadata.shared)


if __name__ == "__main__":
    print(json.dumps(_cases()))
