"""``sentinel report RUN``: one PNG of a run (or of one incident) for the on-call engineer.

Data: ``RUN_DIR/steps.jsonl`` (steps, resume/rollback records, schedule markers), ``skiplist.json``,
``directives.jsonl`` (what the trainer applied), and incidents from ``RUN_DIR/incidents.jsonl`` (the
daemon's mirror), else from the bus when it answers. Painting is ``sentinel.report``.
"""

from __future__ import annotations

import re
from pathlib import Path

import click

from sentinel.cli.common import SentinelError, emit_json, friendly_errors, json_option, not_empty, redis_url_option

REPORTS_DIR = "reports"
INCIDENT_CONTEXT_STEPS = 40  # steps shown around an incident with --incident


def default_path(run_dir: Path, incident_id: str | None = None) -> Path:
    """RUN_DIR/reports/run.png, or incident-ID.png: an id is only part of a file name (one read
    from a hostile mirror line or bus entry, ``../../x``, must not write outside the run dir)."""
    if not incident_id:
        return Path(run_dir) / REPORTS_DIR / "run.png"
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", incident_id)[:128].lstrip(".") or "_"
    return Path(run_dir) / REPORTS_DIR / f"incident-{safe}.png"


def load_incidents(ref) -> tuple[list, str]:
    """Incidents of the run and where they came from: the run dir's mirror, else the bus, else none."""
    from sentinel.rundir import read_incidents_log

    incs = read_incidents_log(ref.run_dir) if ref.run_dir is not None else []
    source = "incidents.jsonl" if incs else "none"
    if ref.r is not None:
        from sentinel import bus
        from sentinel.rundir import parse_incident

        known = {i.id for i in incs}
        try:
            with bus.bus_errors(ref.r):
                raw = ref.r.hgetall(ref.keys.incidents)
        except bus.BusError:
            raw = {}
        for v in raw.values():
            inc = parse_incident(v)
            if inc is not None and inc.id not in known:
                incs.append(inc)
                source = "bus" if source == "none" else f"{source} + bus"
    return sorted(incs, key=lambda i: i.opened_at), source


def build(ref, incident_id: str | None = None):
    """The :class:`sentinel.report.ReportData` of a run (zoomed on ``incident_id`` if given)."""
    from sentinel import rundir
    from sentinel.report import STATE_WORDS, gather

    run_dir = ref.run_dir
    rejected: list[str] = []
    incs, source = load_incidents(ref)
    cfg = rundir.run_config(run_dir)  # {} when unreadable (not UTF-8, nested 50,000 deep): no phases from it
    # the log is streamed into the figure's data: a long run's is never held whole
    data = gather(ref.run, rundir.read_records(run_dir, rejected), skiplist=rundir.read_skiplist(run_dir), incidents=incs,
                  directives=rundir.read_directives_log(run_dir), config=cfg or None)
    if not data.segments:
        why = f" ({len(rejected)} malformed line(s); first: {rejected[0]})" if rejected else ""
        raise SentinelError(f"{run_dir / rundir.STEPS} has no step records yet: nothing to draw{why}")
    if incident_id:
        inc = next((i for i in data.incidents if i["id"] == incident_id), None)
        if inc is None:
            known = ", ".join(i["id"] for i in data.incidents[-5:]) or "none"
            raise SentinelError(f"incident {incident_id} not found for run {ref.run} (incidents: {known})")
        lo = min(inc["onset"], inc.get("rollback_to") or inc["onset"]) - INCIDENT_CONTEXT_STEPS
        hi = max(inc["detect"], inc["onset"]) + 2 * INCIDENT_CONTEXT_STEPS
        data.focus = (max(0, lo), hi)
        data.title_note = (f"incident {inc['id']}: {inc['rule']}, onset step {inc['onset']}, detected {inc['detect']}, "
                           f"{STATE_WORDS.get(inc['state'], inc['state'])}")
    return data, source, rejected


def write_report(ref, out: str | Path | None = None, incident_id: str | None = None) -> dict:
    """Write the PNG; returns {"path", "incidents_source", counts...}."""
    from sentinel.report import check_out_path, render

    if ref.run_dir is None:
        raise SentinelError(f"run {ref.run}: its run directory is not on this machine; run `sentinel report RUN_DIR` "
                            "on the host that has it")
    if out:
        check_out_path(out)  # a bad --out is said before the run is read (render checks it again)
    data, source, rejected = build(ref, incident_id)
    path = render(data, Path(out) if out else default_path(ref.run_dir, incident_id))
    return {"run": ref.run, "path": str(path), "incident": incident_id, "incidents_source": source,
            "steps": sum(len(s.steps) for s in data.segments if not s.abandoned),
            "abandoned_steps": sum(len(s.steps) for s in data.segments if s.abandoned),
            "incidents": len(data.incidents), "rollbacks": len(data.rollbacks), "guard_skips": len(data.guard_skips),
            "skip_windows": [list(w) for w in data.skip_windows],
            "phases": [list(p) for p in data.phases],
            "rejected_lines": len(rejected), "first_rejected": rejected[0] if rejected else None}


@click.command("report")
@click.argument("run", metavar="RUN", callback=not_empty)
@click.option("--incident", "incident_id", metavar="ID", callback=not_empty, help="Zoom on one incident (its onset, detection and recovery).")
@click.option("--out", type=click.Path(dir_okay=False), metavar="PATH", callback=not_empty,
              help="Where to write the PNG, at exactly this path (.png or no suffix; default: RUN_DIR/reports/run.png "
                   "or incident-ID.png).")
@redis_url_option
@json_option
@friendly_errors
def report(run, incident_id, out, redis_url, as_json):
    """Write a PNG of RUN: loss and grad norm per step with val PPL, guard skips, incidents,
    rollbacks (and the steps they abandoned), resumes, skip windows and the LR schedule phases
    (warmup / stable / decay), on one step axis. Prints the path.

    RUN is a run directory (or a run id on the bus whose run directory is on this machine).
    Incidents come from RUN_DIR/incidents.jsonl, else from the bus when it answers.
    """
    from sentinel.runref import ops_errors, resolve

    res = ops_errors(lambda: write_report(resolve(run, redis_url, view=True), out, incident_id))()
    if as_json:
        emit_json(res)
        return
    if res["rejected_lines"]:
        click.echo(f"warning: skipped {res['rejected_lines']} malformed line(s); first: {res['first_rejected']}", err=True)
    click.echo(f"report: {res['path']}")
    src = res["incidents_source"]
    click.echo(f"  {res['steps']} steps ({res['abandoned_steps']} abandoned by rollbacks), {res['incidents']} incident(s)"
               + (f" from {src}" if src and src != "none" else "")
               + f", {res['rollbacks']} rollback(s), {res['guard_skips']} guard skip(s)")
