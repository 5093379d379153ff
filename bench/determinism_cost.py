"""What do bitwise-reproducible steps (``deterministic: true``) cost, and why are they needed?

    python3 bench/determinism_cost.py [--preset gpt2-124m] [--device cuda] [--steps 40] [--pairs 2] [--compile]
                                      [--det-attention math|triton] [--json-out FILE]

Two parts, both on the machine it runs on (a GPU for the figures in docs/benchmarks.md, "On an H100"):

1. **Attention kernels.** At the preset's attention shapes (micro-batch x heads x seq_len x head
   dim, bf16 on CUDA, float32 on CPU, causal), each scaled-dot-product-attention kernel the device
   has runs forward+backward ``--repeats`` times on the same inputs: do the gradients repeat bit
   for bit, and how long does one pass take? (On an H100 only the math kernel repeated, which is
   why ``trainer/determinism.py`` leaves only it on for CUDA.)
2. **Training A/B.** The same run with ``--set deterministic=true`` and ``=false``, alternating
   which goes first in each pair, each a fresh ``python -m trainer`` subprocess (no checkpoints,
   no evals, no bus). Steady-state tokens/s from the step log's timestamps (the first
   ``--warmup`` steps dropped, as ``bench/telemetry_overhead.py`` does) and the median MFU the
   trainer exported (on CUDA, against its device table's peak). ``--compile``: both arms with
   ``torch.compile`` (``python -m trainer --compile``); the compilation falls in the warm-up steps.
   ``--det-attention triton``: the deterministic arm runs our fused attention
   (``model.attention: triton``, ``trainer/attention_triton.py``) instead of torch's math kernel;
   the target is a deterministic run at >= 0.8x the fast one's throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from telemetry_overhead import machine, steady_throughput  # noqa: E402


def kernel_probe(preset: str, device: str, repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainer.config import resolve

    cfg = resolve(preset=preset)
    m = cfg.model
    shape = (cfg.data.micro_batch_size, m.n_head, m.seq_len, m.d_model // m.n_head)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(*shape, device=device, dtype=dtype, generator=g)
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]
    if device != "cuda":
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.use_deterministic_algorithms(True, warn_only=True)

    def grads(backend) -> torch.Tensor:
        for t in (q, k, v):
            t.grad = None
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
        return torch.cat([t.grad.flatten() for t in (q, k, v)])

    def ours(_) -> torch.Tensor:  # trainer/attention_triton.py: fused, no atomics in its backward
        from trainer.attention_triton import attention

        for t in (q, k, v):
            t.grad = None
        attention(q, k, v).backward(dout)
        return torch.cat([t.grad.flatten() for t in (q, k, v)])

    # the yardstick of every kernel's gradients: torch's math kernel in float32 on the same inputs
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        F.scaled_dot_product_attention(q32, k32, v32, is_causal=True).backward(dout.float())
    ref = torch.cat([t.grad.flatten() for t in (q32, k32, v32)])
    del q32, k32, v32

    kernels = [(b.name.lower(), grads, b) for b in backends]
    if device == "cuda":
        kernels.append(("triton (ours)", ours, None))
    rows = []
    for name, run, backend in kernels:
        try:
            first = run(backend)
            same = all(torch.equal(first, run(backend)) for _ in range(repeats - 1))
            err = float((first.float() - ref).abs().max() / ref.abs().max())
            sync()
            t = time.perf_counter()
            for _ in range(10):
                run(backend)
            sync()
            rows.append({"kernel": name, "repeats_bitwise": same, "forward_backward_ms": (time.perf_counter() - t) * 100,
                         "grad_error_vs_fp32_math": err})
        except Exception as e:  # not available for this device, dtype or shape (or our kernel failing to build)
            rows.append({"kernel": name, "unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"})
    return rows


def train_once(args, deterministic: bool, workdir: Path, index: int) -> dict:
    run_dir = workdir / f"run-{index:02d}-{'det' if deterministic else 'fast'}"
    cmd = [sys.executable, "-m", "trainer", "--preset", args.preset, "--run-dir", str(run_dir), "--max-steps", str(args.steps),
           "--eval-every", "0", "--ckpt-every", "0", "--device", args.device, "--set", f"deterministic={str(deterministic).lower()}"]
    if args.data:
        cmd += ["--data", args.data]
    if args.compile:
        cmd.append("--compile")
    if deterministic and args.det_attention == "triton":
        cmd += ["--set", "model.attention=triton"]
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:  # reported, and the other arm still runs: a failed arm is a finding too
        print(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-3000:]}", file=sys.stderr, flush=True)
        return {"deterministic": deterministic, "failed": proc.returncode, "log_tail": proc.stdout[-3000:]}
    out = steady_throughput(run_dir / "steps.jsonl", args.warmup)
    recs = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    mfus = [r["mfu"] for r in recs if r.get("kind") == "step" and r["step"] > args.warmup and r.get("mfu") is not None]
    out.update(deterministic=deterministic, mfu=statistics.median(mfus) if mfus else None)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2-124m", choices=["tiny", "small", "gpt2-124m"])
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run (default 40)")
    p.add_argument("--warmup", type=int, default=10, help="leading steps excluded (default 10)")
    p.add_argument("--pairs", type=int, default=2, help="deterministic/fast pairs (default 2)")
    p.add_argument("--repeats", type=int, default=7, help="forward+backward passes per attention kernel (default 7)")
    p.add_argument("--data", help="prepared dataset dir (default: the bundled Shakespeare corpus)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in both arms (MFU with compile)")
    p.add_argument("--det-attention", choices=["math", "triton"], default="math",
                   help="the deterministic arm's attention: torch's math kernel, or ours (trainer/attention_triton.py)")
    p.add_argument("--json-out", metavar="FILE", help="also write the result as JSON to FILE")
    args = p.parse_args(argv)
    if args.steps < args.warmup + 2 or args.pairs < 1 or args.repeats < 2:
        p.error("need --steps >= --warmup + 2, --pairs >= 1 and --repeats >= 2")

    kernels = kernel_probe(args.preset, args.device, args.repeats)
    for r in kernels:
        if "unavailable" in r:
            print(f"attention {r['kernel']:<20} unavailable: {r['unavailable']}")
        else:
            print(f"attention {r['kernel']:<20} repeats bit for bit: {r['repeats_bitwise']!s:<5}  "
                  f"forward+backward {r['forward_backward_ms']:.2f} ms  "
                  f"gradient error vs float32 math {r['grad_error_vs_fp32_math']:.1e}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="determinism-bench-") as tmp:
        for i in range(args.pairs):
            for det in ((True, False) if i % 2 == 0 else (False, True)):
                r = train_once(args, det, Path(tmp), i)
                runs.append(r)
                if "failed" in r:
                    print(f"pair {i + 1}/{args.pairs} deterministic={str(det).lower():<5}  failed ({r['failed']})", flush=True)
                    continue
                mfu = f"{r['mfu']:.4f}" if r["mfu"] is not None else "-"
                print(f"pair {i + 1}/{args.pairs} deterministic={str(det).lower():<5}  {r['tokens_per_second']:>12,.0f} tok/s  "
                      f"{r['seconds_per_step'] * 1e3:8.1f} ms/step  MFU {mfu}", flush=True)
    dets = [r["tokens_per_second"] for r in runs if r["deterministic"] and "failed" not in r]
    fasts = [r["tokens_per_second"] for r in runs if not r["deterministic"] and "failed" not in r]
    ratio = statistics.median(dets) / statistics.median(fasts) if dets and fasts else None
    if ratio is not None:
        print(f"deterministic / fast throughput: {ratio:.3f} (median tokens/s {statistics.median(dets):,.0f} "
              f"against {statistics.median(fasts):,.0f})")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"config": vars(args), "machine": machine(), "attention": kernels,
                                                   "runs": runs, "ratio_deterministic_fast": ratio}, indent=2))
    if len(dets) + len(fasts) < len(runs):
        raise SystemExit("error: some runs failed (above)")


if __name__ == "__main__":
    main()
