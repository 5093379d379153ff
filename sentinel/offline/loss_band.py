"""The run's loss band before a step: a robust trend fitted on healthy steps, what counts as
abnormal against it, and where an abnormal stretch began (the onset)."""

from __future__ import annotations

import math

from sentinel.offline.session import restore

# ------------------------------------------------------------------------------------ the run's loss band

BAND_WINDOW = 10  # healthy steps the band is fitted on
BAND_SIGMAS = 4.0  # how far above the trend a loss must be to count as abnormal
BAND_MIN_REL = 0.10  # ... and never closer than 10% of the trend (a smooth stretch underestimates the noise)
ONSET_LOOKBACK = 50


def loss_band(records: dict, before: int, window: int = BAND_WINDOW) -> dict | None:
    """The run's loss band just before step ``before``: a least-squares line through the last
    ``window`` healthy losses (finite, not skipped; early training trends down) and a robust
    residual scale (1.4826 MAD). High outliers (an earlier spike) are dropped and the line refitted,
    so a spike does not widen the band it is judged by. None with fewer than 4 healthy steps."""
    pool = [(s, records[s].loss) for s in range(max(1, before - 4 * window), before)
            if s in records and not records[s].skipped and math.isfinite(records[s].loss)]
    band = None
    for _ in range(3):
        pts = pool[-window:]
        if len(pts) < 4:
            return band
        band = _fit(pts)
        high = {s for s, v in pts if v > band_at(band, s)[1]}
        if not high:
            return band
        pool = [p for p in pool if p[0] not in high]
    return band


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _fit(pts: list[tuple[int, float]]) -> dict:
    """Theil-Sen line (median of pairwise slopes, median intercept): one spike in the window moves
    neither the trend nor the residual scale."""
    slopes = [(v2 - v1) / (s2 - s1) for i, (s1, v1) in enumerate(pts) for s2, v2 in pts[i + 1:] if s2 != s1]
    slope = _median(slopes) if slopes else 0.0
    mx = _median([s for s, _ in pts])
    my = _median([v - slope * (s - mx) for s, v in pts])
    resid = [v - (my + slope * (s - mx)) for s, v in pts]
    sigma = 1.4826 * _median([abs(r) for r in resid])
    return {"first": pts[0][0], "last": pts[-1][0], "n": len(pts), "mean_step": mx, "mean_loss": my, "slope": slope,
            "sigma": sigma}


def band_at(band: dict, step: int) -> tuple[float, float]:
    """(low, high) of the band at ``step`` (extrapolated at most one step past the fitted ones)."""
    x = min(step, band["last"] + 1)
    pred = band["mean_loss"] + band["slope"] * (x - band["mean_step"])
    width = max(BAND_SIGMAS * band["sigma"], BAND_MIN_REL * abs(pred))
    return pred - width, pred + width


def abnormal(rec, band: dict | None) -> bool:
    """Outside the band on the high side, non-finite, or dropped by the in-process guard."""
    if rec.skipped or not math.isfinite(rec.loss):
        return True
    return band is not None and rec.loss > band_at(band, rec.step)[1]


def find_onset(records: dict, step: int) -> int:
    """The first step of the anomaly that ``step`` belongs to (``step`` itself if the one before is
    normal): walk back while each earlier step is abnormal against the band before it."""
    onset = step
    while onset - 1 in records and step - onset < ONSET_LOOKBACK and \
            abnormal(records[onset - 1], loss_band(records, onset - 1)):
        onset -= 1
    return onset


def batch_on_weights(tr, ck_step: int, micro, micro_ids, lr) -> float:
    """The loss of one recorded batch on the weights of checkpoint ``ck_step`` (no update)."""
    restore(tr, ck_step)
    loss, _r, _g, _f, _reason = tr.train_step(micro, micro_ids, lr, apply=False)
    return float(loss.item())
