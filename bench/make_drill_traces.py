"""Labelled loss traces from our own training runs with drills, for bench/detection_quality.py.

    /tmp/venv/bin/python bench/make_drill_traces.py [--out bench/traces]

Each trace is a real single-rank `tiny` run (Shakespeare, byte-level) of 300 steps, with no
sentinel and no guard (`guard.enabled=false`, so nothing hides the damage), and one fault keyed to
the sample ids of a chosen step. The label's start comes from the drill, not from the curve:
- `lr@S:F` (learning rate x F on step S's update): damage shows from step S+1. The event is
  [S+1, E], where E is the last step of the run of losses >= 10% above the median of the 50 steps
  before the drill (gaps of up to 3 steps allowed, at most 100 steps). A drill that leaves no
  such mark (its damage is within the noise) has no event: the trace is then a negative example,
  where any alarm is a false one.
- `garbage@S` (corrupted tokens in some of step S's samples): [S, S].
- `nan@S`: [S, S].

Written as `{"step", "loss", "grad_norm"}` lines, plus `labels.json`:
{name: {"events": [[first, last], ...], "fault": "...", "kind", "step"}} with 1-based steps.
`--relabel` recomputes labels.json from the saved traces without training again.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sentinel.drill import batch_ids_at  # noqa: E402
from trainer.config import PRESETS  # noqa: E402
from trainer.data import ensure_prepared  # noqa: E402

STEPS = 300
# (name, kind, step, how many of the step's samples, factor, seed)
DRILLS = [
    ("lr100-s150", "lr", 150, 1, 100.0, 1),
    ("lr30-s220", "lr", 220, 1, 30.0, 2),
    ("lr10-s180", "lr", 180, 1, 10.0, 3),
    ("garbage2-s160", "garbage", 160, 2, 1.0, 4),
    ("garbage4-s240", "garbage", 240, 4, 1.0, 5),
    ("nan-s200", "nan", 200, 1, 1.0, 6),
]


def run(name: str, kind: str, step: int, n: int, factor: float, seed: int, data: Path, out: Path) -> dict:
    p = PRESETS["tiny"]
    ids = sorted(batch_ids_at(data, seq_len=p["model"]["seq_len"], seed=seed, global_batch=p["data"]["micro_batch_size"], step=step))
    chosen = ids[:n]
    faults = []
    for i in chosen:
        faults += ["--inject-fault", f"{kind}@{i}" + (f":{factor}" if kind == "lr" else "")]
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / name
        cmd = [sys.executable, "-m", "trainer", "--preset", "tiny", "--run-dir", str(run_dir), "--data", str(data),
               "--max-steps", str(STEPS), "--ckpt-every", "0", "--eval-every", "0", "--telemetry", "off", "--seed", str(seed),
               "--set", "guard.enabled=false", *faults]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        lines = []
        for line in (run_dir / "steps.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r.get("kind") == "step":
                lines.append(json.dumps({"step": r["step"], "loss": r["loss"], "grad_norm": r["grad_norm"]}))
    (out / f"drill-{name}.jsonl").write_text("\n".join(lines) + "\n")
    return {"kind": kind, "step": step, "fault": " ".join(faults[1::2])}


def label(kind: str, step: int, losses: list[float]) -> list[list[int]]:
    """Event ranges (1-based steps) for one drill, by the rule in the module docstring."""
    if kind != "lr":
        return [[step, step]]
    pre = sorted(losses[step - 51:step - 1])
    bar = 1.10 * pre[len(pre) // 2]
    last, gap = None, 0
    for s in range(step + 1, min(len(losses), step + 101) + 1):
        if losses[s - 1] >= bar:
            last, gap = s, 0
        elif last is not None or s > step + 3:
            gap += 1
            if gap > 3:
                break
    return [[step + 1, last]] if last is not None else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "traces"))
    ap.add_argument("--relabel", action="store_true", help="recompute labels.json from the saved traces")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.relabel:
        labels = json.loads((out / "labels.json").read_text())
    else:
        data = ensure_prepared()
        labels = {f"drill-{d[0]}": run(*d, data=data, out=out) for d in DRILLS}
    for name, lab in labels.items():
        losses = [json.loads(line)["loss"] for line in (out / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        lab["events"] = label(lab["kind"], lab["step"], losses)
        print(f"{name}: {lab}")
    (out / "labels.json").write_text(json.dumps(labels, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
