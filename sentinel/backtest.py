"""Run the rules offline over a recorded step log: what would the sentinel have flagged and done?

Backtest = live. It drives the very ``RunPolicy`` the daemon uses, in the mode the daemon runs
(``dry_run`` and ``require_approval`` as the rules say), with the policy's clock set to the records'
own timestamps so cooldowns and rate limits replay as they would have live. What it assumes, and why:

- **Checkpoints.** A log rarely says which checkpoints existed, so one is assumed every
  ``checkpoint_every`` steps (as most trainers are configured; also at a multiple the log has no
  line for: a trainer saves on schedule whether or not it logs that step), and one of the initial state
  (step 0) when the trace begins within the first interval (``initial_checkpoint``: our trainer
  saves it on a fresh start, so damage before the first periodic save is rolled back to a restart
  that skips its data, not only paged); ``None``/0 assumes none (every incident then escalates).
- **No guard information means no guard.** A loss-only trace (``{"step", "loss", "wall_ms"}``) has
  ``skipped = false`` on every step: the backtest never assumes that an in-process guard would have
  skipped a spike. (The policy judges a spike by the steps after it either way.)
- **No judging of records that would never have existed.** Once the policy orders a rollback (or a
  pause: an escalation, or a wait for approval), the live run would have restored a checkpoint (or
  stopped), so the trace's later records on that timeline would not exist. The backtest stops
  judging there and counts them as ``unjudged``; it resumes when the trace's own timeline moves on
  (a rollback/resume marker with a higher timeline, as a real ``steps.jsonl`` has). A loss-only
  curve has no such marker: its first rollback or pause is its last decision, unless its steps go
  back (next point).
- **A step that goes back is a restart.** A log without markers (a text log appended to by a requeued
  job, a TensorBoard or W&B export of a resumed run) shows a restart only by its step numbers
  falling: steps 1-1000, then 501, 502, ... That is read as a resume from the step before
  (``restarts``; the same as the marker our trainer writes: a new timeline, the loss baselines
  rewound to it, the later checkpoints of the abandoned branch forgotten) and never as a sudden
  change of the loss. It is a restart only when the log carries on from the lower step: one stray
  or swapped line (step 300 again after 700, then 701) is dropped and counted (``out_of_order``),
  as the live bus's gate drops it. A step logged twice in a row is a duplicate line: the first is
  kept, the second skipped and counted (``duplicates``), as the live bus rejects a replayed step.
- **The clock only moves forward.** The policy's clock is the records' own time (``time``, else
  ``wall_ms``), but a log's timer that starts again (a requeued job's; modded-nanogpt's after its
  first 10 steps) adds nothing: rate limits and cooldowns in seconds count only time the log shows
  passing, so an old rollback never reads as a recent one.
- Findings (``flagged``) are reported for judged records only.

``load_trace`` is tolerant: a line needs only ``step`` and ``loss``; missing StepRecord fields get
neutral values (``grad_norm = 0`` means "not reported" to the rules). A malformed line (not JSON,
a wrong type, a missing field) is rejected with a one-line reason naming the file and line, and
the read goes on (``sentinel backtest`` counts them; ``--strict`` stops at the first instead).
A CSV export (W&B, TensorBoard, pandas) is read row by row into the same dicts (``trace_csv``), and
so is a Hugging Face ``trainer_state.json``'s log history (``trace_hf``): they pass the same checks.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sentinel.policy import RunPolicy
from sentinel.protocol import CheckpointInfo, MarkerRecord, SchemaError, StepRecord, TimelineRecord, record_range_error
from sentinel.rules import RuleSet, default_rules
from sentinel.trace_csv import CsvHeaderError, csv_rows
from sentinel.trace_hf import hf_entries
from sentinel.trace_names import TraceKeyError, canonical_step_keys, null_loss_is_nan
from sentinel.trace_open import (  # noqa: F401  (MAX_LINE_BYTES, _capped_lines, json_file_is_trace: re-exported)
    _STREAM_ERRORS,
    MAX_LINE_BYTES,
    TraceTooLong,
    _capped_lines,
    _json_entries,
    _one_line,
    _open_trace,
    _trace_format,
    json_file_is_trace,
)
from sentinel.trace_tb import TbError, event_subdirs, is_dir, is_event_path, tb_rows
from sentinel.trace_text import text_rows


@dataclass
class BacktestResult:
    flagged: list[int] = field(default_factory=list)  # steps any rule flagged (sorted, unique)
    actions: list[dict[str, Any]] = field(default_factory=list)  # what the policy would have done, with step
    fired: list[dict[str, Any]] = field(default_factory=list)  # the first FIRED_KEPT findings: step, rule, severity, detail
    fired_count: int = 0  # every finding (a rule that fires on every step of a long log fires millions of times)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    records: int = 0
    unjudged: int = 0  # records after a rollback/pause that the live run would not have produced
    restarts: int = 0  # steps that went back without a marker: read as resumes
    duplicates: int = 0  # a step logged again right after itself: skipped
    out_of_order: int = 0  # a step that went back while the steps after it carried on: dropped, as live

    def to_json(self) -> dict[str, Any]:
        return {"flagged": self.flagged, "actions": self.actions, "records": self.records, "unjudged": self.unjudged,
                "restarts": self.restarts, "duplicates": self.duplicates, "out_of_order": self.out_of_order,
                "incidents": [{k: i[k] for k in ("id", "state", "rule", "onset_step", "detect_step", "pattern")}
                              for i in self.incidents]}


STOPS_THE_TIMELINE = frozenset({"rollback", "pause", "stop"})
FIRED_KEPT = 10_000  # findings kept for the tables; ``fired_count`` counts them all


def parse_trace_line(line: str, *, default_run: str = "trace", where: str = "trace", step_key: str | None = None,
                     loss_key: str | None = None, used: dict[str, Any] | None = None) -> StepRecord | TimelineRecord:
    """One JSON line -> a record; step lines may carry only ``step`` and ``loss``, under our names or
    another tool's (``_step``, ``global_step``, ``iter``; ``train/loss``, ``train_loss``, ...: see
    ``trace_names``), or under the keys ``step_key`` / ``loss_key``."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SchemaError(f"{where}: not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    except RecursionError:  # a hostile line: thousands of nested [ or {
        raise SchemaError(f"{where}: not valid JSON (nested too deeply)") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"{where}: expected a JSON object")
    obj = _ours_or_step(obj)
    if obj.get("kind", "step") == "step":
        try:
            obj = canonical_step_keys(obj, step_key, loss_key, used)
        except TraceKeyError as e:
            raise SchemaError(f"{where}: {e}") from None
    return record_from_obj(obj, default_run=default_run, where=where)


def record_from_obj(obj: dict[str, Any], *, default_run: str = "trace", where: str = "trace") -> StepRecord | TimelineRecord:
    """A decoded trace line (a JSON object, or a CSV row as ``trace_csv`` reads it) -> a record."""
    obj = _ours_or_step(obj)
    kind = obj.get("kind", "step")
    if kind == "step":
        # null is "not reported" for every field but the two a step line is about: exported tables
        # (pandas, W&B) write a missing grad norm or val loss as null, and one such column must not
        # cost every line. A null loss on a line with nothing else is a NaN a strict JSON writer
        # wrote (``null_loss_is_nan``); one on a line of other metrics is no training step (an error).
        if "loss" in obj and obj["loss"] is None and null_loss_is_nan(k for k, v in obj.items() if v is not None):
            obj["loss"] = float("nan")
        for k in [k for k, v in obj.items() if v is None and k not in ("step", "loss")]:
            del obj[k]
    obj.setdefault("run", default_run)
    if kind != "step":
        try:
            rec = MarkerRecord.from_json(obj) if kind == "marker" else TimelineRecord.from_json(obj)
        except SchemaError as e:
            raise SchemaError(f"{where}: {e}") from None
        bad = record_range_error(rec)
        if bad:
            raise SchemaError(f"{where}: {bad}")
        return rec
    for k in ("step", "loss"):
        if k not in obj:
            raise SchemaError(f"{where}: a step line needs at least 'step' and 'loss' (missing {k!r})")
    if not isinstance(obj["run"], str):  # another tool's run number: the trace's own name instead
        obj["run"] = default_run
    if "time" in obj and not _is_number(obj["time"]):  # an ISO timestamp: its Unix time; else the log's clock
        obj["time"] = _iso_time(obj["time"])
    if obj.get("time") is None:
        obj["time"] = _time_of(obj)
    loss = obj["loss"]
    obj.setdefault("loss_max_rank", loss)
    obj.setdefault("grad_norm", 0.0)
    obj.setdefault("lr", 0.0)
    obj.setdefault("tokens", 0)
    obj.setdefault("batch_fingerprint", "")
    try:
        rec = StepRecord.from_json(obj)
    except SchemaError as e:
        raise SchemaError(f"{where}: {e}") from None
    bad = record_range_error(rec)  # what the live gate rejects as out of range (a step past 2^53, a negative loss)
    if bad:
        raise SchemaError(f"{where}: {bad}")
    return rec


RECORD_KINDS = ("step", "marker", "start", "resume", "rollback")  # a line's ``kind`` that names one of our records


def _ours_or_step(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj``, less a ``kind`` that names none of our records (another tool's ``"kind": "train"``):
    such a line is a step line like any other."""
    kind = obj.get("kind", "step")
    if not isinstance(kind, str) or kind in RECORD_KINDS:  # a non-string kind is an error, judged as one
        return obj
    return {k: v for k, v in obj.items() if k != "kind"}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _iso_time(v: Any) -> float | None:
    """Unix seconds of an ISO 8601 timestamp string (``2024-10-14T02:31:07Z``; no zone: UTC);
    None for anything else."""
    if not isinstance(v, str) or len(v) > 64:
        return None
    try:
        t = datetime.fromisoformat(v.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def _time_of(obj: dict[str, Any]) -> float:
    """Seconds for a line without ``time``: ``wall_ms`` / 1000, else the step number (a clock that
    only moves forward); 0.0 when neither is a number (the step is then rejected by the schema)."""
    for v, scale in ((obj.get("wall_ms"), 1000.0), (obj.get("step"), 1.0)):
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                t = float(v) / scale
            except OverflowError:  # an integer beyond float range
                continue
            if t == t and abs(t) != float("inf"):
                return t
    return 0.0


TRACE_FORMATS = ("auto", "jsonl", "json", "csv", "hf", "text", "tb")


def load_trace(path: str | Path, *, rejected: list[str] | None = None, fmt: str = "auto", step_column: str | None = None,
               loss_column: str | None = None, source: dict[str, Any] | None = None) -> list[StepRecord | TimelineRecord]:
    """``iter_trace``, read whole into a list."""
    return list(iter_trace(path, rejected=rejected, fmt=fmt, step_column=step_column, loss_column=loss_column, source=source))


def iter_trace(path: str | Path, *, rejected: list[str] | None = None, fmt: str = "auto", step_column: str | None = None,
               loss_column: str | None = None, source: dict[str, Any] | None = None) -> Iterator[StepRecord | TimelineRecord]:
    """The records of a trace, read as they are taken: a log of millions of steps is judged in
    bounded memory (read whole, an 18-day run's steps.jsonl held gigabytes of records). The
    errors below are raised when the reading reaches them: what the file is, before the first
    record; a bad line, at that line.

    Read a steps.jsonl, a loss-only trace, a CSV export (W&B, TensorBoard, pandas: see
    ``trace_csv``) or a Hugging Face ``trainer_state.json`` (``trace_hf``). Errors name the file
    and line (or entry), in one line.

    ``fmt`` "auto": a ``.csv``/``.tsv`` file is CSV; a ``.json`` file that is one JSON object with a
    ``log_history`` list is a trainer state; a file that is one JSON list, or a ``.json`` file that
    is one table as pandas writes one, is a history document (``trace_json``);
    ``.jsonl``/``.json``/``.ndjson`` otherwise JSON lines;
    any other name is JSON lines when its first line is a JSON object, CSV when it is a header with
    commas or tabs (and no step line), else a trainer's text log (``trace_text``). A gzip, bzip2 or
    xz file (by its first bytes) is read decompressed and named without its ``.gz``/``.bz2``/``.xz``.
    With ``rejected`` (a list), a bad line is appended there (its one-line reason) and skipped
    instead of stopping the read. ``source`` (a dict) gets what was read: the ``format`` and, where
    the format names them, the ``step`` and ``loss`` columns, keys or tag (TensorBoard: also the
    ``grad_norm`` tag and the number of ``files``)."""
    if fmt not in TRACE_FORMATS:
        raise ValueError(f"unknown trace format {fmt!r} (one of {', '.join(TRACE_FORMATS)})")
    src: dict[str, Any] = source if source is not None else {}
    if fmt == "tb" or (fmt == "auto" and is_event_path(Path(path))):
        src["format"] = "tb"
        yield from _load_events(Path(path), rejected, loss_column, src)
        return
    if is_dir(Path(path)):
        runs = event_subdirs(Path(path))
        hint = f" (TensorBoard runs below it: {', '.join(str(r) for r in runs[:3])}{' ...' if len(runs) > 3 else ''})" if runs else ""
        raise SchemaError(f"{path}: a directory; name a log file, or a directory of TensorBoard event files{hint}")
    try:
        yield from _iter_file(path, rejected, fmt, step_column, loss_column, src)
    except TraceTooLong as e:
        raise SchemaError(f"{path}: {e}") from None


def _iter_file(path, rejected, fmt, step_column, loss_column, src) -> Iterator[StepRecord | TimelineRecord]:
    n = 0  # records read
    with ExitStack() as opened:
        fh, p = _open_trace(Path(path), opened)
        run = p.stem or "trace"
        try:
            fmt, history = _trace_format(p, fh, fmt)
        except _STREAM_ERRORS as e:
            raise SchemaError(f"{path}: not a readable compressed file ({_one_line(e)})") from None
        src["format"] = fmt
        if fmt == "hf":
            src.update(step="step", loss="loss")
            entries: Iterator[tuple[str, Any]] = hf_entries(history or [], str(path))
        elif fmt == "json":
            entries = _canonical_rows(history or iter(()), step_column, loss_column, src)
        elif fmt == "csv":
            entries = ((f"{path}:{n}", e) for n, e in csv_rows(_capped_lines(fh), str(path), step_column=step_column,
                                                               loss_column=loss_column, source=src))
        elif fmt == "text":
            entries = ((f"{path}:{n}", e) for n, e in text_rows(_capped_lines(fh), str(path)))
        else:
            entries = _json_entries(fh, str(path))
        try:
            for rec in _read_entries(entries, run=run, rejected=rejected, step_key=step_column, loss_key=loss_column,
                                     used=src if fmt == "jsonl" else None):
                n += 1
                yield rec
        except CsvHeaderError as e:
            raise SchemaError(str(e)) from None
        except _STREAM_ERRORS as e:  # a compressed log cut short (a copy that did not finish) or damaged
            why = f"{path}: the compressed stream ends early or is damaged after {n} record(s) ({_one_line(e)})"
            if rejected is None:
                raise SchemaError(why) from None
            rejected.append(why)  # what was read stays judged
    if fmt == "text" and not n:
        raise SchemaError(f"{path}: read as a text log, but no line names a step and a training loss "
                          f"(like 'step:100 loss:3.21' or 'iter 100: loss 3.21'); --format names another format")


def _read_entries(entries: Iterable[tuple[str, Any]], *, run: str, rejected: list[str] | None, step_key: str | None = None,
                  loss_key: str | None = None, used: dict[str, Any] | None = None) -> Iterator[StepRecord | TimelineRecord]:
    """Each entry's record (from a JSON line as bytes, or a decoded dict); an entry that is a reason
    string, or whose record fails its checks, goes to ``rejected`` as one line (None: the
    ``SchemaError`` is raised). What was yielded before a stream error stays judged."""
    for where, entry in entries:
        try:
            if isinstance(entry, str):  # a row or entry rejected with this reason
                raise SchemaError(entry)
            rec = (parse_trace_line(entry, default_run=run, where=where, step_key=step_key, loss_key=loss_key, used=used)
                   if isinstance(entry, bytes) else record_from_obj(entry, default_run=run, where=where))
        except SchemaError as e:
            if rejected is None:
                raise
            rejected.append(str(e))
            continue
        yield rec


def _canonical_rows(rows: Iterable[tuple[str, Any]], step_key: str | None, loss_key: str | None,
                    used: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """A history document's rows with their step and loss found under any of their names (as a
    JSON line's are: ``canonical_step_keys``); a row naming no such key becomes its reason."""
    for where, row in rows:
        if isinstance(row, dict) and row.get("kind", "step") == "step":
            try:
                row = canonical_step_keys(row, step_key, loss_key, used)
            except TraceKeyError as e:
                row = f"{where}: {e}"
        yield where, row


def _load_events(p: Path, rejected: list[str] | None, loss_tag: str | None, source: dict[str, Any]) -> Iterator[StepRecord | TimelineRecord]:
    """A TensorBoard event file, or a directory of them (``trace_tb``), as records."""
    run = (p.name if is_dir(p) else p.parent.name) or "trace"
    try:
        yield from _read_entries(tb_rows(p, loss_tag=loss_tag, source=source), run=run, rejected=rejected)
    except TbError as e:
        raise SchemaError(str(e)) from None
    except OSError as e:
        raise SchemaError(f"{p}: cannot read ({e.strerror or _one_line(e)})") from None


# (magic bytes, opener, the suffix it is written with): archived logs are compressed
def _simulated_checkpoint(rec: StepRecord, step: int | None = None) -> CheckpointInfo:
    """The checkpoint assumed at ``step`` (default: ``rec``'s), seen when ``rec`` is read."""
    step = rec.step if step is None else step
    return CheckpointInfo(run=rec.run, step=step, path=f"<assumed>/step-{step:08d}", created=rec.time, bytes=0,
                          manifest_sha256="", world_size=rec.world_size, timeline=rec.timeline, verified="unverified")


UNLOGGED_SAVES = 8  # at most this many assumed checkpoints for one gap in the steps (the newest matter)


def _unlogged_saves(prev: int, step: int, every: int) -> list[int]:
    """The multiples of ``every`` strictly between steps ``prev`` and ``step`` (the newest
    ``UNLOGGED_SAVES`` of them): saves the log passed without a line for their step."""
    top = (step - 1) // every * every
    if top <= prev:
        return []
    low = max(prev // every * every + every, top - (UNLOGGED_SAVES - 1) * every)
    return list(range(low, top + 1, every))


def _implied_restarts(records: Iterable[StepRecord | TimelineRecord | MarkerRecord],
                      res: BacktestResult) -> Iterator[StepRecord | TimelineRecord | MarkerRecord]:
    """``records`` with a resume marker before each step that goes back on its timeline, and every
    later record moved to a new timeline (as our trainer numbers them); a step logged again right
    after itself is dropped. Counts both in ``res``.

    A step that goes back is a restart only when the log carries on from there: the next step is at
    or below the last one too (steps 1-1000, then 501, 502, ...). A stray line (step 300 printed
    again after step 700, then 701) or two lines swapped (805 after 806, then 807) is dropped and
    counted (``out_of_order``), as the live bus's gate drops a step that goes back on its timeline:
    read as a restart it would forget the checkpoints after it and rewind the tests."""
    shift = 0  # timelines added so far
    last: int | None = None  # the last step on the current timeline
    timeline = None
    it = iter(records)
    ahead: list[StepRecord | TimelineRecord | MarkerRecord] = []  # read to look past a step that went back
    while True:
        rec = ahead.pop(0) if ahead else next(it, None)
        if rec is None:
            return
        if shift:
            rec = rec.model_copy(update={"timeline": rec.timeline + shift})
        if isinstance(rec, TimelineRecord):
            timeline, last = rec.timeline, rec.from_step
        elif isinstance(rec, StepRecord):
            if timeline is not None and rec.timeline == timeline and last is not None and rec.step <= last:
                if rec.step == last:
                    res.duplicates += 1
                    continue
                nxt = None  # the next step or timeline record, not yet moved by ``shift``
                while nxt is None:
                    o = next(it, None)
                    if o is None:
                        break
                    ahead.append(o)
                    if isinstance(o, (StepRecord, TimelineRecord)):
                        nxt = o
                if not (isinstance(nxt, StepRecord) and nxt.timeline + shift == timeline and nxt.step <= last):
                    res.out_of_order += 1
                    continue
                shift += 1
                s = rec.step - 1
                yield TimelineRecord(kind="start" if s <= 0 else "resume", run=rec.run, from_step=max(s, 0),
                                     timeline=rec.timeline + 1, time=rec.time,
                                     reason=f"the trace's steps went back from {last} to {rec.step} with no marker")
                res.restarts += 1
                rec = rec.model_copy(update={"timeline": rec.timeline + 1})
            timeline, last = rec.timeline, rec.step
        yield rec


def backtest(records: Iterable[StepRecord | TimelineRecord], rules: RuleSet | None = None, *,
             checkpoint_every: int | None = 100, checkpoints: Iterable[CheckpointInfo] = (),
             initial_checkpoint: bool = True) -> BacktestResult:
    """Replay ``records`` through the live RunPolicy; return flagged steps, findings and actions."""
    rules = rules or default_rules()
    now = [0.0]
    policy: RunPolicy | None = None
    res = BacktestResult()
    flagged: set[int] = set()
    stopped_at: int | None = None  # timeline on which the run was rolled back or paused
    clock_shift = 0.0  # added to the records' times to keep the clock from going back
    prev_step: int | None = None  # the last step judged on the current timeline (or the one it resumed from)
    for rec in _implied_restarts(records, res):
        if policy is None:
            now[0] = rec.time
            policy = RunPolicy(rec.run, rules, clock=lambda: now[0])
            for c in checkpoints:
                policy.on_checkpoint(c)
            first = rec.from_step if isinstance(rec, TimelineRecord) else rec.step
            if checkpoint_every and initial_checkpoint and first <= checkpoint_every:
                policy.on_checkpoint(CheckpointInfo(run=rec.run, step=0, path="<assumed>/step-00000000", created=rec.time,
                                                    bytes=0, manifest_sha256="", timeline=rec.timeline, verified="unverified",
                                                    world_size=getattr(rec, "world_size", 1)))
        if stopped_at is not None:
            if rec.timeline <= stopped_at:
                res.unjudged += isinstance(rec, StepRecord)
                continue
            stopped_at = None  # the trace's own timeline moved on: judge again
        # the policy's clock only moves forward: a log's clock that starts again (a restarted job's
        # timer, modded-nanogpt's after its first 10 steps) adds nothing, so rate limits and
        # cooldowns in seconds count the time the log shows passing
        t = rec.time + clock_shift
        if t < now[0]:
            clock_shift += now[0] - t
            t = now[0]
        now[0] = t
        if isinstance(rec, MarkerRecord):
            policy.on_marker(rec)  # as live: a planned change of the loss level restarts its baselines
            continue
        if isinstance(rec, TimelineRecord):
            policy.on_timeline(rec)
            prev_step = rec.from_step
        else:
            res.records += 1
            if checkpoint_every and prev_step is not None:
                # the trainer saved on schedule whether or not it logged that step: a log of every
                # 10th step, or one with a line missing, still had the checkpoint in between
                for s in _unlogged_saves(prev_step, rec.step, checkpoint_every):
                    policy.on_checkpoint(_simulated_checkpoint(rec, s))
            prev_step = rec.step
            policy.on_step(rec)
            for f in policy.last_findings:
                flagged.add(rec.step)
                res.fired_count += 1
                if len(res.fired) < FIRED_KEPT:
                    res.fired.append({"step": rec.step, "rule": f.rule, "severity": f.severity, "detail": f.detail})
            if checkpoint_every and rec.step % checkpoint_every == 0:
                policy.on_checkpoint(_simulated_checkpoint(rec))
        for ev in policy.drain_events():
            if ev.kind == "action":
                act = ev.data["action"]
                res.actions.append({"step": ev.step, **act})
                if act["kind"] in STOPS_THE_TIMELINE and not policy.dry_run:
                    stopped_at = rec.timeline
    res.flagged = sorted(flagged)
    if policy is not None:
        res.incidents = [i.model_dump(mode="json") for i in policy.incidents]
    return res
