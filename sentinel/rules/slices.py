"""The slice rule: one data source's evaluation loss regressing while the others improve."""

from __future__ import annotations

import math
from typing import Any

from sentinel.protocol import MAX_SLICES
from sentinel.rules.base import Evaluator, Fields, Finding, fmt
from sentinel.rules.config import SliceRegressionRule


class SliceRegressionEval(Evaluator):
    """``slice_regression``: per slice of ``val_slice_loss`` / ``probe_loss``, evaluated on
    evaluation steps only (other records carry neither field, so the rule costs two attribute reads).

    A slice *regresses* at an evaluation when both hold:

    * its level (the median of its last three evaluations, so one noisy eval cannot move it) is
      above its best level of its last ``HISTORY`` evaluations by more than
      ``max(min_rise, noise_factor * sigma * lift)``, and so is the evaluation itself by half that
      (a level held up by two outliers in three evals has a normal eval among them). sigma is its
      eval-to-eval noise, estimated robustly from second differences (they cancel a steady descent,
      so a fast early drop does not pass for noise) over the ``noise_window`` values before the
      ``consecutive`` evaluations being judged (so a regression does not raise its own bar); lift
      is 1 on white noise and grows when the eval noise drifts slowly (below);
    * over the last ``consecutive`` evaluations its level rose while the median level change of the
      *other* slices was negative: they improve. When every slice gets worse the problem is global
      (the loss rules' business); on a noisy plateau the two directions agree only by chance.

    *lift*: neighbouring-eval differences see only the eval-to-eval jitter. When the eval noise
    drifts slowly (autocorrelated: a slice wanders off for ten evals and comes back), they see a
    small part of it, while a level measured against its best of 64 evals sees all of it: the plain
    bar false-paged 23 of 100 healthy simulated runs with AR(1) phi 0.9 eval noise
    (``bench/slice_rule_quality.py``). :func:`_drift_ratio` measures that drift: third differences
    (they cancel a steady and a curving descent) at lag ``drift_lag`` over those at lag 1, ~1 on
    white noise, ~1.7 on that drift. lift = ``max(1, ratio) ** drift_power``, with the ratio taken two
    ways, and the larger lift wins:

    * *between slices*: for slice A, the median over the other slices B of the ratio of B's gap to
      the mean of the slices that are neither A nor B. A descent or a drift that every slice shares
      cancels in such a gap (a drifting eval set moves every slice together and needs no lift: the
      "others improve" test already refuses it), and nothing of A enters A's lift, so a regression
      cannot raise its own bar. Needs 3 slices and ``6 * drift_lag`` evals;
    * *own losses*: the median over the slices of each one's own ratio, once ``noise_window`` evals
      are there (later, because a fast early descent still shows in it).

    Why pooled over slices: one slice's own ratio over 48 evals is too noisy to use (its 10-90 %
    range overlaps white noise's); the slices share one eval pipeline, so one kind of noise. A slow
    drift of one slice alone is therefore not lifted for (the ``mixed`` bench case). Before there is
    enough history (short runs, a run's first evals) the lift is 1 and the plain bar holds.

    ``consecutive`` regressing evaluations in a row name the slice once; it is named again only after
    it came back within the margin. One finding per evaluation lists every slice named then (the
    policy keys actions by rule and step, so two findings of one step would collapse into one).
    """

    HISTORY = 64

    def __init__(self, cfg: SliceRegressionRule):
        super().__init__(cfg, "slice_regression")
        self.fields = tuple(cfg.fields)
        # field -> slice -> {"hist": [[step, loss], ...] oldest first, "streak": n, "since": step, "fired": bool}
        self.tracks: dict[str, dict[str, dict[str, Any]]] = {f: {} for f in self.fields}

    def __call__(self, r: Fields, out: list[Finding]) -> None:
        hits: list[tuple[str, float, int, str]] = []
        for field in self.fields:
            cur = r.get(field)
            if cur:
                hits += self._update(field, cur, r["step"])
        if hits:
            out.append(self.finding(r["step"], "; ".join(h[3] for h in hits), value=hits[0][1],
                                    onset_step=min(h[2] for h in hits)))

    def _update(self, field: str, cur: dict, step: int) -> list[tuple[str, float, int, str]]:
        """Take one evaluation of ``field``; return (slice, loss, streak start, detail) per slice named now."""
        tracks = self.tracks[field]
        vals: dict[str, float] = {}
        for name, x in cur.items():
            if (isinstance(name, str) and isinstance(x, (int, float)) and math.isfinite(x)
                    and (name in tracks or len(tracks) < MAX_SLICES)):  # the protocol bounds them; never grow anyway
                vals[name] = float(x)
                t = tracks.setdefault(name, {"hist": [], "streak": 0, "since": None, "fired": False})
                h = t["hist"]
                while h and h[-1][0] >= step:  # a re-run of this step (resume): the new record wins
                    h.pop()
        c = self.cfg
        k = c.consecutive
        # pass 1: every slice's level (median of its last 3 evals: one noisy eval cannot move it), its
        # best level, its noise bar, and how its level moved over the last `consecutive` evals
        stat: dict[str, tuple[float, float, int, float, float]] = {}  # name -> (level, best, best step, bar, rise)
        own: list[float] = []  # per slice with a full noise window: the drift ratio of its own losses
        for name, x in vals.items():
            h = tracks[name]["hist"]
            if len(h) < max(k + 2, c.warmup_evals):
                continue
            vs = [v for _, v in h] + [x]
            levels = [_median3(*vs[i - 2:i + 1]) for i in range(2, len(vs))]
            best, best_i = min((lv, i) for i, lv in enumerate(levels[:-1]))
            # noise measured before the evals being judged, so a regression does not raise its own bar
            past = vs[:len(vs) - k][-c.noise_window:]
            sigma = _noise_sigma(past)
            if c.drift_power > 0 and len(past) >= c.noise_window:
                own.append(_drift_ratio(past, c.drift_lag))
            stat[name] = (levels[-1], best, h[best_i + 2][0], c.noise_factor * sigma, levels[-1] - levels[-1 - k])
        # the bar: the noise bar, lifted where the eval noise drifts slowly (two views, the larger lift)
        lifts = self._lifts(tracks, vals, k) if c.drift_power > 0 else {}
        if own:
            lift = max(1.0, _median(own)) ** c.drift_power
            lifts = {n: max(lift, lifts.get(n, 1.0)) for n in stat}
        for name, (level, best, best_step, noise_bar, rise) in stat.items():
            stat[name] = (level, best, best_step, max(c.min_rise, noise_bar * lifts.get(name, 1.0)), rise)
        # pass 2: regressing = above its best by its bar and still rising, while the others' levels fall
        hits: list[tuple[str, float, int, str]] = []
        label = "val" if field == "val_slice_loss" else "probe"
        for name, x in vals.items():
            t = tracks[name]
            above = apart = False
            back = True  # within its bar (or not judged): a later regression may be named again
            if name in stat:
                level, best, best_step, bar, rise = stat[name]
                gap = level - best
                back = gap <= bar
                above = not back and x - best > bar / 2  # this eval too: not a level held up by outliers
                others = [st[4] for n, st in stat.items() if n != name]
                if others:
                    others_rise = _median(others)
                    apart = others_rise < 0 < rise  # it rose, the median other slice fell, over the same evals
            if above and apart:
                t["streak"] += 1
                t["since"] = step if t["streak"] == 1 else t["since"]
            else:
                t["streak"], t["since"] = 0, None
            if back:
                t["fired"] = False  # came back within the bar: may be named again
            if t["streak"] >= k and not t["fired"]:
                t["fired"] = True
                hits.append((name, x, t["since"],
                             f"slice {_printable(name)} {label} loss {fmt(level)} (median of 3 evals) is {gap:.3f} nats "
                             f"above its best {fmt(best)} (step {best_step}; bar {bar:.3f}) for {t['streak']} evals while "
                             f"the other slices improved (median {others_rise:+.3f} over {k} evals)"))
            t["hist"].append([step, x])
            if len(t["hist"]) > self.HISTORY:
                del t["hist"][0]
        return hits

    def _lifts(self, tracks: dict, vals: dict[str, float], k: int) -> dict[str, float]:
        """Per slice A: ``max(1, ratio) ** drift_power``, ratio the median over the other slices B of the
        drift ratio of B's gap to the mean of the slices that are neither A nor B, over the
        ``noise_window`` evals before the judged ones. Gaps: a descent or a drift that every slice
        shares cancels. Neither A nor anything A does enters A's lift, so a regression cannot raise
        its own bar."""
        c = self.cfg
        names = list(vals)
        if len(names) < 3:
            return {}
        # the evals before the judged ones (the current one is not in the history yet) that every slice has
        steps = [st for st, _ in tracks[names[0]]["hist"][:len(tracks[names[0]]["hist"]) + 1 - k][-c.noise_window:]]
        series = {n: dict(tracks[n]["hist"]) for n in names}
        steps = [st for st in steps if all(st in series[n] for n in names)]
        if len(steps) < 6 * c.drift_lag:  # 3 x drift_lag third differences at least: fewer are too noisy
            return {}
        total = [sum(series[n][st] for n in names) for st in steps]
        m = len(names) - 2
        ratio: dict[tuple[str, str], float] = {}  # (A, B) -> drift ratio of B's gap to the slices neither A nor B
        for a in names:
            for b in names:
                if a != b:
                    gaps = [series[b][st] - (tot - series[a][st] - series[b][st]) / m for st, tot in zip(steps, total)]
                    ratio[a, b] = _drift_ratio(gaps, c.drift_lag)
        return {a: max(1.0, _median([ratio[a, b] for b in names if b != a])) ** c.drift_power
                for a in names}

    def rewind(self, keep_through_step: int) -> None:
        for tracks in self.tracks.values():
            for t in tracks.values():
                h = t["hist"]
                while h and h[-1][0] > keep_through_step:
                    h.pop()
                t.update(streak=0, since=None, fired=False)

    def reset(self) -> None:
        self.tracks = {f: {} for f in self.fields}

    def state_dict(self) -> dict[str, Any]:
        return {"tracks": self.tracks}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        saved = st.get("tracks", {})
        self.tracks = {f: {n: {"hist": [list(sv) for sv in t["hist"]], "streak": int(t["streak"]), "since": t["since"],
                               "fired": bool(t["fired"])} for n, t in saved.get(f, {}).items()} for f in self.fields}


def _printable(name: str, limit: int = 40) -> str:
    """A slice name as it may appear in a one-line page (names come from records: never trust them)."""
    s = "".join(ch if ch.isprintable() else "?" for ch in name)
    return s[:limit] + ("..." if len(s) > limit else "")


def _median3(a: float, b: float, c: float) -> float:
    return max(min(a, b), min(max(a, b), c))


def _median(v: list[float]) -> float:
    o = sorted(v)
    return (o[len(o) // 2] + o[~(len(o) // 2)]) / 2


def _noise_sigma(v: list[float]) -> float:
    """Robust standard deviation of one evaluation's noise, from second differences
    ``x[i] - 2 x[i-1] + x[i-2]``: they cancel a steady trend (a fast early descent is not noise),
    and for white noise their median absolute value is ~1.65 sigma."""
    d = [abs(v[i] - 2 * v[i - 1] + v[i - 2]) for i in range(2, len(v))]
    return _median(d) / 1.65 if d else 0.0


def _drift_ratio(v: list[float], lag: int) -> float:
    """How much more ``v`` wanders over ``lag`` evaluations than from one to the next, ~1 for white
    noise: median absolute third differences ``x[i] - 3 x[i-lag] + 3 x[i-2 lag] - x[i-3 lag]``
    (they cancel a steady trend and a curving descent) at ``lag`` over the same at lag 1."""
    def spread(step: int) -> float:
        return _median([abs(v[i] - 3 * v[i - step] + 3 * v[i - 2 * step] - v[i - 3 * step])
                        for i in range(3 * step, len(v))])
    one = spread(1)
    return spread(lag) / one if one > 0 else 1.0
