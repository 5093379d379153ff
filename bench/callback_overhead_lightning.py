"""What does ``SentinelCallback`` cost a Lightning step? The same training with and without it, ABBA.

    PYTHONPATH=. python bench/callback_overhead.py --framework lightning [--design blocks|fits] [--json]
    PYTHONPATH=. python bench/callback_overhead_lightning.py [the same options]

One process, one tiny GPT (the model of ``docs/integrate.md`` (Lightning): 2 layers, d_model 64, seq 64,
batch 8, random init) on the locally prepared Shakespeare tokens, CPU, one torch thread, the same data
stream in both arms (a ``SkipAwareDataset``); gradient norm clipping at 1.0 in both arms as LLM pretraining
does (``--clip 0``: none, and the callback computes the norm); no checkpoints, no validation, no logger, no
progress bar. "On" is ``SentinelCallback(run_dir=..., dataset=...)`` with its embedded bus (up before the
first step, as ``sentinel run`` would see it). The step time is the interval between consecutive
``on_train_batch_end`` calls of a timer callback present in both arms; per quad, ratio = off / on of the mean
step (1.0: free; 0.99: the callback adds 1 % to a step), and the same for the process's CPU time
(``time.process_time``: the training thread and the callback's writer and bus threads together).

Two designs:

- ``--design blocks`` (the default, the figure in the docs): **one** fit of ``--steps`` steps (default 12000:
  119 quads, ~2.5 min; with 4000, 39 quads, the median moved by ~0.5 % run to run)
  with the callback registered, switched on and off in blocks of ``--block`` steps (25) in the order
  on/off/off/on (a quad). Both arms share the process, the model's memory and the machine's moment, so
  what differs is the callback's per-step work: its hooks, its step records (built on its writer thread),
  the bus client's round trips, the directive poll. Not counted: the first two blocks (warm-up), and the
  first 2 steps of each run of "off" blocks, where work the "on" steps started may still run (a batch's
  round trip). The first "on" step after "off" ones is counted: it kicks the batch of step records held
  since the last "on" block, as a continuous run would every 0.25 s. "Off" leaves the callback registered with its three per-step hooks
  returning at once: Lightning's dispatch of a callback's hooks is in both arms (``--design fits`` measures
  its presence too: with the hooks emptied it came to 0.999).
- ``--design fits``: each arm a fresh ``lightning.Trainer`` fit of ``--steps`` steps (default 150), quads of
  fits on/off/off/on, the first ``--warmup`` steps of a fit not counted. It also counts what a fit pays once
  (the step-0 checkpoint) and the callback's mere presence, but each fit lays the model out in memory anew,
  and on a 2-core machine that moves a fit's step time by several percent: the median over 30 quads moves
  by about 1 % run to run, as much as the whole cost.

What "on" adds per step: references to the step's outputs and batch kept on the loop's thread, the lr, a
directive poll (a local flag); on the writer thread, once per 0.25 s batch: the loss and grad norm read
back, the batch's ids and tokens, one ``StepRecord`` a step to ``steps.jsonl`` and onto the bus client's
queue; on the bus client's thread, a round trip for each batch. Target: median >= 0.99.
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


def build(steps: int, model: str = "tiny", clip: float | None = 1.0, block: int | None = None):
    """(fit(on: bool) -> per-step (wall, CPU) intervals, run_dir) over one shared model init and data set.

    ``block``: the callback is registered in every fit, and switched on and off every ``block`` steps
    (on, off, off, on, ...): ``fit(True)`` then returns the intervals of the whole fit, each of a step
    that ran in block ``index // block``."""
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

    class Switched(SentinelCallback):  # --design blocks: the per-step hooks return at once in "off" blocks
        active = True

        def on_before_backward(self, *args) -> None:
            if self.active:
                super().on_before_backward(*args)

        def on_before_optimizer_step(self, *args) -> None:
            if self.active:
                super().on_before_optimizer_step(*args)

        def on_train_batch_end(self, *args) -> None:
            if self.active:
                super().on_train_batch_end(*args)

    class Timer(Callback):  # after the callback in the list: a switch takes effect from the next step on
        def __init__(self, switched: Switched | None = None):
            self.t: list[tuple[float, float]] = []
            self.switched = switched

        def on_train_batch_end(self, *args):
            self.t.append((time.perf_counter(), time.process_time()))
            if self.switched is not None:
                self.switched.active = (len(self.t) // block) % 4 in (0, 3)  # the next step's block: on off off on

    torch.manual_seed(0)
    init = TinyGPT().state_dict()
    tmp = Path(tempfile.mkdtemp(prefix="lightning-overhead-"))
    run_dir = prepare(tmp / "bench-run")  # the bus is up before the first segment, as for a watched run

    def fit(on: bool, n: int | None = None) -> tuple[list[float], list[float]]:
        model = TinyGPT()
        model.load_state_dict(init)
        data = SkipAwareDataset(Windows(), seed=0)
        cb = (Switched if block else SentinelCallback)(run_dir=run_dir, dataset=data, log=lambda m: None) if on else None
        timer = Timer(cb if block else None)
        cbs = ([cb] if on else []) + [timer]
        trainer = L.Trainer(max_steps=n or steps, accelerator="cpu", devices=1, callbacks=cbs, logger=False, gradient_clip_val=clip,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(model, DataLoader(data, batch_size=8))
        wall = [b[0] - a[0] for a, b in zip(timer.t, timer.t[1:])]
        cpu = [b[1] - a[1] for a, b in zip(timer.t, timer.t[1:])]
        return wall, cpu

    return fit, run_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--design", choices=("blocks", "fits"), default="blocks",
                    help="blocks: one fit, the callback switched on and off every --block steps; fits: a fresh fit per "
                         "arm (see the module docstring)")
    ap.add_argument("--steps", type=int, default=None, help="blocks: steps of the fit (12000); fits: steps per fit (150)")
    ap.add_argument("--block", type=int, default=25, help="blocks: steps per block (a quad is 4 blocks)")
    ap.add_argument("--warmup", type=int, default=20, help="fits: first steps of a fit not timed")
    ap.add_argument("--quads", type=int, default=30, help="fits: ABBA quads of fits (on/off/off/on)")
    ap.add_argument("--clip", type=float, default=1.0,
                    help="gradient_clip_val in both arms (norm clipping, as LLM pretraining does; the callback then takes "
                         "Lightning's own norm); 0: no clipping (the callback computes the norm itself)")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny",
                    help="tiny: 2 layers, d_model 64, seq 64 (the docs' model); small: 2 layers, d_model 128, seq 128")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args(argv)
    blocks = args.design == "blocks"
    if args.steps is None:
        args.steps = 12_000 if blocks else 150
    if blocks and (args.block < 3 or args.steps < 6 * 4 * args.block):
        raise SystemExit(f"--design blocks needs --block >= 3 and --steps >= {6 * 4 * args.block} (6 quads)")
    if not blocks and args.steps <= args.warmup + 2:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup} + 2")
    import logging

    import torch

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    fit, run_dir = build(args.steps, args.model, args.clip or None, args.block if blocks else None)
    quads = []

    try:
        fit(True, 150)  # warm everything once (imports, allocator, the bus connection)
        if blocks:
            quads = block_quads(*fit(True), args.block)
        else:
            for _ in range(args.quads):
                seg: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
                for on in (True, False, False, True):
                    wall, cpu = fit(on)
                    seg[on] += list(zip(wall[args.warmup:], cpu[args.warmup:]))
                quads.append(quad(seg[True], seg[False]))
    finally:
        from sentinel.client.session import stop_bus

        stop_bus(run_dir)
        shutil.rmtree(run_dir.parent, ignore_errors=True)

    return report(quads, {"design": args.design, "model": args.model, "clip": args.clip or None, "steps": args.steps,
                          **({"block": args.block} if blocks else {"warmup": args.warmup})}, args.json)


def quad(on: list[tuple[float, float]], off: list[tuple[float, float]]) -> dict:
    """One quad's figures from its "on" and "off" steps' (wall, CPU) seconds: ratios off / on of the mean step."""
    on_w, on_c, off_w, off_c = (statistics.fmean(x[k] for x in arm) for arm in (on, off) for k in (0, 1))
    return {"on_ms": on_w * 1e3, "off_ms": off_w * 1e3, "ratio": off_w / on_w,
            "ratio_median_interval": statistics.median(x[0] for x in off) / statistics.median(x[0] for x in on),
            "on_cpu_ms": on_c * 1e3, "off_cpu_ms": off_c * 1e3, "ratio_cpu": off_c / on_c}


def block_quads(wall: list[float], cpu: list[float], block: int) -> list[dict]:
    """``--design blocks``: the quads of one fit's step intervals, the callback switched on, off, off, on every
    ``block`` steps (interval k is the step that ran after the switch at step k + 1's end). Not counted: the
    first two blocks (warm-up) and the first 2 steps of each run of "off" blocks; only whole quads."""
    arms: dict[int, dict[bool, list]] = {}
    for k, (w, c) in enumerate(zip(wall, cpu)):
        b = (k + 1) // block
        if b < 2 or (b % 4 == 1 and (k + 1) % block < 2):
            continue
        arms.setdefault(b // 4, {True: [], False: []})[b % 4 in (0, 3)].append((w, c))
    return [quad(a[True], a[False]) for a in arms.values() if len(a[True]) == 2 * block]


def report(quads: list[dict], what: dict, as_json: bool) -> int:
    """Print the quads' summary (median, min, max of each ratio; the pooled ratio) as JSON or as text."""
    def summary(key: str) -> dict:
        r = sorted(q[key] for q in quads)
        return {"min": r[0], "median": statistics.median(r), "max": r[-1]}

    pooled = {arm: [q[f"{arm}_ms"] for q in quads] for arm in ("on", "off")}  # equal steps per quad: mean of means
    res = {**what, "ratio_pooled": statistics.fmean(pooled["off"]) / statistics.fmean(pooled["on"]),
           "quads": quads, "ratio": summary("ratio"),
           "ratio_median_interval": summary("ratio_median_interval"), "ratio_cpu": summary("ratio_cpu"),
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch threads 1"}
    if as_json:
        print(json.dumps(res, indent=1))
        return 0
    for i, q in enumerate(quads if len(quads) <= 40 else []):
        print(f"quad {i}: wall on {q['on_ms']:.2f} / off {q['off_ms']:.2f} ms/step (ratio {q['ratio']:.4f}, "
              f"median-interval {q['ratio_median_interval']:.4f}); CPU on {q['on_cpu_ms']:.2f} / off "
              f"{q['off_cpu_ms']:.2f} ms/step (ratio {q['ratio_cpu']:.4f})")
    for key, what in (("ratio", "wall, mean step"), ("ratio_median_interval", "wall, median step"),
                      ("ratio_cpu", "process CPU time per step")):
        r = res[key]
        print(f"on/off ratio ({what}): median {r['median']:.4f} of {len(quads)} quads (min {r['min']:.4f}, max {r['max']:.4f})"
              "  [target >= 0.99]")
    print(f"on/off ratio (wall, all counted steps pooled): {res['ratio_pooled']:.4f}; step time on "
          f"{statistics.fmean(pooled['on']):.3f} ms, off {statistics.fmean(pooled['off']):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
