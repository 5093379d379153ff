"""``sentinel checkpoints``: a run's checkpoints, with age, size and how far each can be trusted.

``resume_verified`` / ``failed`` come from ``checkpoints/verified.json`` (``sentinel verify-resume``);
otherwise every file is re-hashed against the manifest: ``checksum_ok``, ``corrupt`` (a hash does not
match, or the manifest is unreadable) or ``incomplete`` (no manifest, or a file is missing). A bad
checksum always wins over an older verify-resume result. Torch-free.
"""

from __future__ import annotations

import time

import click

from sentinel.cli.common import (
    bus_entry,
    count_bus_entries,
    emit_json,
    friendly_errors,
    json_option,
    not_empty,
    offline_note,
    read_or_reject,
    redis_url_option,
    warn_rejected,
)

STATUS_STYLE = {"resume_verified": "bold green", "checksum_ok": "green", "unverified": "yellow", "failed": "bold red",
                "corrupt": "bold red", "incomplete": "red"}


def checkpoint_rows(ref, *, rehash: bool = True, rejected: list[str] | None = None) -> tuple[list[dict], str]:
    """(rows newest first, source) for a run: its directory when local, else the bus's checkpoints hash."""
    from sentinel import bus, rundir
    from sentinel.protocol import CheckpointInfo, SchemaError

    if ref.run_dir is not None:
        return [c.to_json() for c in rundir.list_checkpoints(ref.run_dir, rehash=rehash)], "files"
    rows = []
    if rejected is None:
        with bus.bus_errors(ref.r):
            raw = ref.r.hgetall(ref.keys.checkpoints)
    else:
        raw = read_or_reject(ref.r, "checkpoints", lambda: ref.r.hgetall(ref.keys.checkpoints), rejected, {})
    now = time.time()
    for k, v in raw.items():
        try:
            ci = CheckpointInfo.from_json(v)
        except SchemaError:
            if rejected is not None:
                rejected.append(bus_entry("checkpoints", k))
            continue
        rows.append({"step": ci.step, "name": rundir.step_dir_name(ci.step), "path": ci.path, "bytes": ci.bytes,
                     "created": ci.created, "age_seconds": now - ci.created, "verified": ci.verified, "checksum": None,
                     "problem": None, "verify_resume": None, "timeline": ci.timeline, "tokens": ci.tokens,
                     "world_size": ci.world_size})
    rows.sort(key=lambda r: r["step"], reverse=True)
    return rows, "bus"


@click.command("checkpoints")
@click.argument("run", metavar="RUN", callback=not_empty)
@click.option("--quick", is_flag=True, help="Do not re-hash files (only check that the manifest and files exist).")
@redis_url_option
@json_option
@friendly_errors
def checkpoints(run, quick, redis_url, as_json):
    """List RUN's checkpoints: step, age, size, and verification (resume_verified / failed from
    `sentinel verify-resume`, else checksum_ok / corrupt / incomplete by re-hashing every file
    against its manifest).

    RUN is a run directory, or a run id on the bus (then the bus's record is shown, not re-hashed,
    unless the run's directory is on this machine).
    """
    from sentinel.runref import ops_errors

    ops_errors(_checkpoints)(run, quick, redis_url, as_json)


def _checkpoints(run, quick, redis_url, as_json):
    from sentinel import rundir
    from sentinel.protocol import finite_or_none
    from sentinel.runref import fmt_bytes, fmt_duration, resolve

    ref = resolve(run, redis_url, view=True)
    if ref.run_dir is None and ref.r is None:  # pragma: no cover - resolve() guarantees one of them
        raise click.ClickException("nothing to read")
    rejected: list[str] = []
    rows, source = checkpoint_rows(ref, rehash=not quick, rejected=rejected)
    pending = rundir.pending_rollback_for_view(ref.run_dir)
    out = {"run": ref.run, "run_dir": str(ref.run_dir) if ref.run_dir else None, "source": source,
           "checkpoints": rows, "pending_rollback": pending}
    if ref.bus_down:  # a bus that is down: the files are read, and that is said (not for a run that has stopped)
        out["note"] = offline_note(ref)
    count_bus_entries(out, rejected)
    if as_json:
        emit_json(out)
        return
    warn_rejected([out])
    from rich.table import Table
    from rich.text import Text

    from sentinel.cli.status_cmd import console_for_output

    console = console_for_output()
    t = Table(title=f"checkpoints of {ref.run}" + (f"  ({ref.run_dir})" if ref.run_dir else "  (from the bus)"),
              title_justify="left")
    # the key columns never wrap or truncate; the free-text detail wraps (80-column terminals)
    for col in ("step", "age", "size", "timeline", "tokens", "verified"):
        t.add_column(col, justify="right" if col != "verified" else "left", no_wrap=True)
    t.add_column("detail", ratio=1, overflow="fold")
    for r in rows:
        st = r["verified"]
        detail = r.get("problem") or ""
        vr = r.get("verify_resume")
        vtime = finite_or_none(vr.get("time")) if vr else None
        if vtime and st in ("resume_verified", "failed"):
            detail = f"verify-resume {fmt_duration(time.time() - vtime)} ago"
        if pending and pending["to_step"] == r["step"]:
            detail = (detail + "; " if detail else "") + "[yellow]pending rollback target[/]"
        t.add_row(str(r["step"]), fmt_duration(r.get("age_seconds")), fmt_bytes(r.get("bytes")),
                  "-" if r.get("timeline") is None else str(r["timeline"]),
                  "-" if r.get("tokens") is None else f"{r['tokens']:,}",
                  Text(st, style=STATUS_STYLE.get(st, "")), Text.from_markup(detail) if "[yellow]" in detail else Text(detail))
    if not rows:
        t.caption = "no checkpoints yet"
    elif source == "bus":
        t.caption = "as registered on the bus (the run directory is not on this machine: files not re-hashed)"
    elif quick:
        t.caption = "--quick: files not re-hashed"
    console.print(t)
    if out.get("note"):
        click.echo(f"note: {ref.run}: {out['note']}", err=True)
