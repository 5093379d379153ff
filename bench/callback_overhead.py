"""The Hugging Face callback's cost per step: step time with ``SentinelCallback`` on / off (ABBA).

    python bench/callback_overhead.py [--steps 120] [--rounds 3] [--json]
    python bench/callback_overhead.py --framework lightning [--design blocks|fits] [--json]

One process, one torch thread, a tiny GPT-2 (2 layers, d=64, byte vocabulary, 8 x 64 tokens a step) on
CPU: the smallest step a real run has, so the callback's fixed cost weighs the most. Each trial is a fresh
``Trainer`` of ``--steps`` steps; "on" adds ``SentinelCallback`` (the run's embedded bus, steps.jsonl, the
control loop polled every step); both arms train on the same ``SkipAwareDataset`` + ``SampleIdCollator``
stream ("off" drops the ids in its collator, "on" has the callback's hook take them out), so the figure is
the callback's. The step time is the median gap between consecutive ``on_step_end`` calls after a warm-up (the
callback's own work lies in that gap). Trials run A B B A per round; the figure is the median over the
pairs of off/on (1.0: free; the target is >= 0.99). On a shared machine the pairs scatter by more than the
callback costs, so the callback's own time in ``on_step_end`` (its bus, step log and directive work) is
reported too, as a share of the step.
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


def _trainer(out_dir: Path, steps: int, on: bool, tokens: torch.Tensor):
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
            self.marks.append(time.perf_counter())

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=str(out_dir), max_steps=steps, per_device_train_batch_size=8, learning_rate=3e-3,
                             save_strategy="no", logging_steps=100_000, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
    clock = Clock()
    from sentinel.integrations.torch_data import SAMPLE_ID, SampleIdCollator, SkipAwareDataset

    data = SkipAwareDataset(Windows(), seed=0)  # both arms: the same data path (the skip-aware stream, its ids)
    if on:
        from sentinel.integrations.hf import SentinelCallback

        class Timed(SentinelCallback):  # the callback's own per-step work, timed where it runs
            def on_step_end(self, *a, **kw):
                t0 = time.perf_counter()
                out = super().on_step_end(*a, **kw)
                clock.own.append(time.perf_counter() - t0)
                return out

        t = Trainer(model=model, args=args, train_dataset=data, data_collator=SampleIdCollator(),
                    callbacks=[Timed(run_dir=out_dir, log=lambda m: None), clock])
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
    p.add_argument("--steps", type=int, default=None,
                   help=f"steps per trial (120; the first {WARMUP} are warm-up); lightning: see its options below")
    p.add_argument("--rounds", type=int, default=3, help="ABBA rounds (2 pairs each; the median is over the pairs)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--framework", choices=("hf", "lightning"), default="hf",
                   help="hf: the Hugging Face callback (this file); lightning: the Lightning callback "
                        "(bench/callback_overhead_lightning.py: its own options follow this one; see its --help)")
    a, rest = p.parse_known_args(argv)
    if a.framework == "lightning":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from callback_overhead_lightning import main as lightning_main

        return lightning_main([*rest, *(["--steps", str(a.steps)] if a.steps else []), *(["--json"] if a.json else [])])
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    a.steps = a.steps or 120
    if a.steps <= WARMUP + 2 or a.rounds < 1:
        p.error(f"need --steps > {WARMUP + 2} and --rounds >= 1")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    text = b"".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.parent.glob("*.py")))[:400_000]
    tokens = torch.tensor(list(text))
    from sentinel.client.session import stop_bus

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
