"""Detection quality of the sentinel's loss rules against the anchors, on labelled traces.

    /tmp/venv/bin/python bench/detection_quality.py [--curves /work/shared/curves] [--seeds 20]

Two sets of traces:

1. Real curves (``/work/shared/curves/*.jsonl``, modded-nanogpt GPT-2 runs), when present. They
   carry no labels, so labels are made with hindsight a causal detector does not have: a step is a
   spike when its loss exceeds the median of its 100 neighbours (50 before, 50 after, itself
   excluded) by at least 6 robust sigmas (1.4826 x MAD of those neighbours) AND by at least 10%.
   Steps that pass a weaker bar (4 sigmas and 5%) but not that one are "don't care": flagging them
   is neither a hit nor a false alarm, missing them is not a miss. Steps before 100 are not scored
   (the loss falls from ~11 to ~5 there; there is no meaningful local baseline).
2. Synthetic traces with injected events of known onset: single-step spikes (x1.15-x1.8, some in
   pairs 3-10 steps apart, the case a self-contaminating window misses), PaLM-like spikes (a jump
   of +30-100% that decays with a time constant of 5-30 steps; the event lasts while the excess is
   at least 2 noise sigmas), and slow divergences (a 15-30% ramp over 150 steps). Noise is
   Student-t (df=6), 2.5-4% of the loss, on a power-law curve. Nothing outside the injected events
   is labelled, so flagging a heavy-tailed noise point counts as a false alarm.

Scoring is per event and per alarm: consecutive labelled steps form one event, consecutive flagged
steps form one alarm. An event is detected when an alarm starts in [onset, end + 3] (or is already
on at its onset); delay = alarm start - onset. An alarm that detects no event and does not start on
a don't-care step is a false alarm.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from anchors import ANCHORS

from sentinel.backtest import backtest, parse_trace_line
from sentinel.rules import default_rules

SCORE_FROM = 100  # steps before this are not scored
TOL = 3  # a flag up to this many steps after an event's end still detects it
# Here flags at most this many steps apart are one alarm, for every detector alike: a dry run keeps
# judging after a damage finding (live, the first one rolls back), and the level tests give their
# verdicts every 4-8 steps, so one lasting episode is a train of findings, not one false alarm each.
ALARM_GAP = 8
OURS = "sentinel (loss_spike + divergence)"


@dataclass
class Trace:
    name: str
    losses: list[float]
    events: list[tuple[int, int]]  # inclusive index ranges of labelled events
    dont_care: set[int] = field(default_factory=set)


@dataclass
class Score:
    tp: int = 0
    fp: int = 0
    fn: int = 0
    delays: list[int] = field(default_factory=list)

    def add(self, o: Score) -> None:
        self.tp += o.tp
        self.fp += o.fp
        self.fn += o.fn
        self.delays += o.delays

    def row(self) -> dict:
        p = self.tp / (self.tp + self.fp) if self.tp + self.fp else 0.0
        r = self.tp / (self.tp + self.fn) if self.tp + self.fn else 0.0
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        d = self.delays
        return {"TP": self.tp, "FP": self.fp, "FN": self.fn, "precision": p, "recall": r, "F1": f1,
                "delay_mean": float(np.mean(d)) if d else float("nan"), "delay_max": max(d) if d else None}


# ------------------------------------------------------------------------------------ labels


def label_real(losses: list[float], half: int = 50, z_min: float = 6.0, rel_min: float = 0.10,
               dc_z: float = 4.0, dc_rel: float = 0.05) -> tuple[list[tuple[int, int]], set[int]]:
    x = np.asarray(losses)
    pos, dc = [], set()
    for i in range(SCORE_FROM, len(x)):
        seg = np.concatenate([x[max(0, i - half):i], x[i + 1:i + 1 + half]])
        med = np.median(seg)
        sig = 1.4826 * np.median(np.abs(seg - med))
        z = (x[i] - med) / sig if sig > 0 else np.inf
        rel = x[i] / med - 1
        if z >= z_min and rel >= rel_min:
            pos.append(i)
        elif z >= dc_z and rel >= dc_rel:
            dc.add(i)
    return _group(pos), dc


def _group(idx: list[int], gap: int = 1) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in sorted(idx):
        if out and i - out[-1][1] <= gap:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def synthetic(seed: int, n: int = 4000) -> Trace:
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    base = 2.6 + 8.0 * (t + 10.0) ** -0.35
    rel_noise = rng.uniform(0.025, 0.04)
    noise = rng.standard_t(6, n) * rel_noise / np.sqrt(6 / 4)  # unit-variance t, scaled
    mult = np.ones(n)
    events: list[tuple[int, int]] = []
    slots = rng.permutation(np.arange(400, n - 300, 300))[:10]
    for k, s in enumerate(sorted(slots)):
        kind = ["single", "single", "pair", "palm", "palm", "single", "ramp", "pair", "single", "palm"][k % 10]
        if kind == "single":
            mult[s] *= rng.uniform(1.15, 1.8)
            events.append((s, s))
        elif kind == "pair":
            gap = int(rng.integers(3, 11))
            mult[s] *= rng.uniform(1.15, 1.8)
            mult[s + gap] *= rng.uniform(1.15, 1.8)
            events += [(s, s), (s + gap, s + gap)]
        elif kind == "palm":
            tau = rng.uniform(5, 30)
            amp = rng.uniform(0.3, 1.0)
            k_ = np.arange(0, int(4 * tau))
            mult[s:s + len(k_)] *= 1 + amp * np.exp(-k_ / tau)
            # the event lasts while the excess is at least 2 noise sigmas
            events.append((s, s + max(0, int(tau * np.log(amp / (2 * rel_noise))))))
        else:  # ramp: slow divergence
            top = rng.uniform(0.15, 0.3)
            r = np.linspace(0, top, 150)
            mult[s:s + 150] *= 1 + r
            mult[s + 150:s + 250] *= 1 + top
            events.append((s, s + 249))
    loss = base * (1 + noise) * mult
    return Trace(f"synthetic-{seed}", [float(v) for v in loss], events)


# ------------------------------------------------------------------------------------ scoring


def score(trace: Trace, flags: list[bool], gap: int = 1) -> Score:
    """Alarm-level scoring: flags at most ``gap`` steps apart (consecutive ones by default) form one
    alarm (an alarm raised during an event and still on after it is one alarm, not a new false one)."""
    sc = Score()
    alarms = _group([i for i in range(SCORE_FROM, len(flags)) if flags[i]], gap=gap)
    starts = [a for a, _ in alarms]
    used = set()
    for a, b in trace.events:
        hits = [s for s in starts if a <= s <= b + TOL]
        # an alarm already on when the event starts also covers it
        hits += [s for s, e in alarms if s < a <= e]
        if hits:
            sc.tp += 1
            sc.delays.append(max(0, min(hits) - a))
            used.update(h for h in hits)
        else:
            sc.fn += 1
    sc.fp = sum(1 for s in starts if s not in used and s not in trace.dont_care)
    return sc


def ours(losses: list[float]) -> list[bool]:
    recs = [parse_trace_line(json.dumps({"step": i + 1, "loss": x, "wall_ms": 1000 * i})) for i, x in enumerate(losses)]
    # dry run: a live backtest stops judging a trace at its first rollback (the run would have been
    # restored there); a detection benchmark wants every event of the trace judged
    rules = default_rules().model_copy(deep=True)
    rules.policy.dry_run = True
    res = backtest(recs, rules)
    flags = [False] * len(losses)
    for f in res.fired:
        if f["rule"] in ("loss_spike", "divergence", "nonfinite"):
            flags[f["step"] - 1] = True
    return flags


DETECTORS = {OURS: ours, **ANCHORS}


def evaluate(traces: list[Trace]) -> dict[str, Score]:
    total = {name: Score() for name in DETECTORS}
    for tr in traces:
        for name, fn in DETECTORS.items():
            total[name].add(score(tr, fn(tr.losses), gap=ALARM_GAP))
    return total


def table(title: str, scores: dict[str, Score]) -> str:
    lines = [f"#### {title}", "", "| detector | TP | FP | FN | precision | recall | F1 | mean delay (steps) | max delay |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, sc in scores.items():
        r = sc.row()
        lines.append(f"| {name} | {r['TP']} | {r['FP']} | {r['FN']} | {r['precision']:.3f} | {r['recall']:.3f} | "
                     f"**{r['F1']:.3f}** | {r['delay_mean']:.1f} | {r['delay_max'] if r['delay_max'] is not None else '-'} |")
    return "\n".join(lines)


def load_curves(folder: Path) -> list[Trace]:
    out = []
    for p in sorted(folder.glob("*.jsonl")):
        losses = [json.loads(line)["loss"] for line in p.read_text().splitlines() if line.strip()]
        events, dc = label_real(losses)
        out.append(Trace(p.stem, losses, events, dc))
    return out


def load_drills(folder: Path) -> list[Trace]:
    """Our own drill runs (bench/make_drill_traces.py): labels come from the drill, not the curve."""
    labels = json.loads((folder / "labels.json").read_text())
    out = []
    for name, lab in sorted(labels.items()):
        losses = [json.loads(line)["loss"] for line in (folder / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        out.append(Trace(name, losses, [(a - 1, b - 1) for a, b in lab["events"]]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--curves", default="/work/shared/curves")
    ap.add_argument("--drills", default=str(Path(__file__).resolve().parent / "traces"))
    ap.add_argument("--seeds", type=int, default=20)
    a = ap.parse_args()
    drills = Path(a.drills)
    if (drills / "labels.json").is_file():
        dtr = load_drills(drills)
        print(f"drill runs: {len(dtr)} traces, {sum(len(t.events) for t in dtr)} drilled events\n")
        print(table("Our own drill runs (tiny GPT, guard off; labels from the drills)", evaluate(dtr)))
        print()
    folder = Path(a.curves)
    if folder.is_dir() and any(folder.glob("*.jsonl")):
        real = load_curves(folder)
        n_ev = sum(len(t.events) for t in real)
        print(f"real curves: {len(real)} files, {sum(len(t.losses) for t in real)} steps, {n_ev} labelled spikes, "
              f"{sum(len(t.dont_care) for t in real)} don't-care steps\n")
        print(table("Real curves (modded-nanogpt, hindsight labels)", evaluate(real)))
        print()
        for t in real:
            print(f"- {t.name}: spikes at steps {[a + 1 for a, _ in t.events]}")
        print()
    else:
        print(f"(no curves at {folder}: real-curve table skipped)\n")
    syn = [synthetic(s) for s in range(a.seeds)]
    print(f"synthetic: {len(syn)} traces x 4000 steps, {sum(len(t.events) for t in syn)} injected events\n")
    print(table("Synthetic traces (injected spikes, pairs, PaLM-like decays, slow divergences)", evaluate(syn)))


if __name__ == "__main__":
    main()
