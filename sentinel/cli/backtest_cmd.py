"""`sentinel backtest`: run the rules offline over a recorded step log.

The same RunPolicy and rules as the daemon, in the mode the daemon runs (see sentinel/backtest.py for
what it assumes: checkpoints at step 0 and every N steps, no guard unless the trace says so, no judging of records
a rollback or pause would have prevented), so "what would it have done on last
week's run?" and "would this rules change have paged us?" have exact answers before deploying.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import click

from sentinel.cli.common import SentinelError, emit_json, friendly_errors, is_tty, json_option, make_progress, not_empty

MAX_ROWS = 40  # a long trace can flag hundreds of steps; the table shows the first ones, --json has all
TRACE_SUFFIXES = (".jsonl", ".ndjson", ".csv", ".tsv", ".log", ".out", ".txt")  # what a directory's traces are named
COMPRESSED = (".gz", ".bz2", ".xz")


@click.command("backtest")
@click.argument("traces", nargs=-1, required=True, metavar="TRACE...", callback=not_empty)
@click.option("--rules", "rules_path", default=None, metavar="FILE", callback=not_empty,
              help="Rules YAML (default: the built-in defaults; for a run directory's own steps.jsonl, the rules "
                   "the daemon applied to it, RUN_DIR/sentinel-rules.applied.yaml, when it wrote them).")
@click.option("--checkpoint-every", default=100, show_default=True, type=click.IntRange(min=0),
              help="Assume a checkpoint every N steps when deciding rollbacks (0: assume none). For a run "
                   "directory's own steps.jsonl: the run's checkpoint.every from its config.yaml.")
@click.option("--initial-checkpoint/--no-initial-checkpoint", default=True, show_default=True,
              help="Also assume the initial state (step 0) was saved, as the trainer does on a fresh start "
                   "(only for a trace that begins within the first N steps; for a run's own steps.jsonl, as "
                   "its config says).")
@click.option("--format", "fmt", type=click.Choice(["auto", "jsonl", "json", "csv", "hf", "text", "tb"]), default="auto",
              show_default=True,
              help="auto: .csv/.tsv files are CSV; a .json file with a log_history list is a Hugging Face "
                   "trainer_state.json (hf); a file that is one JSON list of step objects, or a .json file that is one "
                   "table as pandas to_json writes it (any orient), is a history document (json); "
                   ".jsonl/.json/.ndjson otherwise JSON lines; any other name (train.log, "
                   "slurm-123.out) is JSON lines when its first line is a JSON object, CSV when it is a comma- or "
                   "tab-separated header, else a trainer's text log (text: modded-nanogpt, nanoGPT, Megatron-LM, "
                   "torchtitan, OLMo-core, key=value lines); a TensorBoard event file (events.out.tfevents.*), or a directory of them, is tb.")
@click.option("--step-column", default=None, metavar="NAME",
              help="The step column of a CSV, or key of a JSON line (default: the first of step, _step, global_step, "
                   "iteration, iter, ...).")
@click.option("--loss-column", default=None, metavar="NAME",
              help="The training-loss column of a CSV, or key of a JSON line (default: the first of loss, train/loss, "
                   "train_loss, lm_loss, ..., and a CSV's Value), or the tag of a TensorBoard event file.")
@click.option("--strict", is_flag=True,
              help="Stop at the first malformed line (exit 2) instead of skipping and counting it.")
@click.option("--skip-bad-lines", is_flag=True, hidden=True)  # the default now; kept so old scripts still run
@json_option
@friendly_errors
def backtest(traces: tuple[str, ...], rules_path: str | None, checkpoint_every: int, initial_checkpoint: bool, fmt: str,
             step_column: str | None, loss_column: str | None, strict: bool, skip_bad_lines: bool, as_json: bool) -> None:
    """Run the rules offline over TRACE: a steps.jsonl, JSON lines with just step and loss, a
    CSV export of a run's history (W&B, TensorBoard, pandas), a history in one JSON document (a
    list of step objects, a pandas table), a Hugging Face trainer_state.json, the trainer's own
    text log (step:100 train_loss:3.21, iter 100: loss 3.21, Megatron's iteration lines), or
    TensorBoard event files (a file, or the directory that holds them).

    Prints the flagged steps and the actions the policy would have taken. A malformed line (or a
    row without a loss value that holds another metric) is skipped and counted (a warning on
    stderr, rejected_lines in --json); a null or empty loss on a line of nothing but its step and
    clock is a NaN, as pandas writes one; a file with no valid step line at all is an error. Steps that go back (a requeued job
    appending to its log) are read as a restart from the step before, never as a loss change.

    Several TRACEs (say, last month's runs against a new rules file): one row per trace, and with
    --json {"traces": [...]}, each as one trace's --json (or its "error"). A trace that cannot be
    judged is reported in its row and the others still run; the exit status is then 2.

    A run directory stands for its steps.jsonl. Another directory that is not itself a TensorBoard
    run stands for the traces in it: its files named
    *.jsonl, *.ndjson, *.csv, *.tsv, *.log, *.out, *.txt, and *.json that hold steps (also gzip, bzip2
    or xz compressed), then each TensorBoard run below it, judged as several TRACEs.
    """
    from sentinel.rules import RulesError, default_rules
    from sentinel.rules_file import load_rules

    try:
        rules = load_rules(rules_path) if rules_path else default_rules()
    except RulesError as e:
        raise SentinelError(str(e)) from None
    given = {name for name in ("rules_path", "checkpoint_every", "initial_checkpoint")
             if click.get_current_context().get_parameter_source(name) is not click.core.ParameterSource.DEFAULT}

    judge = partial(_judge, rules=rules, checkpoint_every=checkpoint_every, initial_checkpoint=initial_checkpoint, fmt=fmt,
                    step_column=step_column, loss_column=loss_column, strict=strict, given=frozenset(given))

    traces = tuple(_run_log(t) for t in traces)
    expanded = _expand(traces)
    if len(expanded) > 1 or expanded != list(traces):
        _judge_many(tuple(expanded), judge, as_json)
        return
    trace = traces[0]
    res, rejected, source = judge(trace)
    if rejected:
        click.echo(f"warning: skipped {len(rejected)} line(s) of {trace}; first: {rejected[0]}", err=True)
    if as_json:
        emit_json({**res.to_json(), "rejected_lines": len(rejected), "source": source})
        return
    _print_tables(trace, res, source)


def _run_log(trace: str) -> str:
    """One of our run directories (a ``config.yaml`` and a ``steps.jsonl`` in it) stands for its
    step log, judged as the run ran (``_run_settings``): not for its directives, incidents, pages
    and trainer.log, each read as a trace of its own."""
    from pathlib import Path

    from sentinel.rundir import CONFIG, STEPS
    from sentinel.trace_tb import is_dir

    d = Path(trace)
    try:
        ours = is_dir(d) and (d / CONFIG).is_file() and (d / STEPS).exists()
    except OSError:  # a name too long for the filesystem: load_trace says why
        ours = False
    return str(d / STEPS) if ours else trace


def _expand(traces: tuple[str, ...]) -> list[str]:
    """Each TRACE, with a directory (not a TensorBoard run itself) replaced by the traces in it, in
    name order: its log files (``TRACE_SUFFIXES``, and ``*.json`` files that hold steps, compressed
    or not; not hidden ones, nor its README or an index), then the TensorBoard runs below it. A
    directory with none is kept as it is, and reading it gives its one-line error."""
    from pathlib import Path

    from sentinel.backtest import json_file_is_trace
    from sentinel.trace_tb import event_subdirs, is_dir, is_event_path

    out: list[str] = []
    for t in traces:
        d = Path(t)
        if not is_dir(d) or is_event_path(d):  # is_dir: a name too long is no directory (load_trace says why)
            out.append(t)
            continue
        try:
            files = [str(f) for f in sorted(d.iterdir()) if f.is_file() and _is_trace_name(f.name)
                     and (not _is_json_name(f.name) or json_file_is_trace(f))]
        except OSError:  # unreadable: load_trace says so in one line
            files = []
        members = files + [str(r) for r in event_subdirs(d)]
        out.extend(members or [t])
    return out


def _is_trace_name(name: str) -> bool:
    if name.startswith("."):
        return False
    low = _uncompressed(name.lower())
    return low.endswith(TRACE_SUFFIXES) or low.endswith(".json")


def _is_json_name(name: str) -> bool:
    """A ``.json`` member is judged only when it holds steps (``json_file_is_trace``)."""
    return _uncompressed(name.lower()).endswith(".json")


def _uncompressed(low: str) -> str:
    for z in COMPRESSED:
        if low.endswith(z):
            return low[: -len(z)]
    return low


@friendly_errors
def _judge(trace: str, *, rules, checkpoint_every: int, initial_checkpoint: bool, fmt: str, step_column: str | None,
           loss_column: str | None, strict: bool, given: frozenset[str] = frozenset()):
    """(BacktestResult, the rejected lines' reasons) of one trace; ``SentinelError`` (one line) if
    it cannot be read or has no step. A run directory's own steps.jsonl is judged with what the run
    had (``_run_settings``) wherever the command line left the setting at its default."""
    from sentinel.backtest import backtest as run_backtest
    from sentinel.backtest import iter_trace

    rejected: list[str] | None = None if strict else []
    source: dict = {}
    run = _run_settings(trace, given)
    if run:
        rules = run.get("rules", rules)
        checkpoint_every = run.get("checkpoint_every", checkpoint_every)
        initial_checkpoint = run.get("initial_checkpoint", initial_checkpoint)
        source["run_settings"] = run.get("said", [])
    # read as judged: a long run's log is never held whole
    records = iter_trace(trace, rejected=rejected, fmt=fmt, step_column=step_column, loss_column=loss_column, source=source)
    res = run_backtest(records, rules, checkpoint_every=checkpoint_every or None, initial_checkpoint=initial_checkpoint)
    if not res.records:  # the first step record is always judged: there was none
        why = f" ({len(rejected)} line(s) skipped; first: {rejected[0]})" if rejected else ""
        raise SentinelError(f"no step records in {trace}{why}")
    return res, rejected or [], source


def _run_settings(trace: str, given: frozenset[str]) -> dict:
    """For the steps.jsonl of one of our run directories (a ``config.yaml`` beside it): the settings
    the run had, for those the command line did not give. The checkpoint cadence (``checkpoint.every``,
    ``checkpoint.initial``) and the rules the daemon applied (``rundir.APPLIED_RULES``, written by
    ``sentinel run``): judged with the defaults instead, a run with checkpoints every 10 steps and a
    20-step rollback margin read as "roll back to step 0", where the live sentinel rolled back to 80.
    ``said``: each setting taken, in words (printed under the tables, ``source.run_settings`` in --json).
    Anything unreadable is left at the command line's value."""
    from pathlib import Path

    from sentinel.rules import RulesError
    from sentinel.rules_file import load_rules
    from sentinel.rundir import APPLIED_RULES, CONFIG, STEPS, run_config

    p = Path(trace)
    if p.name != STEPS or not (p.parent / CONFIG).is_file():
        return {}
    out: dict = {"said": []}
    ck = run_config(p.parent).get("checkpoint")
    ck = ck if isinstance(ck, dict) else {}
    every, initial = ck.get("every"), ck.get("initial")
    if "checkpoint_every" not in given and isinstance(every, int) and not isinstance(every, bool) and every >= 0:
        out["checkpoint_every"] = every
        out["said"].append(f"checkpoint every {every} steps (config.yaml)")
    if "initial_checkpoint" not in given and isinstance(initial, bool):
        out["initial_checkpoint"] = initial
    applied = p.parent / APPLIED_RULES
    if "rules_path" not in given and applied.is_file():
        try:
            out["rules"] = load_rules(applied)
            out["said"].append(f"the rules the daemon applied ({APPLIED_RULES})")
        except RulesError as e:
            out["said"].append(f"the built-in rules ({APPLIED_RULES} unreadable: {e})")
    return out


FORMAT_NAMES = {"jsonl": "JSON lines", "csv": "CSV", "hf": "a Hugging Face trainer state", "text": "a text log",
                "tb": "TensorBoard events"}


def _read_as(source: dict) -> str:
    """"Read as CSV: step 'global_step', loss 'train/loss'": what the trace was read as, in words."""
    what = FORMAT_NAMES.get(source.get("format", ""), "a trace")
    named = [f"{label} {source[k]!r}" for k, label in (("step", "step"), ("loss", "loss"), ("grad_norm", "grad norm")) if source.get(k)]
    if source.get("format") == "tb" and source.get("files"):
        named.append(f"{source['files']} file(s)")
    return f"Read as {what}" + (f": {', '.join(named)}" if named else "")


def _judge_many(traces: tuple[str, ...], judge, as_json: bool) -> None:
    """Every trace in turn, one row each; the ones that cannot be judged say why and cost only themselves."""
    out: list[dict] = []
    bar, report = make_progress(not as_json and is_tty())
    with bar if bar is not None else nullcontext():
        for i, trace in enumerate(traces):
            if report:
                report(i, len(traces), f"backtest {trace}")
            try:
                res, rejected, source = judge(trace)
            except click.ClickException as e:  # _judge turns every expected failure into one
                out.append({"trace": trace, "error": e.format_message()})
                continue
            out.append({"trace": trace, **res.to_json(), "rejected_lines": len(rejected), "source": source})
    failed = sum("error" in t for t in out)
    totals = _totals(out)
    if as_json:
        emit_json({"traces": out, "failed": failed, "totals": totals})
    else:
        _print_summary(out, totals)
    if failed:
        raise SentinelError(f"{failed} of {len(traces)} traces could not be judged (see their rows)")


def _totals(rows: list[dict]) -> dict[str, int]:
    """Across the judged traces: how many, how many had a rollback or a pause, and the actions by kind."""
    judged = [r for r in rows if "error" not in r]
    kinds = [[a["kind"] for a in r["actions"]] for r in judged]
    return {"traces": len(rows), "judged": len(judged),
            "traces_with_rollback": sum("rollback" in k for k in kinds), "traces_with_pause": sum("pause" in k for k in kinds),
            "rollbacks": sum(k.count("rollback") for k in kinds), "pauses": sum(k.count("pause") for k in kinds),
            "pages": sum(k.count("page") for k in kinds)}


def _print_summary(rows: list[dict], totals: dict[str, int]) -> None:
    """One row per trace (by file name when the names are unique); traces that could not be
    judged say so in their row, and why on stderr."""
    from pathlib import Path

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    names = [Path(r["trace"]).name for r in rows]
    if len(set(names)) < len(names):
        names = [r["trace"] for r in rows]
    t = Table(title="Backtest, one row per trace", title_justify="left")
    console = Console()
    for col in ("trace", "steps", "flagged", "rollback", "pause", "page", "first action", "bad lines"):
        t.add_column(col, justify="left" if col in ("trace", "first action") else "right", overflow="fold")  # never cut short
    for name, r in zip(names, rows):
        if "error" in r:
            t.add_row(escape(name), "-", "-", "-", "-", "-", "[red]not judged[/]", "-")
            click.echo(f"error: {r['error']}" if r["trace"] in r["error"] else f"error: {r['trace']}: {r['error']}", err=True)
            continue
        kinds = [a["kind"] for a in r["actions"]]
        first = next((a for a in r["actions"] if a["kind"] in ("rollback", "pause")), None)
        what = "" if first is None else f"{first['kind']} at {first['step']}" + (
            f" to {first['to_step']}" if first["to_step"] is not None else "")
        t.add_row(escape(name), str(r["records"]), str(len(r["flagged"])), str(kinds.count("rollback")), str(kinds.count("pause")),
                  str(kinds.count("page")), what, str(r["rejected_lines"]))
    t.caption = (f"{totals['judged']} of {totals['traces']} traces judged: {totals['traces_with_rollback']} with a rollback "
                 f"({totals['rollbacks']} in all), {totals['traces_with_pause']} with a pause ({totals['pauses']}), "
                 f"{totals['pages']} pages")
    t.caption_justify = "left"
    console.print(t)


def _skipped(act: dict) -> str:
    """What a rollback skips: its sample-id ranges, and the steps they came from."""
    steps = act.get("skip_steps")
    where = f"steps {steps[0]}-{steps[1]}" if steps else ""
    if not act["ranges"]:
        return f"{where} (no sample ids in the trace)" if where else ""
    what = f"{sum(hi - lo for lo, hi in act['ranges'])} samples ({len(act['ranges'])} ranges)"
    return f"{what}, {where}" if where else what


def _print_tables(trace: str, res, source: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    style = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
    t = Table(title=f"Flagged steps in {trace}", title_justify="left")
    for col in ("step", "rule", "severity", "detail"):
        t.add_column(col, justify="right" if col == "step" else "left")
    for f in res.fired[:MAX_ROWS]:
        t.add_row(str(f["step"]), f["rule"], f"[{style.get(f['severity'], '')}]{f['severity']}[/]", f["detail"])
    if res.fired_count > MAX_ROWS:
        t.caption = f"... and {res.fired_count - MAX_ROWS} more findings (--json lists every flagged step)"
    console.print(t)
    a = Table(title="Actions the policy would take", title_justify="left")
    for col in ("step", "action", "to_step", "data skipped", "incident", "reason"):
        a.add_column(col)
    for act in res.actions:
        a.add_row(str(act["step"]), act["kind"], "" if act["to_step"] is None else str(act["to_step"]),
                  _skipped(act), act["incident_id"] or "", act["reason"])
    if res.actions:
        console.print(a)
    else:
        console.print("[green]Actions the policy would take: none[/] (no rollback, pause or page)")
    if res.incidents:
        it = Table(title="Incidents (a recovered spike is annotated, not acted on)", title_justify="left")
        for col in ("onset", "detected", "rule", "state", "spike pattern"):
            it.add_column(col, justify="right" if col in ("onset", "detected") else "left")
        for inc in res.incidents[:MAX_ROWS]:
            it.add_row(str(inc["onset_step"]), str(inc["detect_step"]), inc["rule"], inc["state"], inc.get("pattern") or "")
        if len(res.incidents) > MAX_ROWS:
            it.caption = f"... and {len(res.incidents) - MAX_ROWS} more (use --json for all)"
        console.print(it)
    console.print(escape(_read_as(source)), style="dim")
    if source.get("run_settings"):
        console.print(escape("Judged as the run ran: " + "; ".join(source["run_settings"])), style="dim")
    console.print(f"{res.records} steps, {len(res.flagged)} flagged, {len(res.actions)} actions, {len(res.incidents)} incidents"
                  + (f"; {res.unjudged} later steps not judged (the live run would have rolled back or paused there)"
                     if res.unjudged else "")
                  + (f"; read {res.restarts} restart(s) where the steps went back" if res.restarts else "")
                  + (f"; skipped {res.duplicates} repeated step line(s)" if res.duplicates else "")
                  + (f"; dropped {res.out_of_order} step line(s) out of order" if res.out_of_order else ""))
