"""``sentinel demo``: the whole product in two minutes, on embedded defaults."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import click

from sentinel.cli.common import FiniteFloat, SentinelError, emit_json, friendly_errors, json_option

MAX_DEMO_RANKS = 16  # gloo ranks on one CPU machine
MAX_DEMO_STEPS = 1_000_000


def _live_view(spec, state):
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    from sentinel.drill import read_steps

    def render(run_dir: Path, log: list[str]):
        steps, timeline = read_steps(run_dir)
        t = Table(title=f"run {run_dir.name}", expand=True)
        for col in ("step", "loss", "grad norm", "lr", "val loss", "guard", "timeline"):
            t.add_column(col, justify="right")
        for s, r in list(steps.items())[-8:]:
            loss_style = "red" if r.skipped or (r.loss != r.loss) else ""
            t.add_row(str(s), f"[{loss_style}]{r.loss:.4f}[/]" if loss_style else f"{r.loss:.4f}", f"{r.grad_norm:.3f}",
                      f"{r.lr:.2e}", f"{r.val_loss:.4f}" if r.val_loss is not None else "",
                      f"[yellow]skip ({r.skip_reason})[/]" if r.skipped else "ok", str(r.timeline))
        rb = [x for x in timeline if x.kind == "rollback"]
        status = (f"[bold green]rolled back to step {rb[-1].from_step}[/], skipping {sum(h - lo for lo, h in rb[-1].skip_ranges)} samples"
                  if rb else "[dim]watching[/]")
        log_panel = Panel("\n".join(log[-8:]) or "[dim]no events yet[/]", title="sentinel", border_style="cyan")
        return Group(t, Panel(status, title="status"), log_panel)

    return render


@click.command("demo")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Where the drill runs (default: runs/demo-TIMESTAMP).")
@click.option("--steps", type=int, default=None, help="Optimizer steps (default: 200; mixture: 300).")
@click.option("--ranks", type=int, default=2, show_default=True, help="torchrun ranks (gloo on CPU).")
@click.option("--drill-step", type=int, default=None, help="The step whose batch carries the faulty sample "
              "(mixture: the first step the fault applies to). Default: 100 (mixture: 120).")
@click.option("--drill", type=click.Choice(["spike", "mixture"]), default="spike", show_default=True,
              help="spike: one bad sample on Shakespeare; mixture: a 3-source mixture (shakespeare, pydoc, stdlib) "
                   "where one source is starved or corrupted mid-run and the slice rule must name it.")
@click.option("--fault", type=click.Choice(["lr", "garbage", "nan", "reweight", "corrupt_source"]), default=None,
              help="spike: lr (x100 learning rate on that sample, default), garbage (corrupt tokens), nan (NaN loss); "
                   "mixture: reweight (multiply the source's weight by --factor, default) or corrupt_source.")
@click.option("--source", default="pydoc", show_default=True, help="mixture: the source the fault hits.")
@click.option("--factor", type=FiniteFloat(0, 1e6), default=0.0, show_default=True,
              help="mixture reweight: the weight multiplier (0 starves the source).")
@click.option("--no-sentinel", is_flag=True, help="Run the same drill without the sentinel, to see the damage stay.")
@click.option("--compare", is_flag=True, help="Also run a clean baseline and the drill without the sentinel, and compare final losses.")
@json_option
@friendly_errors
def demo(run_dir, steps, ranks, drill_step, drill, fault, source, factor, no_sentinel, compare, as_json):
    """Run a live drill: a 2-rank GPT trains on Shakespeare, a bad sample blows up the weights at
    step 100, and the sentinel detects it, rolls back to a checkpoint from before the spike, skips
    the data that caused it, and verifies the recovery. Everything is embedded: no Redis or GPU.

    With --drill mixture the GPT trains on three sources; from --drill-step on one source is starved
    (or corrupted), its validation slice regresses while the others improve, and the sentinel pages
    with that source named."""
    from rich.console import Console

    from sentinel.drill import MIXTURE_FAULTS, MIXTURE_SOURCES

    mixture = drill == "mixture"
    fault = fault or ("reweight" if mixture else "lr")
    if mixture != (fault in MIXTURE_FAULTS):
        raise click.BadParameter(f"{fault} is not a {drill} drill fault", param_hint="--fault")
    names = [s.split("=")[0] for s in MIXTURE_SOURCES]
    if mixture and source not in names:
        raise click.BadParameter(f"{source!r} is not a source of the drill's mixture ({', '.join(names)})",
                                 param_hint="--source")
    steps = steps if steps is not None else (MIXTURE_STEPS if mixture else 200)
    drill_step = drill_step if drill_step is not None else (MIXTURE_DRILL_STEP if mixture else 100)

    if not 1 <= ranks <= MAX_DEMO_RANKS:
        raise SentinelError(f"--ranks must be between 1 and {MAX_DEMO_RANKS} (got {ranks})")
    if not 2 <= steps <= MAX_DEMO_STEPS:
        raise SentinelError(f"--steps must be between 2 and {MAX_DEMO_STEPS:,} (got {steps})")
    if drill_step < 1:
        raise SentinelError(f"--drill-step must be at least 1 (got {drill_step})")
    if drill_step >= steps:
        raise click.BadParameter("must be smaller than --steps", param_hint="--drill-step")
    run_dir = Path(run_dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    # before anything is written: the drill's bus, rules, logs, checkpoints and report never go into
    # a directory that holds something (another run, a copy of one)
    _refuse_used_dir(run_dir)
    _refuse_unusable_name(run_dir)
    if compare:
        for d in _compare_dirs(run_dir, not no_sentinel):
            _refuse_used_dir(d, f"--compare needs {d}, which")
    console = Console(stderr=as_json)
    with _sigterm_as_interrupt() as term:
        try:
            _demo(console, run_dir, steps, ranks, drill_step, mixture, fault, source, factor, names, no_sentinel,
                  compare, as_json)
        except KeyboardInterrupt:
            if term["signal"]:  # `timeout`, `kill`, a scheduler: say so, and exit as killed by it would
                stopped = "the trainer" + ("" if no_sentinel else " and the embedded bus")
                raise SentinelError(f"terminated by {term['signal']}: stopped {stopped}; the run so far is in {run_dir}",
                                    exit_code=128 + signal.SIGTERM) from None
            raise


def _demo(console, run_dir, steps, ranks, drill_step, mixture, fault, source, factor, names, no_sentinel, compare,
          as_json):
    from rich.live import Live
    from rich.table import Table

    from sentinel.drill import MIXTURE_RULES, DrillSpec, incidents_of, read_markers, run_drill

    with console.status(f"preparing the {'mixture' if mixture else 'Shakespeare'} corpus (first run only)..."):
        data_dir = _data_dir(mixture)
    spec = DrillSpec(run_dir=run_dir, steps=steps, ranks=ranks, drill_step=drill_step, fault=fault,
                     sentinel=not no_sentinel, data_dir=data_dir)
    if mixture:
        spec.source, spec.factor, spec.rules_yaml, spec.eval_every = source, factor, MIXTURE_RULES, MIXTURE_EVAL_EVERY
    if mixture and not as_json:
        console.rule("[bold]sentinel demo: mixture drill")
        what = "corrupted" if fault == "corrupt_source" else f"reweighted x{factor:g}"
        console.print(f"{ranks}-rank GPT ({spec.preset}) on a {len(names)}-source mixture ({', '.join(names)}) for "
                      f"{steps} steps, evaluated per slice every {spec.eval_every} steps; from step {drill_step} on, "
                      f"source [bold red]{source}[/] is {what}; sentinel {'[red]off' if no_sentinel else '[green]on'}[/].")
    elif not as_json:
        console.rule("[bold]sentinel demo")
        console.print(f"{ranks}-rank GPT ({spec.preset}) on Shakespeare for {steps} steps; a [bold red]{fault}[/] drill "
                      f"on one sample of step {drill_step}; sentinel {'[red]off' if no_sentinel else '[green]on'}[/].")
    render = _live_view(spec, None)
    try:
        if as_json or not console.is_terminal:
            res = run_drill(spec)
        else:
            with Live(console=console, refresh_per_second=4) as live:
                res = run_drill(spec, on_tick=lambda d, log: live.update(render(d, log)))
        if res.returncode != 0:  # nothing to show: no drill happened, or it did not finish
            raise SentinelError(_trainer_failed(res.returncode, run_dir / "trainer.log"), exit_code=1)
        out = res.summary()
        if mixture:
            out["markers"] = [{"step": m.step, "marker": m.marker, "detail": m.detail} for m in read_markers(run_dir)]
        if spec.sentinel:
            try:
                out["incidents"] = [{k: i[k] for k in ("id", "state", "rule", "onset_step", "detect_step", "rollback_to") if k in i}
                                    for i in incidents_of(run_dir)]
            except Exception:
                out["incidents"] = []
        out["later_skips"] = _later_skips(run_dir)
        out["report"] = _report(run_dir)  # while the bus still holds the incidents
    finally:
        if spec.sentinel:  # also after a failure, Ctrl-C or SIGTERM: the embedded valkey server is ours to stop
            _stop_bus(run_dir)
    if compare:
        out["compare"] = _compare(spec, res, console, as_json)
    if as_json:
        emit_json(out)
    elif mixture:
        _print_mixture(out, res, spec, console)
    else:
        t = Table(title="what happened", show_header=False)
        t.add_row("faulty sample", ", ".join(map(str, res.fault_ids)) + f" (trained at step {drill_step})")
        for rb in res.rollbacks:
            t.add_row("rollback", f"to step {rb.from_step}, skipped {sum(h - lo for lo, h in rb.skip_ranges)} samples ({rb.reason})")
        if spec.sentinel and not res.rollbacks:
            t.add_row("rollback", "[red]none[/]")
        later = out.get("later_skips") or []
        if later:
            t.add_row("later skips", f"{sum(x['samples'] for x in later)} samples in {len(later)} skip-samples directive(s): the "
                                     "steps the damaged branch still trained before the rollback took effect")
        gs = out["guard_skipped_steps"]
        t.add_row("guard skips", (f"{len(gs)} step{'s' * (len(gs) != 1)}, at step{'s' * (len(gs) != 1)} "
                                  + ", ".join(map(str, gs))) if gs else "none")
        t.add_row("final validation loss", f"{res.final_val_loss:.4f}" if res.final_val_loss is not None else "n/a")
        for inc in out.get("incidents", []):
            t.add_row(f"incident {inc['id']}", f"{inc['rule']}: onset step {inc['onset_step']}, detected at {inc['detect_step']}, now {inc['state']}")
        t.add_row("wall time", f"{res.wall_seconds:.0f} s")
        console.print(t)
        if out.get("report"):
            console.print(f"[bold]report:[/] {out['report']}  (loss, grad norm, val PPL, the incident and the rollback "
                          "on one timeline)", highlight=False)
        console.print("Look closer:")
        for cmd in (f"sentinel incidents {run_dir}", f"sentinel checkpoints {run_dir}",
                    f"sentinel verify-resume {run_dir} --from-step {spec.ckpt_every * 2}"):
            console.print(f"  {cmd}", soft_wrap=True, highlight=False)  # one whole line each: copy and paste
        console.print("Culprits: run `sentinel demo --fault garbage --no-sentinel`, then `sentinel replay-batch RUN_DIR "
                      f"--step {drill_step}` names the corrupted samples.")
    if "compare" in out and not as_json:
        _print_compare(out["compare"], console)


def _refuse_unusable_name(path: Path) -> None:
    """A one-line error before anything starts when the directory's name cannot be a run id (the run
    is named after it) or its path cannot be written into the bus's config (not UTF-8, a newline):
    these once failed only after the bus and the trainer had started, with a traceback in the log."""
    from sentinel.protocol import Keys
    from sentinel.runref import printable

    text = str(path.resolve())
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SentinelError(f"--run-dir {printable(str(path), 200)}: the path is not valid UTF-8") from None
    if any(c in text for c in "\n\r\0\"'"):
        raise SentinelError(f"--run-dir {printable(str(path), 200)}: no quotes or line breaks in the path, please")
    try:
        Keys(path.resolve().name)
    except ValueError as e:
        raise SentinelError(f"--run-dir {printable(str(path), 200)}: its name is the run id, and {e}") from None


def _refuse_used_dir(path: Path, what: str | None = None) -> None:
    """A one-line error (exit 2) unless ``path`` is missing or an empty directory. Reads only."""
    what = what or f"--run-dir {path}"
    try:
        with os.scandir(path) as it:
            used = next(it, None) is not None
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise SentinelError(f"{what} exists and is not a directory") from None
    except OSError as e:
        raise SentinelError(f"{what} cannot be read ({e.strerror or type(e).__name__})") from None
    if used:
        raise SentinelError(f"{what} already exists and is not empty: the demo writes a new run (bus, rules, "
                            "checkpoints, logs, report) and needs a new or empty directory")


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM handled like Ctrl-C (a KeyboardInterrupt), so the same cleanup runs: the trainer's
    processes are killed and the embedded bus stopped. A second SIGTERM during that cleanup is ignored
    (it is bounded); SIGKILL still ends everything at once."""
    term = {"signal": None}

    def on_term(signum, frame):
        if term["signal"] is None:
            term["signal"] = signal.Signals(signum).name
            raise KeyboardInterrupt

    try:
        old = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread (an embedding): leave signals alone
        yield term
        return
    try:
        yield term
    finally:
        signal.signal(signal.SIGTERM, old)


def _later_skips(run_dir: Path) -> list[dict]:
    """The skip-samples directives the trainer applied (``rundir.skip_origins``): what the incident
    skipped besides its rollback's own ranges, so the demo's totals match skip-list."""
    from sentinel import rundir

    return [{"step": o["step"], "samples": rundir.count(o["ranges"]), "reason": o["reason"]}
            for o in rundir.skip_origins(run_dir) if o["source"] == "skip-samples"]


def _stop_bus(run_dir: Path) -> None:
    from sentinel.embedded import stop_embedded

    try:
        stop_embedded(run_dir)
    except Exception as e:  # noqa: BLE001 - say it, but do not hide the error that brought us here
        click.echo(f"warning: the demo's embedded bus in {run_dir / 'bus'} did not stop: {e}", err=True)


def _trainer_failed(rc: int, log: Path) -> str:
    """``the trainer exited with RC; see LOG (last error: ...)``: one line."""
    how = (f"was killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in signal.valid_signals()
           else f"exited with {rc}")
    last = _last_error_line(log)
    return f"the trainer {how}; see {log}" + (f" (last error: {last})" if last else "")


# torchrun's own report of a failed worker: a frame around "Root Cause", with no cause in it
_TORCHRUN_FRAME = ("=====", "-----", "Failures:", "<NO_OTHER_FAILURES>", "Root Cause", "time ", "host ", "rank ",
                   "exitcode ", "error_file", "traceback ", "trainer FAILED")


def _last_error_line(log: Path, tail_bytes: int = 64 * 1024) -> str | None:
    """The trainer's last ``error: ...`` line in ``log`` (its one-line errors), else its last exception
    line, else the last line that is not torchrun's failure frame; from the file's last 64 KB,
    escaped and cut short (the log holds whatever the trainer printed)."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return None
    lines = [ln for ln in lines if ln and not ln.startswith(_TORCHRUN_FRAME) and ln[:1] != "["
             and "torch.distributed.elastic" not in ln]
    pick = (next((ln for ln in reversed(lines) if ln.startswith("error:")), None)
            or next((ln for ln in reversed(lines) if ln.split(":", 1)[0].endswith(("Error", "Exception"))), None)
            or (lines[-1] if lines else None))
    if pick is None:
        return None
    pick = pick.removeprefix("error:").strip()
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in pick[:200])
    return shown + ("..." if len(pick) > 200 else "")


MIXTURE_STEPS = 300
MIXTURE_DRILL_STEP = 120
MIXTURE_EVAL_EVERY = 10  # the slice rule needs a few evals before and several after the fault


def _data_dir(mixture: bool) -> Path:
    from sentinel.drill import ensure_mixture_prepared
    from trainer.data import ensure_prepared

    return ensure_mixture_prepared() if mixture else ensure_prepared()


def _print_mixture(out: dict, res, spec, console) -> None:
    from rich.table import Table
    from rich.text import Text

    t = Table(title="what happened", show_header=False)
    t.add_row("fault", f"{out['fault']} (from step {spec.drill_step})")
    for m in out.get("markers", []):
        t.add_row(f"timeline: {m['marker']}", f"after step {m['step']}" + (f" ({m['detail']})" if m["detail"] else ""))
    pages = res.slice_pages()
    if spec.sentinel:
        t.add_row("slice page", Text(pages[0]) if pages else Text("none", style="red"))
    for name, v in sorted((out.get("final_val_slice_loss") or {}).items()):
        t.add_row(f"final val loss: {name}", f"{v:.4f}" + ("  <- drilled" if name == spec.source else ""))
    for rb in res.rollbacks:
        t.add_row("rollback", f"to step {rb.from_step} ({rb.reason})")
    t.add_row("wall time", f"{res.wall_seconds:.0f} s")
    console.print(t)
    if out.get("report"):
        console.print(f"[bold]report:[/] {out['report']}", highlight=False)
    console.print(f"Look closer: the training dashboard's slice row; `sentinel replay-batch {spec.run_dir} --step "
                  f"{spec.drill_step + 1}` lists each culprit's source.")


def _report(run_dir: Path) -> str | None:
    """The run's picture (``sentinel report``); a failure to draw never fails the demo."""
    from sentinel.cli.report_cmd import write_report
    from sentinel.runref import resolve

    try:
        return write_report(resolve(str(run_dir)))["path"]
    except Exception as e:  # noqa: BLE001 - the demo already succeeded; say why there is no picture
        click.echo(f"warning: no report: {e}", err=True)
        return None


def _compare(spec, res, console, as_json: bool) -> dict:
    """The same drill without the sentinel, and a clean run: what the rollback saved."""
    import dataclasses

    from sentinel.drill import run_drill

    runs = {"drill + sentinel" if spec.sentinel else "drill, no sentinel": res.final_val_loss}
    variants = [("clean (no drill)", dict(fault=None, sentinel=False))]
    if spec.sentinel:
        variants.append(("drill, no sentinel", dict(sentinel=False)))
    for (label, over), d in zip(variants, _compare_dirs(spec.run_dir, spec.sentinel)):
        with console.status(f"running {label} for comparison..."):
            runs[label] = run_drill(dataclasses.replace(spec, run_dir=d, **over)).final_val_loss
    return runs


def _compare_dirs(run_dir: Path, sentinel: bool) -> list[Path]:
    """Where ``--compare`` runs its variants: beside the run dir, one per variant of ``_compare``."""
    names = ["clean"] + (["drill-nosentinel"] if sentinel else [])
    return [run_dir.with_name(f"{run_dir.name}-{n}") for n in names]


def _print_compare(runs: dict, console) -> None:
    from rich.table import Table

    clean = runs["clean (no drill)"]
    t = Table(title="final validation loss")
    t.add_column("run")
    t.add_column("val loss", justify="right")
    t.add_column("vs clean", justify="right")
    for label, v in runs.items():
        rel = f"{(v / clean - 1) * 100:+.1f}%" if (v is not None and clean) else "n/a"
        t.add_row(label, f"{v:.4f}" if v is not None else "n/a", rel)
    console.print(t)
