"""Peak memory and time of the offline tools on a long run's step log.

    python bench/offline_memory.py [--steps 300000]

Makes a real 2-rank run with `sentinel demo` (about a minute), appends ``--steps`` more step
records to its steps.jsonl (copies of its last record, renumbered: a run that went on for a long
time), then runs `sentinel replay-batch RUN --step 150`, `sentinel verify-resume RUN
--from-step 140 --steps 5` and `sentinel report RUN` on it, each in its own child process, and reports each one's peak
resident memory (the largest process of its tree, torchrun's ranks included) and wall time. The
tools read only the steps they need (``sentinel.client.steplog.scan``, ``replay.branches(keep=...)``; the
report keeps only what it draws of each step), so
their memory should not grow with ``--steps``: run it at two sizes and compare.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
           "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
           "print(p.returncode, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); "
           "sys.stderr.write(p.stderr[-2000:] if p.returncode else '')")


def extend(log: Path, steps: int) -> None:
    lines = log.read_text().splitlines()
    last = json.loads(next(ln for ln in reversed(lines) if '"kind":"step"' in ln))
    n = len(last.get("sample_ids") or [])
    with log.open("a") as f:
        for s in range(last["step"] + 1, last["step"] + steps + 1):
            last["step"] = s
            last["sample_ids"] = list(range(s * n, (s + 1) * n))
            f.write(json.dumps(last, separators=(",", ":")) + "\n")


def measure(args: list[str]) -> tuple[int, float, float]:
    out = subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "sentinel", *args], capture_output=True,
                         text=True, cwd=ROOT)
    rc, secs, kib = out.stdout.split()
    if int(rc):
        sys.exit(f"{' '.join(args[:1])} failed: {out.stderr.strip()}")
    return int(rc), float(secs), int(kib) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300_000, help="step records appended to the demo run's log")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        p = subprocess.run([sys.executable, "-m", "sentinel", "demo", "--run-dir", str(run), "--json"], capture_output=True,
                           text=True, cwd=ROOT)
        if p.returncode:
            sys.exit(f"sentinel demo failed: {p.stderr.strip()[-2000:]}")
        extend(run / "steps.jsonl", a.steps)
        size = (run / "steps.jsonl").stat().st_size / 2**20
        for name, args in (("replay-batch --step 150", ["replay-batch", str(run), "--step", "150", "--json"]),
                           ("verify-resume --from-step 140 --steps 5",
                            ["verify-resume", str(run), "--from-step", "140", "--steps", "5", "--json"]),
                           ("report", ["report", str(run), "--json"])):
            t0 = time.perf_counter()
            _, secs, mib = measure(args)
            print(f"{name}: log of {a.steps + 200} steps ({size:.0f} MiB): peak RSS {mib:.0f} MiB, {secs:.1f} s "
                  f"({time.perf_counter() - t0:.1f} s with the measuring process)")


if __name__ == "__main__":
    main()
