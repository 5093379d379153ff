"""Every command's exit statuses, in one table: shown as the "Exit status" section of its --help
(and so in docs/cli.md). Scripts and CI rely on them; tests/cli/test_help.py checks each command has one.

The conventions, as in most Unix tools: 0 done; 1 the command ran but the outcome is "no" (the
trainer refused or never acknowledged, a check failed, a run needs attention); 2 an error (bad
input, an unreadable file, an unreachable bus), always with a one-line ``error: ...`` on stderr.
"""

from __future__ import annotations

ERROR = (2, "an error: bad arguments, an unreadable file, an unreachable bus (one line on stderr)")
NO_ACK = (1, ("the trainer refused the directive, or did not acknowledge it within --timeout (it may still apply "
             "it before the directive expires)"))

EXIT_STATUS: dict[str, tuple[tuple[int, str], ...]] = {
    "sentinel": ((0, "done"), (1, "the command ran, and its answer is no (see each command)"), ERROR),
    "demo": ((0, "the drill ran to its end (its verdict is in the output)"), (1, "the drill's trainer failed"), ERROR,
             (143, "stopped by SIGTERM: the run so far stays in RUN_DIR")),
    "run": ((0, "stopped by a signal after finishing its batch (warm stop)"), ERROR,
            (130, "stopped at once by a second signal (cold stop)")),
    "status": ((0, "shown (without --exit-status: whatever the runs' states)"),
               (1, "with --exit-status: a run is HUNG, stale or paused (with --watch: as soon as one is)"), ERROR),
    "incidents": ((0, "shown"), ERROR),
    "pages": ((0, "shown"), ERROR),
    "approve": ((0, "approved (with --wait: and a sentinel acted on it)"),
                (1, "with --wait: no sentinel acted on the approval in time"), ERROR),
    "pause": ((0, "the trainer applied it"), (1, "no trainer attached to the run; or " + NO_ACK[1]), ERROR),
    "resume": ((0, "the trainer applied it"), (1, "no trainer attached to the run; or " + NO_ACK[1]), ERROR),
    "stop": ((0, "the trainer applied it"), (1, "no trainer attached to the run; or " + NO_ACK[1]), ERROR),
    "rollback": ((0, "rolled back (live: the trainer applied it; offline: the plan is written for the next start)"),
                 (1, "not confirmed at the prompt; or " + NO_ACK[1]), ERROR),
    "skip-list": ((0, "shown or changed"), NO_ACK, ERROR),
    "checkpoints": ((0, "listed"), ERROR),
    "replay-batch": ((0, "replayed (and the skip, if asked, applied)"), ERROR),
    "verify-resume": ((0, "the resumed steps are bitwise equivalent"), (1, "they are NOT equivalent"), ERROR),
    "backtest": ((0, "every trace judged"), (2, ("an error, or a trace that could not be judged (see its row), "
                                                 "or with --strict a malformed line"))),
    "report": ((0, "the PNG is written"), ERROR),
    "rules": ((0, "done"), ERROR),
    "export": ((0, "written (with --check: every file is up to date)"), (1, "with --check: a file differs or is missing"),
               ERROR),
    "rules check": ((0, "the file is valid"), (2, "the file is invalid or unreadable (one line on stderr)")),
}
DEFAULT = ((0, "done"), ERROR)
WIDTH = 100


def epilog(path: str) -> str:
    """The "Exit status" section for the command ``path`` ("status", "rules check"), unwrapped by click."""
    import textwrap

    lines = ["\b", "Exit status:"]
    for code, text in EXIT_STATUS.get(path, DEFAULT):
        lines += textwrap.wrap(text, WIDTH, initial_indent=f"  {code:<4} ", subsequent_indent=" " * 7)
    return "\n".join(lines)


def add_epilogs(cmd, path: str) -> None:
    """Give ``cmd`` (and, for a group, each subcommand) its exit-status epilog, unless it has one."""
    import click

    if not cmd.epilog:
        cmd.epilog = epilog(path)
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            add_epilogs(sub, f"{path} {name}")
