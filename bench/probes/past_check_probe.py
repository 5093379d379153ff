"""Where the level and jump tests fire, against the run's own past: the measurement behind
``LevelShift.PAST_FACTOR`` (docs/benchmarks.md, "A verdict against the run's own past").

    python bench/probes/past_check_probe.py variants quiet0.3,ema0.2,roll50   # false firings on healthy logs
    python bench/probes/past_check_probe.py drills                          # first firings on injected damage

At every verdict of every ``LevelShift`` it records the level excess (window median minus the
run's best) and the jump (window median minus the window before). At a firing it prints that
statistic over the largest of its kind at the run's verdicts in the 1000 steps before (the newest
200 left out; for the level test also its current elevated stretch). ``variants``: the healthy real
curves logged as ``bench/probes/logging_variants.py`` does, the firings before each run's first pause or
rollback. ``drills``: jumps and slow decays of 0.25-1.0 nats injected into the real curves (4 of
each per curve, seed 1), the first firing at or after the onset. Run it with ``PAST_FACTOR = 0``
patched in (as here) so that the check itself hides nothing.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: decision_quality

from decision_quality import inject, load_curves, run_backtest
from logging_variants import logged, replay

import sentinel.detectors as D

D.LevelShift.PAST_FACTOR = 0.0  # measure what the tests would do without the check
_feed = D.LevelShift.feed
fires: list[tuple[str, int, float, float | None]] = []  # (kind, step, statistic, its ratio to the past maximum)
_seen: dict[int, collections.deque] = {}


def _probe(self, steps, xs, noise):
    fired = _feed(self, steps, xs, noise)
    dq = _seen.setdefault(id(self), collections.deque(maxlen=600))
    if self._pending and self._pending[-1][0] == steps[-1] and self._mono:
        step, m, _ = self._pending[-1]
        before = [mm for s, mm, _, _ in dq if s <= step - self.window]
        ex, jd = m - self._mono[0][1], (m - before[-1] if before else 0.0)
        if fired:
            idx, cut = (3 if self.kind == "jump" else 2), step - self.PAST_GAP
            if self.kind == "level" and self._above_since is not None:
                cut = min(cut, self._above_since - self.window)
            past = [e[idx] for e in dq if step - self.PAST_STEPS <= e[0] <= cut]
            stat = jd if self.kind == "jump" else ex
            top = max(past) if len(past) >= self.PAST_MIN else None
            fires.append((self.kind, step, stat, stat / top if top and top > 0 else None))
        dq.append((step, m, ex, jd))
    return fired


D.LevelShift.feed = _probe


def _runs():
    here = Path(__file__).resolve().parent
    return [r for f in (Path("/work/shared/curves"), here / "curves-validation") if f.is_dir() for r in load_curves(f)]


def main() -> None:
    if any(a in ("-h", "--help") for a in sys.argv[1:]) or sys.argv[1:2] not in ([], ["drills"], ["variants"]):
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    mode = sys.argv[1] if len(sys.argv) > 1 else "drills"
    if mode == "variants":
        for variant in (sys.argv[2] if len(sys.argv) > 2 else "quiet0.3,ema0.2,roll50").split(","):
            for run in _runs():
                fires.clear()
                _seen.clear()
                acts = [a for a in replay(run.name, *logged(run, variant)) if a["kind"] in ("pause", "rollback")]
                if acts:
                    f = [x for x in fires if x[1] <= acts[0]["step"]][-1:]
                    print(f"{variant} {run.name}: {acts[0]['kind']} at {acts[0]['step']}; firing (kind, step, statistic, x past max): {f}")
        return
    rng = np.random.default_rng(1)
    ratios = []
    for run in _runs():
        n = len(run.losses)
        for shape in ("jump", "jump-decay"):
            for onset in rng.integers(200, n - 120, 4):
                onset = int(onset)
                dmg, _ = inject(run, shape, onset, rng)
                fires.clear()
                _seen.clear()
                run_backtest(run.name, dmg[:onset + 200], run.wall_ms[:onset + 200])
                first = next((x for x in fires if x[1] >= onset), None)
                if first is not None:
                    ratios.append(first[3] if first[3] is not None else float("inf"))
    r = np.array(ratios)
    print(f"{len(r)} drills first caught by these tests; x past max at that firing: min {r.min():.2f}, "
          f"1st/5th/50th percentile {np.quantile(r, 0.01):.2f} / {np.quantile(r, 0.05):.2f} / {np.quantile(r, 0.5):.2f}")


if __name__ == "__main__":
    main()
