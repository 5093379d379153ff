"""One picture of a run for the on-call engineer: ``sentinel report`` draws it, this module paints it.

A pure function from plain data to a PNG (matplotlib, Agg backend, no display, no bus, no torch):
``gather`` turns run-directory records into :class:`ReportData`, ``render`` paints it. Panels share
the step axis, top to bottom:

1. training loss per step (the abandoned timelines a rollback superseded in grey, so the spike that
   was undone stays visible), guard skips as red crosses, validation PPL on the right axis;
2. gradient norm (log scale);
3. the LR the trainer applied, with the schedule phases (warmup / stable / decay) shaded;
4. an event strip, one lane each: incidents (onset to detection), rollbacks (from the step where it
   happened back to the restored checkpoint), resumes and manual pauses, skip windows (the steps
   whose batches held the samples now on the skip list), guard skips.

Incidents, rollbacks and phase boundaries are also drawn as faint verticals through every panel,
so "did the spike come right after X?" is answered by eye.
"""

from __future__ import annotations

import math
import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sentinel.protocol import MarkerRecord, StepRecord, TimelineRecord

PHASE_COLORS = {"warmup": "#fdf1d6", "stable": "#e8f4ea", "decay": "#e6eef8", "floor": "#efefef"}
# "healthy" is an incident verified healthy after its rollback; "recovered" one whose spike passed with none
STATE_WORDS = {"healthy": "rolled back, healthy", "recovered": "recovered, no action", "escalated": "ESCALATED",
               "awaiting_approval": "awaiting approval"}
LANES = ("incidents", "rollbacks", "resumes / pauses", "skip windows", "guard skips")
PNG_SUFFIXES = ("", ".png")  # what a report may be named: it is always a PNG, written at exactly that path
SYSTEM_DIRS = ("/dev", "/proc", "/sys")  # never a place for a picture: /dev/null.png, /dev/full.png


class ReportError(ValueError):
    """Where the picture is to go cannot hold it (one line, for the CLI)."""


def check_out_path(out: str | Path) -> Path:
    """``out`` when a PNG can be written there as a new or replaced regular file; ``ReportError``
    (one line) otherwise, before any drawing: another suffix (matplotlib would pick the format by
    it, or fail on ``.txt``), an existing device, FIFO or directory, a place under /dev, /proc or
    /sys (``--out /dev/null`` once "succeeded" by writing /dev/null.png), a name the system refuses."""
    out = Path(out)
    if out.suffix.lower() not in PNG_SUFFIXES:
        raise ReportError(f"{out}: a report is a PNG image; name a .png file (not {out.suffix[:40]!r})")
    try:
        real = os.path.realpath(out)
        mode = os.stat(out).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:  # a name too long, a symlink loop, no permission
        raise ReportError(f"cannot write the report to {out}: {e.strerror or e}") from None
    if any(real == d or real.startswith(d + "/") for d in SYSTEM_DIRS):
        raise ReportError(f"{out}: a report is a file; not under {', '.join(SYSTEM_DIRS)}")
    if mode is not None and not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise ReportError(f"{out}: {what}; a report is written as a new or replaced .png file")
    return out


def _save_png(fig, out: Path, dpi: int) -> None:
    """The figure as a PNG at exactly ``out`` (whatever its suffix), written to a temporary file
    beside it and renamed over it: a failure (a full disk, a name too long) leaves any earlier
    picture whole, and is one ``ReportError`` line."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".png.tmp", dir=out.parent)
    except OSError as e:
        raise ReportError(f"cannot write the report to {out}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)  # as a plain open would, not mkstemp's 0600
            fig.savefig(f, dpi=dpi, format="png")
        os.replace(tmp, out)
    except OSError as e:
        raise ReportError(f"cannot write the report to {out}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass
class Segment:
    """The steps of one timeline as they were trained (``abandoned`` when a rollback superseded them)."""

    timeline: int
    steps: list[int]
    loss: list[float]
    grad_norm: list[float]
    lr: list[float]
    abandoned: bool = False


@dataclass
class ReportData:
    run: str
    segments: list[Segment] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, val PPL)
    guard_skips: list[tuple[int, float, str]] = field(default_factory=list)  # (step, loss, reason)
    rollbacks: list[dict[str, Any]] = field(default_factory=list)  # {"at": step, "to": step, "reason"}
    resumes: list[dict[str, Any]] = field(default_factory=list)  # {"step", "kind": resume|pause|stop}
    incidents: list[dict[str, Any]] = field(default_factory=list)  # {"id", "onset", "detect", "state", "rule"}
    skip_windows: list[tuple[int, int, int]] = field(default_factory=list)  # (first step, last step, samples)
    phases: list[tuple[str, int, int]] = field(default_factory=list)  # (name, first step, last step)
    focus: tuple[int, int] | None = None  # x-range to zoom on (an incident)
    title_note: str | None = None


# --------------------------------------------------------------------------------------------
# From records to data
# --------------------------------------------------------------------------------------------


def gather(run: str, records, *, skiplist: list[tuple[int, int]] | None = None, incidents: list | None = None,
           directives: list[dict] | None = None, config: dict | None = None) -> ReportData:
    """Build :class:`ReportData` from steps.jsonl records (steps, timeline records, markers), the skip
    list, incidents (``Incident`` objects or dicts) and the trainer's applied-directives log.

    ``records`` is read once, in order, and only what the figure draws is kept of each step (a long
    run's log is millions of records: held whole, gigabytes). Which steps a rollback superseded is
    settled after the pass, as ``authoritative_steps`` settles it: a step is abandoned when a later
    record has its step number, or a later timeline record restored a step before it."""
    data = ReportData(run=run)
    markers: list[MarkerRecord] = []
    froms: list[int] = []  # from_step of each timeline record, in order
    rows: list[tuple] = []  # (step, timeline, loss, grad_norm, lr, skipped, skip_reason, val_ppl, timeline records before it)
    hits = _SkipHits(skiplist or [])
    last_step = 0
    for r in records:
        if isinstance(r, TimelineRecord):
            if r.kind == "rollback":
                data.rollbacks.append({"at": last_step, "to": r.from_step, "reason": r.reason or ""})
            elif r.kind == "resume":
                data.resumes.append({"step": r.from_step, "kind": "resume"})
            froms.append(r.from_step)
            last_step = r.from_step
            continue
        if isinstance(r, MarkerRecord):
            markers.append(r)
            continue
        if not isinstance(r, StepRecord):
            continue
        rows.append((r.step, r.timeline, r.loss, r.grad_norm, r.lr, r.skipped, r.skip_reason, r.val_ppl, len(froms)))
        hits.add(r.step, r.sample_ids)
        last_step = r.step
    gone = _superseded(rows, froms)
    cur: Segment | None = None
    prev_marks = -1
    for (step, timeline, loss, grad_norm, lr, skipped, skip_reason, val_ppl, marks), abandoned in zip(rows, gone):
        if cur is None or marks != prev_marks or cur.abandoned != abandoned or cur.timeline != timeline:
            cur = Segment(timeline, [], [], [], [], abandoned=abandoned)
            data.segments.append(cur)
        prev_marks = marks
        cur.steps.append(step)
        cur.loss.append(loss)
        cur.grad_norm.append(grad_norm)
        cur.lr.append(lr)
        if skipped and not abandoned:
            data.guard_skips.append((step, loss, skip_reason or "skipped"))
        if val_ppl is not None and math.isfinite(val_ppl) and not abandoned:
            data.val.append((step, val_ppl))
    data.val = _last_per_step(data.val)
    data.skip_windows = hits.windows()
    data.incidents = [_incident(i) for i in incidents or []]
    for d in directives or []:
        if d.get("kind") in ("pause", "resume", "stop") and d.get("status") == "applied" and isinstance(d.get("step"), int):
            data.resumes.append({"step": d["step"], "kind": d["kind"]})
    data.phases = lr_phases(data.segments, markers, config)
    return data


def _superseded(rows: list[tuple], froms: list[int]) -> list[bool]:
    """For each step row (its step first, the number of timeline records before it last): did a later
    record of the same step, or a later timeline record restoring a step before it, supersede it?"""
    low = [math.inf] * (len(froms) + 1)  # the least from_step of the timeline records from index k on
    for k in range(len(froms) - 1, -1, -1):
        low[k] = min(froms[k], low[k + 1])
    seen = bytearray(max((row[0] for row in rows), default=0) + 1)  # steps with a later record
    out = [False] * len(rows)
    for i in range(len(rows) - 1, -1, -1):
        step, marks = rows[i][0], rows[i][-1]
        out[i] = bool(seen[step]) or step > low[marks]
        seen[step] = 1
    return out


def _last_per_step(pairs):
    d = {}
    for s, v in pairs:
        d[s] = v
    return sorted(d.items())


def _incident(inc) -> dict[str, Any]:
    d = inc if isinstance(inc, dict) else inc.model_dump(mode="json")
    return {"id": d.get("id", "?"), "onset": int(d.get("onset_step") or 0), "detect": int(d.get("detect_step") or 0),
            "state": d.get("state", "?"), "rule": d.get("rule", "?"), "rollback_to": d.get("rollback_to")}


class _SkipHits:
    """Steps (in any timeline) whose batch held a sample now on the skip list, counted as the records
    stream by (``add``), then as contiguous windows (``windows``)."""

    def __init__(self, skiplist: list[tuple[int, int]]):
        self.ranges = sorted((int(lo), int(hi)) for lo, hi in skiplist)
        self.los = [lo for lo, _ in self.ranges]
        self.hit: dict[int, int] = {}

    def add(self, step: int, sample_ids: list[int]) -> None:
        if not self.ranges:
            return
        from bisect import bisect_right

        los, ranges, n = self.los, self.ranges, 0
        for sid in sample_ids:
            j = bisect_right(los, sid) - 1
            if j >= 0 and sid < ranges[j][1]:
                n += 1
        if n:
            self.hit[step] = max(self.hit.get(step, 0), n)

    def windows(self) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        for s in sorted(self.hit):
            if out and s <= out[-1][1] + 1:
                out[-1] = (out[-1][0], s, out[-1][2] + self.hit[s])
            else:
                out.append((s, s, self.hit[s]))
        return out


def lr_phases(segments: list[Segment], markers: list, config: dict | None) -> list[tuple[str, int, int]]:
    """(phase, first step, last step): from warmup_end / decay_start markers when the trainer wrote
    them, else from the run config (linear warmup, then cosine decay to ``decay_steps``), else from
    the shape of the recorded LR."""
    steps = sorted({s for seg in segments for s in seg.steps})
    if not steps:
        return []
    first, last = steps[0], steps[-1]
    warm = next((m.step for m in markers if m.marker == "warmup_end"), None)
    decay = next((m.step for m in markers if m.marker == "decay_start"), None)
    optim = (config or {}).get("optim") or {}
    optim = optim if isinstance(optim, dict) else {}
    decay_end = _steps_or_none(optim.get("decay_steps")) or _steps_or_none((config or {}).get("max_steps"))
    if warm is None:
        warm = _steps_or_none(optim.get("warmup_steps"))
    if decay is None and warm is not None and (optim or markers):
        decay = warm  # warmup_cosine: the decay starts right after the warmup
    if warm is None and decay is None:
        return _phases_from_shape(segments)
    out = []
    w = warm or 0
    if w >= first:
        out.append(("warmup", first, min(w, last)))
    if decay is not None and decay > w:
        out.append(("stable", max(w + 1, first), min(decay, last)))
    d0 = max(decay if decay is not None else w, w) + 1
    d1 = min(int(decay_end), last) if decay_end else last
    if d0 <= d1:
        out.append(("decay", max(d0, first), d1))
    if decay_end and int(decay_end) < last:
        out.append(("floor", int(decay_end) + 1, last))
    return [p for p in out if p[1] <= p[2]]


def _steps_or_none(x: Any) -> int | None:
    """A step count from the run config, or None when it is not one ("x", a list, NaN, 1e999)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not (0 <= x <= 2**53):  # NaN fails the range too
        return None
    return int(x)


def _phases_from_shape(segments: list[Segment]) -> list[tuple[str, int, int]]:
    pts = sorted({s: lr for seg in segments if not seg.abandoned for s, lr in zip(seg.steps, seg.lr)}.items())
    if len(pts) < 3:
        return []
    lrs = [v for _, v in pts]
    sm = [sorted(lrs[max(0, i - 2): i + 3])[len(lrs[max(0, i - 2): i + 3]) // 2] for i in range(len(lrs))]  # drills out
    out: list[list] = []
    for i in range(1, len(pts)):
        d = (sm[i] - sm[i - 1]) / max(abs(sm[i - 1]), 1e-30)
        kind = "warmup" if d > 1e-3 else "decay" if d < -1e-3 else "stable"
        if out and out[-1][0] == kind:
            out[-1][2] = pts[i][0]
        else:
            out.append([kind, pts[i - 1][0], pts[i][0]])
    return [tuple(p) for p in out]


# --------------------------------------------------------------------------------------------
# Painting
# --------------------------------------------------------------------------------------------


def render(data: ReportData, out: str | Path, *, dpi: int = 110) -> Path:
    """Paint ``data`` into a PNG at exactly ``out`` (parent directories created); returns the path.
    ``ReportError`` (one line) when ``out`` cannot be one (``check_out_path``) or cannot be written."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        from sentinel.client.extras import missing_message

        raise ReportError(missing_message("matplotlib", "the report")) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    out = check_out_path(out)
    fig, axes = plt.subplots(4, 1, sharex=True, figsize=(13, 9.2), layout="constrained",
                             gridspec_kw={"height_ratios": [3.2, 1.5, 1.1, 1.5]})
    ax_loss, ax_gn, ax_lr, ax_ev = axes
    all_steps = [s for seg in data.segments for s in seg.steps]
    x0, x1 = (min(all_steps), max(all_steps)) if all_steps else (0, 1)
    if data.focus:
        x0, x1 = max(x0, data.focus[0]), min(x1, data.focus[1]) if data.focus[1] > data.focus[0] else x1

    # --- schedule phases behind everything
    for name, a, b in data.phases:
        for ax in axes:
            ax.axvspan(a - 0.5, b + 0.5, color=PHASE_COLORS.get(name, "#f4f4f4"), zorder=0, lw=0)
        if b >= x0 and a <= x1:  # named above the top panel, where no curve runs
            ax_loss.text((max(a, x0) + min(b, x1)) / 2, 1.01, f"LR {name}", transform=ax_loss.get_xaxis_transform(),
                         ha="center", va="bottom", fontsize=8, color="#555555")

    # --- 1. loss (+ val PPL)
    for seg in data.segments:
        if seg.abandoned:
            ax_loss.plot(seg.steps, _finite(seg.loss), color="#9a9a9a", lw=1.0, ls="--", zorder=2)
            ax_gn.plot(seg.steps, _positive(seg.grad_norm), color="#9a9a9a", lw=0.9, ls="--", zorder=2)
        else:
            ax_loss.plot(seg.steps, _finite(seg.loss), color="#1f5fa8", lw=1.3, zorder=3)
            ax_gn.plot(seg.steps, _positive(seg.grad_norm), color="#6a3d9a", lw=1.1, zorder=3)
            ax_lr.plot(seg.steps, seg.lr, color="#333333", lw=1.1, zorder=3)
    nonfinite = [(s, 0.0) for seg in data.segments for s, v in zip(seg.steps, seg.loss) if not math.isfinite(v)]
    if data.guard_skips:
        gs = [(s, v) for s, v, _ in data.guard_skips if math.isfinite(v)]
        if gs:
            ax_loss.scatter(*zip(*gs), marker="x", color="#d62728", s=36, zorder=5, lw=1.6)
    if nonfinite:
        ax_loss.scatter([s for s, _ in nonfinite], [0.02] * len(nonfinite), marker="^", color="#d62728", s=40, zorder=5,
                        transform=ax_loss.get_xaxis_transform(), clip_on=False)
    ax_loss.set_ylabel("train loss")
    _clip_loss_axis(ax_loss, data)
    if data.val:
        axv = ax_loss.twinx()
        vs, vp = zip(*data.val)
        axv.plot(vs, vp, color="#e6730f", marker="o", ms=4.5, lw=1.0, ls=":", zorder=4)
        axv.set_ylabel("val PPL", color="#e6730f")
        axv.tick_params(axis="y", colors="#e6730f")
        axv.set_zorder(ax_loss.get_zorder() + 1)
        axv.patch.set_visible(False)

    # --- 2. grad norm
    gns = [v for seg in data.segments for v in seg.grad_norm if math.isfinite(v) and v > 0]
    if gns and max(gns) / min(gns) > 20:  # a spike of 10x and more stays on the chart without flattening the rest
        ax_gn.set_yscale("log")
    ax_gn.set_ylabel("grad norm")
    # --- 3. LR
    ax_lr.set_ylabel("LR")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    _mark_lr_spikes(ax_lr, data)

    # --- verticals through every panel: incident onsets, rollbacks
    for inc in data.incidents:
        for ax in axes[:3]:
            ax.axvspan(inc["onset"] - 0.5, max(inc["detect"], inc["onset"]) + 0.5, color="#d62728", alpha=0.13, zorder=1, lw=0)
            ax.axvline(inc["onset"], color="#d62728", lw=0.8, alpha=0.6, zorder=1)
    for rb in data.rollbacks:
        for ax in axes[:3]:
            ax.axvline(rb["to"], color="#2ca02c", lw=1.0, ls=":", zorder=1)

    # --- 4. event strip
    lane = {name: len(LANES) - 1 - i for i, name in enumerate(LANES)}
    for inc in data.incidents:
        y = lane["incidents"]
        ax_ev.broken_barh([(inc["onset"] - 0.5, max(inc["detect"] - inc["onset"], 0) + 1)], (y - 0.35, 0.7),
                          color="#d62728", alpha=0.8)
        ax_ev.annotate(f"{_short(inc['id'])} {inc['rule']} ({STATE_WORDS.get(inc['state'], inc['state'])})",
                       (inc["onset"], y + 0.38), fontsize=7.5,
                       color="#8b0000", ha="left", va="bottom", annotation_clip=True)
    for rb in data.rollbacks:
        y = lane["rollbacks"]
        ax_ev.annotate("", xy=(rb["to"], y), xytext=(max(rb["at"], rb["to"] + 1), y),
                       arrowprops={"arrowstyle": "-|>", "color": "#2ca02c", "lw": 1.8})
        ax_ev.text(rb["to"], y + 0.38, f"rollback to {rb['to']}", fontsize=7.5, color="#1a6b1a", va="bottom")
    marks = {"resume": ("o", "#1f77b4"), "pause": ("s", "#ff7f0e"), "stop": ("X", "#000000")}
    for ev in data.resumes:
        m, c = marks.get(ev["kind"], ("o", "#1f77b4"))
        ax_ev.scatter([ev["step"]], [lane["resumes / pauses"]], marker=m, color=c, s=40, zorder=4)
    for a, b, _n in data.skip_windows:
        y = lane["skip windows"]
        ax_ev.broken_barh([(a - 0.5, b - a + 1)], (y - 0.3, 0.6), color="#8c564b", alpha=0.75)
    if data.skip_windows:
        tot = sum(n for _, _, n in data.skip_windows)
        ax_ev.text(data.skip_windows[0][0], lane["skip windows"] + 0.34, f"{tot} skipped sample(s) were trained here",
                   fontsize=7.5, color="#5a3a2f", va="bottom")
    if data.guard_skips:
        ax_ev.scatter([s for s, _, _ in data.guard_skips], [lane["guard skips"]] * len(data.guard_skips), marker="x",
                      color="#d62728", s=30, lw=1.5)
    ax_ev.set_yticks(range(len(LANES)))
    ax_ev.set_yticklabels(list(reversed(LANES)), fontsize=8)
    ax_ev.set_ylim(-0.7, len(LANES) - 0.2)
    ax_ev.set_xlabel("optimizer step")
    ax_ev.grid(axis="x", color="#dddddd", lw=0.6)

    for ax in axes:
        ax.set_xlim(x0 - 0.5, x1 + 0.5)
        ax.margins(x=0)
    for ax in axes[:3]:
        ax.grid(True, color="#dddddd", lw=0.6)

    # --- title and legend
    n_rb = len(data.rollbacks)
    fin = next((seg.loss[-1] for seg in reversed(data.segments) if not seg.abandoned and seg.loss), None)
    head = f"run {data.run}: steps {x0}-{x1}"
    if fin is not None:
        head += f", last loss {fin:.4g}"
    if data.val:
        head += f", val PPL {data.val[-1][1]:.4g}"
    sub = (f"{len(data.incidents)} incident(s), {n_rb} rollback(s), {len(data.guard_skips)} guard skip(s), "
           f"{sum(n for _, _, n in data.skip_windows)} skipped sample(s) seen in training")
    fig.suptitle(head + ("\n" + data.title_note if data.title_note else "") + "\n" + sub, fontsize=11)
    handles = [Line2D([], [], color="#1f5fa8", lw=1.5, label="train loss"),
               Line2D([], [], color="#9a9a9a", lw=1.2, ls="--", label="abandoned by a rollback"),
               Line2D([], [], color="#e6730f", marker="o", lw=1.0, ls=":", label="val PPL (right axis)"),
               Line2D([], [], color="#d62728", marker="x", lw=0, label="guard skip"),
               Patch(color="#d62728", alpha=0.3, label="incident (onset to detection)"),
               Line2D([], [], color="#2ca02c", ls=":", label="rollback target"),
               *[Patch(color=PHASE_COLORS[p], label=f"LR {p}") for p in ("warmup", "stable", "decay")
                 if any(name == p for name, _, _ in data.phases)]]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 5), fontsize=8.5, frameon=False)
    try:
        _save_png(fig, out, dpi)
    finally:
        plt.close(fig)
    return out


def _finite(xs):
    return [x if math.isfinite(x) else float("nan") for x in xs]


def _positive(xs):
    return [x if math.isfinite(x) and x > 0 else float("nan") for x in xs]


def _mark_lr_spikes(ax, data: ReportData) -> None:
    """The schedule stays readable on a linear axis; an LR far above it (a drill, a bad config push,
    often on a step a rollback abandoned) is marked where it happened, with its factor."""
    sched = {s: v for seg in data.segments if not seg.abandoned for s, v in zip(seg.steps, seg.lr)}
    if not sched:
        return
    top = max(sched.values())
    ax.set_ylim(0, top * 1.25)
    seen = set()
    for seg in data.segments:
        for s, v in zip(seg.steps, seg.lr):
            near = sorted(sched[k] for k in (s - 2, s - 1, s + 1, s + 2) if k in sched)
            ref = (near[len(near) // 2] if near else None) or top
            if v > 3 * ref and s not in seen:  # a warmup ramp (x2 at step 2) is not a spike
                seen.add(s)
                ax.annotate(f"LR x{v / ref:.3g} at step {s}" + (" (abandoned)" if seg.abandoned else ""),
                            xy=(s, top * 1.22), xytext=(4, -2), textcoords="offset points", fontsize=8, color="#b00000",
                            va="top")
                ax.axvline(s, color="#b00000", lw=1.2, zorder=4)


def _clip_loss_axis(ax, data: ReportData) -> None:
    """Keep the healthy curve readable: a spike to 100x does not flatten everything else. The
    axis covers the healthy losses plus a margin; a clipped spike is marked at the top with its value."""
    healthy = sorted(v for seg in data.segments if not seg.abandoned for v in seg.loss if math.isfinite(v))
    allv = [(s, v) for seg in data.segments for s, v in zip(seg.steps, seg.loss) if math.isfinite(v)]
    if not healthy or not allv:
        return
    lo = healthy[0]
    p98 = healthy[min(len(healthy) - 1, int(0.98 * len(healthy)))]
    top = max(p98, healthy[0]) + 0.25 * max(p98 - lo, 0.1)
    peak = max(v for _, v in allv)
    if peak > top * 1.05:
        ymax = min(peak * 1.05, max(top * 1.6, lo + 2.5 * (top - lo)))
        ax.set_ylim(lo - 0.05 * (ymax - lo), ymax)
        s_peak = max(allv, key=lambda p: p[1])[0]
        if peak > ymax:
            ax.annotate(f"peak {peak:.3g} at step {s_peak}", xy=(s_peak, ymax), xytext=(6, -12),
                        textcoords="offset points", fontsize=8, color="#8b0000",
                        arrowprops={"arrowstyle": "-", "color": "#8b0000", "lw": 0.8})


def _short(iid: str) -> str:
    """``RUN-t0-s151`` -> ``t0-s151``: the run is in the title already."""
    parts = iid.split("-")
    tail = [p for p in parts if p[:1] in "ts" and p[1:].isdigit()]
    return "-".join(tail) if tail else iid[-16:]
