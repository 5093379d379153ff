"""`sentinel rules check FILE`: validate a rules file before the daemon ever reads it."""

from __future__ import annotations

import click

from sentinel.cli.common import SentinelError, emit_json, friendly_errors, json_option, not_empty

# the knobs worth a glance per rule (the rest are in the file)
_KEY_PARAMS = ("threshold", "min_ratio", "window", "min_history", "k", "n", "persist_steps", "max_gap_increase",
               "min_value", "min_fraction", "duration_seconds", "max_age_seconds", "stale_seconds", "max_fraction",
               "max_skew", "max_deviation", "min_steps", "consecutive", "min_rise")


@click.group("rules")
def rules() -> None:
    """Rules files: validate them (`sentinel rules check FILE`)."""


@rules.command("check")
@click.argument("file", metavar="FILE", callback=not_empty)
@json_option
@friendly_errors
def check(file: str, as_json: bool) -> None:
    """Validate FILE and print a summary of its rules. Exit 2 with a one-line error when invalid."""
    from sentinel.rules import RulesError
    from sentinel.rules_file import load_rules

    try:
        rs = load_rules(file)
    except RulesError as e:
        raise SentinelError(str(e)) from None
    if as_json:
        emit_json({"ok": True, "file": file, **rs.model_dump(mode="json")})
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{file}: valid", title_justify="left")
    for col in ("rule", "enabled", "severity", "action", "cooldown", "parameters"):
        t.add_column(col)
    for name, r in rs.rules.items():
        cd = ", ".join(x for x in (f"{r.cooldown_steps} steps" if r.cooldown_steps else "",
                                   f"{r.cooldown_seconds:g}s" if r.cooldown_seconds else "") if x) or "-"
        params = ", ".join(f"{k}={getattr(r, k)}" for k in _KEY_PARAMS if k in type(r).model_fields)
        t.add_row(name, "yes" if r.enabled else "[dim]no[/]", r.severity, r.action, cd, params)
    Console().print(t)
    p = rs.policy
    Console().print(f"policy: rollback >= {p.rollback_margin_steps} steps before onset, skip margin {p.skip_margin_steps}, "
                    f"<= {p.max_rollbacks_per_hour} rollbacks/hour, verify within {p.verify_window_steps} steps "
                    f"(+{p.verify_tolerance:.0%}), require_approval={p.require_approval}, dry_run={p.dry_run}")
