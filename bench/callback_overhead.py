"""The Hugging Face callback's cost per step: step time with ``SentinelCallback`` on / off.

    python bench/callback_overhead.py [--design blocks|fits] [--steps N] [--json]
    python bench/callback_overhead.py --framework lightning [--design blocks|fits] [--json]

One process, one torch thread, a tiny GPT-2 (2 layers, d=64, byte vocabulary, 8 x 64 tokens a step) on
CPU: the smallest step a real run has, so the callback's fixed cost weighs the most. Both arms train on the
same ``SkipAwareDataset`` + ``SampleIdCollator`` stream. Target: off / on >= 0.99.

- ``--design blocks`` (the default, the figure in the docs): **one** ``Trainer`` of ``--steps`` steps (12000,
  ~3 min) with the callback, switched on and off in blocks of ``--block`` steps (25) in the order on, off,
  off, on (a quad), as ``bench/callback_overhead_lightning.py`` does. "On": everything the callback does (its
  forward hooks, the step record, the bus, the directive poll). "Off": its hooks return at once, and its
  forward pre-hook only takes the ids out of the batch (what a collator would do without it). Both arms share
  the process, the model's memory and the machine's moment. Per quad, ratio = off / on of the mean step
  time, and of the process's CPU time; the figure is the median over the quads (119 with the defaults).
- ``--design fits``: each trial a fresh ``Trainer`` of ``--steps`` steps (120, the first 20 not timed), A B B
  A per round, ``--rounds`` rounds; the median over the pairs of off / on of the median step. A fresh
  Trainer's step time moves by several percent, so its pairs scatter by more than the callback costs.

The step time is the gap between consecutive ``on_step_end`` calls of a timer callback (the callback's own
work lies in that gap); the callback's own time in ``on_step_end`` (its bus, step log and directive work) is
reported too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

WARMUP = 20


def _trainer(out_dir: Path, steps: int, on: bool, tokens: torch.Tensor, block: int | None = None):
    """(Trainer, clock). ``block``: the callback is switched on and off every ``block`` steps (on, off, off, on...;
    ``--design blocks``); ``clock.marks`` then holds each step end's (wall, process CPU) seconds."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    class Windows(torch.utils.data.Dataset):
        def __len__(self):
            return (len(tokens) - 1) // 64

        def __getitem__(self, i):
            x = tokens[i * 64:(i + 1) * 64]
            return {"input_ids": x, "labels": x}

    class Clock(TrainerCallback):
        def __init__(self):
            self.marks: list[float] = []
            self.own: list[float] = []  # on: seconds in SentinelCallback.on_step_end per step

        def on_step_end(self, args, state, control, **kw):
            if block is None:
                self.marks.append(time.perf_counter())
                return
            self.marks.append((time.perf_counter(), time.process_time()))
            switched.active = (len(self.marks) // block) % 4 in (0, 3)  # the next step's block: on off off on

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
                             save_strategy="no", logging_steps=100_000, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    clock = Clock()
    from sentinel.integrations.torch_data import SAMPLE_ID, SampleIdCollator, SkipAwareDataset

    data = SkipAwareDataset(Windows(), seed=0)  # both arms: the same data path (the skip-aware stream, its ids)
    if on:
        from sentinel.integrations.hf import SentinelCallback

        class Switched(SentinelCallback):  # its per-step work timed where it runs; in "off" blocks none of it runs
            active = True

            def _install_hooks(self, model) -> None:  # "off": the forward pre-hook only takes the ids out of the batch
                super()._install_hooks(model)
                pre, post = model._forward_pre_hooks, model._forward_hooks
                for h in self._hooks:
                    if h.id in pre:
                        pre[h.id] = (lambda f: lambda m, a, kw: f(m, a, kw) if self.active else (
                            a, {k: v for k, v in kw.items() if k != SAMPLE_ID}))(pre[h.id])
                    elif h.id in post:
                        post[h.id] = (lambda f: lambda m, a, kw, out: f(m, a, kw, out) if self.active else None)(post[h.id])

            def on_optimizer_step(self, args, state, control, **kw):
                return super().on_optimizer_step(args, state, control, **kw) if self.active else control

            def on_step_end(self, args, state, control, **kw):
                if not self.active:
                    return control
                t0 = time.perf_counter()
                out = super().on_step_end(args, state, control, **kw)
                clock.own.append(time.perf_counter() - t0)
                return out

        switched = Switched(run_dir=out_dir, log=lambda m: None)
        t = Trainer(model=model, args=args, train_dataset=data, data_collator=SampleIdCollator(), callbacks=[switched, clock])
    else:
        collate = SampleIdCollator()  # the ids collated as in "on", then dropped (no callback strips them)
        args.remove_unused_columns = False
        t = Trainer(model=model, args=args, train_dataset=data, callbacks=[clock],
                    data_collator=lambda rows: {k: v for k, v in collate(rows).items() if k != SAMPLE_ID})
    return t, clock


def trial(out_dir: Path, steps: int, on: bool, tokens: torch.Tensor, own: list[float]) -> float:
    """Median seconds per step (gap between consecutive step ends, after the warm-up); ``own`` gets the
    callback's ``on_step_end`` seconds of each step after the warm-up."""
    t, clock = _trainer(out_dir, steps, on, tokens)
    with contextlib.redirect_stdout(io.StringIO()):  # HF prints its end-of-training metrics
        t.train()
    gaps = [b - a for a, b in zip(clock.marks[WARMUP:], clock.marks[WARMUP + 1:])]
    own += clock.own[WARMUP:]
    return statistics.median(gaps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--design", choices=("blocks", "fits"), default="blocks",
                   help="blocks: one Trainer, the callback switched on and off every --block steps (on off off on: a "
                        "quad); fits: a fresh Trainer per arm, ABBA (see the module docstring)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"blocks: steps of the one Trainer (12000); fits: steps per trial (120; the first {WARMUP} are "
                        "warm-up); lightning: see its options below")
    p.add_argument("--block", type=int, default=25, help="blocks: steps per block")
    p.add_argument("--rounds", type=int, default=3, help="fits: ABBA rounds (2 pairs each; the median is over the pairs)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--framework", choices=("hf", "lightning"), default="hf",
                   help="hf: the Hugging Face callback (this file); lightning: the Lightning callback "
                        "(bench/callback_overhead_lightning.py: its own options follow this one; see its --help)")
    a, rest = p.parse_known_args(argv)
    if a.framework == "lightning":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from callback_overhead_lightning import main as lightning_main

        return lightning_main([*rest, "--design", a.design, "--block", str(a.block),
                               *(["--steps", str(a.steps)] if a.steps else []), *(["--json"] if a.json else [])])
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    blocks = a.design == "blocks"
    a.steps = a.steps or (12_000 if blocks else 120)
    if blocks and (a.block < 3 or a.steps < 6 * 4 * a.block):
        p.error(f"--design blocks needs --block >= 3 and --steps >= {6 * 4 * a.block} (6 quads)")
    if a.steps <= WARMUP + 2 or a.rounds < 1:
        p.error(f"need --steps > {WARMUP + 2} and --rounds >= 1")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    text = b"".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.parent.glob("*.py")))[:400_000]
    tokens = torch.tensor(list(text))
    from sentinel.client.session import stop_bus

    if blocks:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from callback_overhead_lightning import block_quads, report

        with tempfile.TemporaryDirectory(prefix="callback-overhead-") as tmp:
            run_dir = Path(tmp) / "bench-run"
            try:
                t, clock = _trainer(run_dir, a.steps, True, tokens, block=a.block)
                with contextlib.redirect_stdout(io.StringIO()):  # HF prints its end-of-training metrics
                    t.train()
            finally:
                stop_bus(run_dir)
        marks = clock.marks
        quads = block_quads([y[0] - x[0] for x, y in zip(marks, marks[1:])],
                            [y[1] - x[1] for x, y in zip(marks, marks[1:])], a.block)
        return report(quads, {"framework": "hf", "design": "blocks", "steps": a.steps, "block": a.block,
                              "callback_on_step_end_ms_median": round(statistics.median(clock.own[WARMUP:]) * 1e3, 4)},
                      a.json)

    with tempfile.TemporaryDirectory(prefix="callback-overhead-") as tmp:
        run_dir = Path(tmp) / "bench-run"
        on_s, off_s, own = [], [], []
        try:
            for _ in range(a.rounds):
                for on in (True, False, False, True):  # A B B A
                    (on_s if on else off_s).append(trial(run_dir if on else Path(tmp) / "off", a.steps, on, tokens, own))
        finally:
            stop_bus(run_dir)
    ratios = [off / on for off, on in zip(off_s, on_s)]
    out = {"steps_per_trial": a.steps, "rounds": a.rounds, "pairs": len(ratios),
           "step_seconds_on": [round(x, 6) for x in on_s], "step_seconds_off": [round(x, 6) for x in off_s],
           "overhead_ms_per_step": round((statistics.median(on_s) - statistics.median(off_s)) * 1e3, 3),
           "ratio_off_over_on_median": round(statistics.median(ratios), 4),
           "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
           "callback_on_step_end_ms_median": round(statistics.median(own) * 1e3, 3),
           "callback_share_of_step_median": round(statistics.median(own) / statistics.median(on_s), 4), "target": 0.99}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"step time on {statistics.median(on_s) * 1e3:.2f} ms, off {statistics.median(off_s) * 1e3:.2f} ms; "
              f"off/on ratio (median of {len(ratios)} ABBA pairs): {out['ratio_off_over_on_median']:.4f} (target >= 0.99); "
              f"the callback's on_step_end: {out['callback_on_step_end_ms_median']:.3f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
