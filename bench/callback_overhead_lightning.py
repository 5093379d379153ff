"""What does ``SentinelCallback`` cost a Lightning step? The same fit with and without it, ABBA.

    PYTHONPATH=. python bench/callback_overhead.py --framework lightning [--steps 120] [--warmup 20] [--quads 5] [--json]
    PYTHONPATH=. python bench/callback_overhead_lightning.py [the same options]

One process, one tiny GPT (the model of ``docs/integrate.md`` (Lightning): 2 layers, d_model 64, seq 64,
batch 8, random init) on the locally prepared Shakespeare tokens, CPU, one torch thread. Each segment is a
fresh ``lightning.Trainer`` fit of ``--steps`` steps from the same initial weights and the same data
stream (a ``SkipAwareDataset``, in both arms, so the data path is identical); gradient norm clipping at
1.0 in both arms as LLM pretraining does (``--clip 0``: none, and the callback computes the norm); no checkpoints, no
validation, no logger, no progress bar. Arm "on" adds ``SentinelCallback(run_dir=..., dataset=...)`` with
its embedded bus (started once, before the first segment, as ``sentinel run`` would see it); arm "off"
adds nothing. Segments run in quads on/off/off/on (ABBA), so a drift of the machine hits both arms alike.

The step time of a segment is the mean interval between consecutive ``on_train_batch_end`` calls of a
timer callback present in both arms, over the steps after ``--warmup`` (a fit's first steps pay
allocator and cache warm-up, and the "on" arm's step 0 checkpoint); the median interval is reported
too (robust to a neighbour's burst on a shared machine). Per quad: ratio = off / on (1.0: free; 0.99:
the callback adds 1 % to a step). Reported: each quad's ratio, and min / median / max, for the wall
time and for the process's CPU time per step (``time.process_time``: the training thread and the bus
client's I/O thread together). On a shared machine the CPU-time ratio is the stable figure: a neighbour's
burst moves the wall time of a segment by far more than the callback costs, but not its CPU time.

What "on" adds per step: the loss read back (``float``), the grad norm (one fused norm over the grads),
the lr, the batch's ids and tokens, one ``StepRecord`` to ``steps.jsonl`` and onto the bus client's queue
(its I/O thread does the Redis work), and a directive poll (a local queue read). Target: median >= 0.99.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


MODELS = {  # (n_layer, d_model, seq_len): "tiny" is the docs' model; "small" a step ~5x longer
    "tiny": (2, 64, 64),
    "small": (2, 128, 128),
}


def build(steps: int, model: str = "tiny", clip: float | None = 1.0):
    """(make_fit(on: bool) -> per-step intervals, close) over one shared model init and data set."""
    import lightning as L
    import torch
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader, Dataset

    from sentinel.client.session import prepare
    from sentinel.integrations.lightning import SentinelCallback
    from sentinel.integrations.torch_data import SkipAwareDataset
    from trainer.config import ModelConfig
    from trainer.data import TokenDataset, ensure_prepared
    from trainer.model import GPT

    n_layer, d_model, seq = MODELS[model]
    tokens = TokenDataset.open(ensure_prepared())

    class Windows(Dataset):
        def __len__(self):
            return tokens.num_samples(seq)

        def __getitem__(self, i):
            t = torch.from_numpy(tokens.get(i, seq))
            return {"input_ids": t[:-1], "labels": t[1:]}

    class TinyGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.gpt = GPT(ModelConfig(n_layer=n_layer, n_head=4, d_model=d_model, seq_len=seq,
                                       vocab_size=tokens.vocab_size))

        def training_step(self, batch, batch_idx):
            return self.gpt(batch["input_ids"], batch["labels"])[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    class Timer(Callback):
        def __init__(self):
            self.t: list[tuple[float, float]] = []

        def on_train_batch_end(self, *args):
            self.t.append((time.perf_counter(), time.process_time()))

    torch.manual_seed(0)
    init = TinyGPT().state_dict()
    tmp = Path(tempfile.mkdtemp(prefix="lightning-overhead-"))
    run_dir = prepare(tmp / "bench-run")  # the bus is up before the first segment, as for a watched run

    def fit(on: bool) -> tuple[list[float], list[float]]:
        model = TinyGPT()
        model.load_state_dict(init)
        data = SkipAwareDataset(Windows(), seed=0)
        timer = Timer()
        cbs = [timer] + ([SentinelCallback(run_dir=run_dir, dataset=data, log=lambda m: None)] if on else [])
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=cbs, logger=False, gradient_clip_val=clip,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(model, DataLoader(data, batch_size=8))
        wall = [b[0] - a[0] for a, b in zip(timer.t, timer.t[1:])]
        cpu = [b[1] - a[1] for a, b in zip(timer.t, timer.t[1:])]
        return wall, cpu

    return fit, run_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="steps per segment")
    ap.add_argument("--warmup", type=int, default=20, help="first steps of a segment not timed")
    ap.add_argument("--quads", type=int, default=5, help="ABBA quads (on/off/off/on); >= 5 for a median")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient_clip_val in both arms (norm clipping, as LLM pretraining does; the callback then takes "
                         "Lightning's own norm); 0: no clipping (the callback computes the norm itself)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny",
                    help="tiny: 2 layers, d_model 64, seq 64 (the docs' model); small: 2 layers, d_model 128, seq 128")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    if args.steps <= args.warmup + 2:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup} + 2")
    import logging

    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    fit, run_dir = build(args.steps, args.model, args.clip or None)
    quads = []
    try:
        fit(True)  # warm everything once (imports, allocator, the bus connection)
        for _ in range(args.quads):
            seg: dict[bool, list[tuple[float, float, float]]] = {True: [], False: []}
            for on in (True, False, False, True):
                wall, cpu = fit(on)
                wall, cpu = wall[args.warmup:], cpu[args.warmup:]
                seg[on].append((statistics.fmean(wall), statistics.median(wall), statistics.fmean(cpu)))
            on, off = ([statistics.fmean(x[k] for x in seg[arm]) for k in range(3)] for arm in (True, False))
            quads.append({"on_ms": on[0] * 1e3, "off_ms": off[0] * 1e3, "ratio": off[0] / on[0],
                          "ratio_median_interval": off[1] / on[1], "on_cpu_ms": on[2] * 1e3, "off_cpu_ms": off[2] * 1e3,
                          "ratio_cpu": off[2] / on[2]})
    finally:
        from sentinel.client.session import stop_bus

        stop_bus(run_dir)
        shutil.rmtree(run_dir.parent, ignore_errors=True)

    def summary(key: str) -> dict:
        r = sorted(q[key] for q in quads)
        return {"min": r[0], "median": statistics.median(r), "max": r[-1]}

    res = {"model": args.model, "clip": args.clip or None, "steps": args.steps, "warmup": args.warmup, "quads": quads, "ratio": summary("ratio"),
           "ratio_median_interval": summary("ratio_median_interval"), "ratio_cpu": summary("ratio_cpu"),
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads 1"}
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    for i, q in enumerate(quads):
        print(f"quad {i}: wall on {q['on_ms']:.2f} / off {q['off_ms']:.2f} ms/step (ratio {q['ratio']:.4f}, "
              f"median-interval {q['ratio_median_interval']:.4f}); CPU on {q['on_cpu_ms']:.2f} / off "
              f"{q['off_cpu_ms']:.2f} ms/step (ratio {q['ratio_cpu']:.4f})")
    for key, what in (("ratio", "wall, mean step"), ("ratio_median_interval", "wall, median step"),
                      ("ratio_cpu", "process CPU time per step")):
        r = res[key]
        print(f"on/off ratio ({what}): median {r['median']:.4f} (min {r['min']:.4f}, max {r['max']:.4f})  [target >= 0.99]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
