"""``sentinel pages RUN``: every page the sentinel sent for a run, newest last.

Pages are ``page`` entries of the run's events stream on the bus (with the rule and where each was
delivered), mirrored by the daemon to ``RUN_DIR/pages.jsonl``. With the bus down, or after a bus
restart forgot them, the run directory's mirror still answers: both are merged, by time and text.
"""

from __future__ import annotations

import click

from sentinel.cli.common import (
    count_bus_entries,
    emit_runs,
    files_source_line,
    fmt_clock,
    friendly_errors,
    json_option,
    not_empty,
    offline_note,
    read_or_reject,
    redis_url_option,
)

EVENTS_SCAN = 20_000  # newest events read per run


def run_pages(ref, limit: int | None = None) -> dict:
    """{"run", "source", "pages": [page dict with rundir.PAGE_FIELDS]} for one run, oldest first."""
    from sentinel import bus, rundir
    from sentinel.protocol import Event, SchemaError

    out: dict = {"run": ref.run, "source": "bus" if ref.r is not None else "files", "pages": []}
    pages: dict[tuple, dict] = {}
    bad_entries: list[str] = []
    if ref.r is not None:
        with bus.bus_errors(ref.r):  # one run's key of the wrong type costs that run's bus pages, not the listing
            entries = read_or_reject(ref.r, "events", lambda: ref.r.xrevrange(ref.keys.events, count=EVENTS_SCAN),
                                     bad_entries, [])
        for eid, fields in entries:
            try:
                ev = bus.decode((eid, fields), Event)
            except SchemaError:
                continue
            if ev.kind != "page":
                continue
            page = rundir.normalize_page({"time": ev.time, "run": ev.run, "severity": ev.severity, "summary": ev.message,
                                          "incident_id": ev.incident_id, **ev.data})
            pages[(round(page["time"], 3), page["summary"])] = page
    else:
        out["note"] = offline_note(ref)
    if ref.run_dir is not None:  # the mirror: all of it without a bus, what a restarted bus forgot with one
        rejected: list[str] = []
        for page in rundir.read_pages_log(ref.run_dir, rejected=rejected):
            pages.setdefault((round(page["time"], 3), page["summary"]), page)
        out["rejected_lines"], out["first_rejected"] = len(rejected), (rejected[0] if rejected else None)
        if ref.r is not None and (ref.run_dir / rundir.PAGES_LOG).is_file():
            out["source"] = "bus+files"
    ordered = sorted(pages.values(), key=lambda p: p["time"])
    count_bus_entries(out, bad_entries)
    out["total"] = len(ordered)
    out["pages"] = ordered[-limit:] if limit else ordered
    return out


def _render(runs: list[dict]):
    """Rich renderables; the table fits 80 columns (the summary wraps, never truncates)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = []
    for run in runs:
        if (line := files_source_line(run, "the run directory's pages.jsonl")) is not None:
            parts.append(line)
        if not run["pages"]:
            parts.append(Text(f"{run['run']}: no pages", style="green"))
            continue
        shown = len(run["pages"])
        more = f" (last {shown} of {run['total']})" if run["total"] > shown else ""
        t = Table(title=f"{run['run']}: {run['total']} page(s){more}", title_justify="left", expand=False)
        t.add_column("time", no_wrap=True)
        t.add_column("sev", no_wrap=True)
        t.add_column("rule", overflow="fold", max_width=16)
        t.add_column("summary", overflow="fold", ratio=1)
        t.add_column("sent to", overflow="fold", max_width=9)
        for p in run["pages"]:
            sev = p["severity"]
            style = {"critical": "bold red", "warning": "yellow"}.get(sev, "")
            rule = p["rule"] or "-"
            summary = Text(p["summary"].removeprefix(f"{rule}: "))
            if p["incident_id"]:
                summary.append(f"\nincident {p['incident_id']}", style="dim")
            to = Text("\n".join(p["delivered_to"]) or "-", style="" if "alertmanager" in p["delivered_to"] else "red")
            t.add_row(fmt_clock(p["time"], "%m-%d %H:%M:%S"), Text(sev[:4], style=style),
                      Text(rule), summary, to)
        parts.append(t)
        if any("alertmanager" not in p["delivered_to"] for p in run["pages"]):
            parts.append(Text("red 'sent to': the page reached no one (no Alertmanager): start the daemon with "
                              "--alertmanager-url", style="dim"))
    return Group(*parts)


@click.command("pages")
@click.argument("runs", nargs=-1, metavar="[RUN]...", callback=not_empty)
@click.option("--limit", type=click.IntRange(min=0), default=50, show_default=True,
              help="Show the newest N pages per run (0: all), as `incidents --limit`.")
@redis_url_option
@json_option
@friendly_errors
def pages(runs, limit, redis_url, as_json):
    """Past pages of a run: when, how severe, which rule and incident, what it said, where it went.

    RUN is a run directory (works with the bus down, from RUN_DIR/pages.jsonl) or a run id on the
    bus; without RUN, every run registered on the bus.
    """
    from sentinel.runref import ops_errors

    ops_errors(_pages)(runs, limit, redis_url, as_json)


def _pages(runs, limit, redis_url, as_json):
    from sentinel.runref import resolve_many

    out = [run_pages(ref, limit) for ref in resolve_many(runs, redis_url, view=True)]
    emit_runs(out, as_json, _render)
