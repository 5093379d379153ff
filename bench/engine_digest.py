"""One hash of everything the rules decide on varied records: for a change that must not change them.

    python bench/engine_digest.py [--runs 40]

Run it before and after a speed-up (on each version's checkout) and compare the digests. Each run
feeds ``RuleEngine.evaluate`` and ``RunPolicy.on_step`` a few thousand records built to make every
evaluator fire: a loss level shift, a climb, spikes, NaN and inf in every numeric field, grad
norms not reported, 1, 2, 3 or 8 ranks with rank step times or per-rank phases, stragglers, rank
loss outliers, throughput and MFU dips, data waits, old checkpoints, val losses and slice losses.
Every third run uses a second rules file with other windows and strides. Each run rewinds once
(and re-feeds the records after the restored step), rebaselines once and goes through a
``state_dict`` round trip into a new engine once. Hashed: every field of every finding (floats by
``repr``), every action, the loss level after each record and the final state of engine and policy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sentinel.policy import RunPolicy
from sentinel.protocol import StepRecord
from sentinel.rules import RuleEngine, default_rules, parse_rules

OTHER_RULES = """
version: 1
rules:
  divergence: {level_window: 30, level_horizon: 300, climb_window: 40, climb_baseline: 60, jump_sigmas: 4.0}
  loss_spike: {window: 64, min_history: 30, recent_window: 24}
  throughput_low: {min_steps: 3, duration_seconds: 5, window: 40, min_history: 10}
  mfu_low: {min_value: 0.3, min_steps: 2, duration_seconds: 0}
  rank_straggler: {min_steps: 2}
  rank_loss_outlier: {min_steps: 2}
  data_wait_high: {min_steps: 5}
  val_divergence: {warmup_evals: 0}
"""


def records(rng: random.Random, n: int) -> list[StepRecord]:
    ranks = rng.choice([1, 2, 3, 8])
    base, noise = 3.0 + rng.random() * 3, rng.choice([0.003, 0.03, 0.1])
    shift_at, climb_at = rng.randrange(n), rng.randrange(n)
    dip_at, dip_len = rng.randrange(n), rng.randrange(20, 200)
    slow_at, slow_len, slow_rank = rng.randrange(n), rng.randrange(5, 60), rng.randrange(ranks)
    odd_at, odd_len, odd_rank = rng.randrange(n), rng.randrange(2, 20), rng.randrange(ranks)
    per_rank_phases = rng.random() < 0.5
    t, out = 1000.0, []
    for i in range(n):
        step = i + 1
        dip = dip_at <= i < dip_at + dip_len
        x = base + 2.0 * step ** -0.3 + rng.gauss(0, noise) + (0.5 if i > shift_at else 0.0)
        x += 0.004 * max(0, i - climb_at)
        if rng.random() < 0.004:
            x *= 1.6
        if rng.random() < 0.002:
            x = rng.choice([math.nan, math.inf, -math.inf])
        g = abs(rng.gauss(1.0, 0.1)) * (6 if rng.random() < 0.003 else 1)
        g = math.nan if rng.random() < 0.002 else 0.0 if rng.random() < 0.05 else g
        kw = dict(run="digest", step=step, loss=x, loss_max_rank=x, grad_norm=g, lr=1e-3, tokens=step * 100,
                  batch_fingerprint="ab", time=t, sample_ids=[i])
        t += 0.5 + rng.random() * 0.1
        if rng.random() < 0.97:
            tps = (1e6 + rng.gauss(0, 1e4)) * (0.4 if dip else 1.0)
            kw.update(tokens_per_second=math.nan if rng.random() < 0.002 else tps, mfu=0.2 if dip else 0.41)
        if rng.random() < 0.97:
            kw["step_seconds"] = rng.choice([0.5, 0.0, -1.0]) if rng.random() < 0.01 else 0.5
            kw["phases"] = {"data_wait": 0.3 if dip else 0.01, "forward_backward": 0.45}
            if rng.random() < 0.02:
                del kw["phases"]["data_wait"]
        if ranks > 1 and rng.random() < 0.97:
            busy = [0.5 + rng.gauss(0, 0.01) for _ in range(ranks)]
            if slow_at <= i < slow_at + slow_len:
                busy[slow_rank] *= 1.6
            if rng.random() < 0.003:
                busy[rng.randrange(ranks)] = rng.choice([math.nan, math.inf, 0.0])
            if per_rank_phases:
                kw["rank_phases"] = [{"data_wait": 0.01, "forward_backward": b - 0.05, "optimizer": 0.03,
                                      "allreduce_wait": 0.01} for b in busy]
                if i == 0:
                    del kw["rank_phases"][0]["forward_backward"]
            else:
                kw["rank_step_seconds"] = busy
            losses = [x + rng.gauss(0, 0.02) for _ in range(ranks)]
            if odd_at <= i < odd_at + odd_len:
                losses[odd_rank] *= 1.5
            if rng.random() < 0.003:
                losses[rng.randrange(ranks)] = rng.choice([math.nan, math.inf, -1.0, 0.0])
            kw["rank_losses"] = losses
        if rng.random() < 0.01:
            kw["checkpoint_age_seconds"] = rng.choice([100.0, 9000.0, math.nan])
        if step % 50 == 0:
            if rng.random() < 0.8:
                kw["val_loss"] = x + 0.05 + (0.3 if i > shift_at + 200 else 0.0)
            else:
                kw["val_ppl"] = math.exp(x) if math.isfinite(x) else x
            drift = 0.02 * (i - climb_at) / 50 if i > climb_at else 0.0
            kw["val_slice_loss"] = {f"s{j}": x + rng.gauss(0, 0.01) + (drift if j == 0 else 0.0) for j in range(4)}
            if rng.random() < 0.5:
                kw["probe_loss"] = dict(kw["val_slice_loss"])
        out.append(StepRecord(**kw))
    return out


def _finding_json(f) -> str:
    return json.dumps({k: repr(v) if isinstance(v, float) else v for k, v in f.to_dict().items()}, sort_keys=True)


def digest(runs: int) -> tuple[str, Counter]:
    h, fired = hashlib.sha256(), Counter()
    for seed in range(runs):
        rng = random.Random(seed)
        rules = parse_rules(OTHER_RULES) if seed % 3 == 2 else default_rules()
        eng, pol = RuleEngine(rules), RunPolicy("digest", rules, clock=lambda: 0.0)
        recs = records(rng, rng.randrange(800, 3000))
        rewind_at, rebaseline_at, reload_at = (rng.randrange(len(recs)) for _ in range(3))
        i, rewound = 0, False
        while i < len(recs):
            for f in eng.evaluate(recs[i]):
                fired[f.rule] += 1
                h.update(_finding_json(f).encode())
            h.update(repr(eng.loss_level()).encode())
            for a in pol.on_step(recs[i]):
                h.update(a.model_dump_json().encode())
            if i == rebaseline_at:
                eng.rebaseline()
            if i == reload_at:
                st = json.loads(json.dumps(eng.state_dict()))
                h.update(json.dumps(st, sort_keys=True).encode())
                eng = RuleEngine(rules)
                eng.load_state_dict(st)
            if i == rewind_at and not rewound:  # a rollback: forget what came after, feed it again
                rewound, i = True, max(0, i - rng.randrange(1, 300))
                eng.rewind(recs[i].step)
            i += 1
        h.update(json.dumps(eng.state_dict(), sort_keys=True, default=repr).encode())
        h.update(json.dumps(pol.state_dict(), sort_keys=True, default=repr).encode())
    return h.hexdigest()[:16], fired


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    a = ap.parse_args()
    d, fired = digest(a.runs)
    print(f"digest {d}  ({a.runs} runs; findings per rule: {dict(sorted(fired.items()))})")


if __name__ == "__main__":
    main()
