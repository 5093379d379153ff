"""`sentinel verify-resume`: prove that resuming from a checkpoint reproduces the run bitwise."""

from __future__ import annotations

import click

from sentinel.cli.common import SentinelError, emit_json, friendly_errors, is_tty, json_option, make_progress, not_empty
from sentinel.cli.replay_cmd import parse_checkpoint


@click.command("verify-resume")
@click.argument("run", metavar="RUN", callback=not_empty)
@click.option("--from-step", "from_step", required=True, metavar="C",
              help="The checkpoint to resume from (a step number or step-NNNNNNNN).")
@click.option("--steps", "steps", default=5, show_default=True, type=click.IntRange(min=1),
              help="How many steps after the resume to compare (capped at what the log has).")
@click.option("--drill", is_flag=True, help="Make the reference in memory: run uninterrupted from an earlier "
              "checkpoint past C+K, then resume from C and compare (for when the log can't serve).")
@json_option
@friendly_errors
def verify_resume(run: str, from_step: str, steps: int, drill: bool, as_json: bool) -> None:
    """Resume RUN from checkpoint C and prove the next K steps match the uninterrupted run.

    Compares every step's batch fingerprint, LR, loss, grad norm, guard verdict and param digest
    with the authoritative step log (or an in-memory reference with --drill), checks that every
    state component survives save->load->save unchanged, and names the suspect state component at
    the first divergence. Exit 0 when equivalent, 1 when not, 2 for bad input. The outcome is
    recorded in RUN/checkpoints/verified.json.
    """
    from sentinel.offline import OfflineError, launch_workers, open_run, precheck_checkpoint

    c = parse_checkpoint(from_step, "--from-step")
    try:
        log = open_run(run)
        log.warn_rejected()
        bar, report = make_progress(not as_json and is_tty())
        try:
            if bar is not None:
                bar.start()
            if log.world_size > 1:
                precheck_checkpoint(log.run_dir, exact=c)
                argv = ["verify", str(log.run_dir), "--from-step", str(c), "--steps", str(steps)]
                if drill:
                    argv.append("--drill")
                res = launch_workers(log.world_size, argv, progress=report)
                for m in res.get("notes", []):  # the workers' stderr went to their log file
                    click.echo(m, err=True)
            else:
                res = _in_process(log.run_dir, c, steps, drill, report)
        finally:
            if bar is not None:
                bar.stop()
    except OfflineError as e:
        raise SentinelError(str(e)) from None

    from sentinel.offline.verify import mark_verified

    path = mark_verified(log.run_dir, c, res["ok"], {"steps": res["steps"], "reference": res["reference"]})
    res["verified_file"] = str(path)
    if as_json:
        emit_json(res)
    else:
        _render(res)
    if not res["ok"]:
        raise click.exceptions.Exit(1)


def _in_process(run_dir, c, steps, drill, report):
    from sentinel.offline import OfflineError
    from sentinel.offline.replay import local_env
    from sentinel.offline.verify import verify_resume as run_verify
    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError, load_run_config
    from trainer.data import DataError
    from trainer.train import TrainingError

    try:
        env = local_env(load_run_config(run_dir).device)
        return run_verify(env, run_dir, c, steps=steps, drill=drill, progress=report,
                          warn=lambda m: click.echo(m, err=True))
    except (CheckpointError, TrainingError, DataError, ConfigError) as e:
        raise OfflineError(str(e)) from None


def _render(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    con = Console()
    con.print(Text(f"resume from checkpoint {res['from_step']}: {res['steps']} step(s) on {res['world_size']} rank(s), "
                   f"{res['device']}, tolerance {res['tolerance']}; reference: {res['reference']}"))
    t = Table(show_edge=False)
    for col in ("step", "batch", "lr", "loss", "grad norm", "guard", "param digest", "match"):
        t.add_column(col, justify="right" if col in ("step", "lr", "loss", "grad norm") else "left")
    for r in res["rows"]:
        bad = set(r["mismatch"])

        def cell(field, text):
            return Text(text, style="bold red" if field in bad else "")

        t.add_row(
            str(r["step"]),
            cell("batch_fingerprint", r["batch_fingerprint"][:8]),
            cell("lr", f"{r['lr']:.4g}"),
            cell("loss", f"{r['loss']:.6g}" + ("" if "loss" not in bad else f" (run {r['ref_loss']:.6g})")),
            cell("grad_norm", f"{r['grad_norm']:.6g}" + ("" if "grad_norm" not in bad else f" (run {r['ref_grad_norm']:.6g})")),
            cell("skipped", "skipped" if r["skipped"] else "applied"),
            cell("param_digest", (r["param_digest"] or "-")[:8]),
            Text("yes", style="green") if not bad else Text("NO: " + ", ".join(sorted(bad)), style="bold red"),
        )
    if res["rows"]:
        con.print(t)
    rt = res["round_trip"]
    parts = []
    for name, row in rt["components"].items():
        parts.append(f"{name} {'identical' if row['identical'] else 'DIFFERS' + (' in ' + ', '.join(row['differs']) if row.get('differs') else '')}")
    if parts:
        con.print(Text("save->load->save: " + "; ".join(parts), style="" if rt["identical"] else "bold red"))
    d = res["first_divergence"]
    if d is None and res["ok"]:
        con.print(Text(f"equivalent: the resumed run matches the reference {res['tolerance']} "
                       f"in batch, loss, grad norm and update", style="bold green"))
    elif d is None:  # never say "equivalent" on a failure
        con.print(Text("NOT equivalent: the check failed without a named divergence (see --json)", style="bold red"))
    else:
        con.print(Text(f"NOT equivalent: first divergence at step {d['step']} ({', '.join(d['fields'])}): "
                       f"{d['component']}", style="bold red"))
        con.print(Text(f"suspect: {d['suspect']} - {d['reason']}", style="bold red"))
    con.print(Text(f"checkpoint {res['from_step']} marked "
                   f"{'resume_verified' if res['ok'] else 'failed'} in {res['verified_file']}"))
