"""``sentinel incidents`` and ``sentinel approve``.

Incidents live in the run's ``incidents`` hash (written by the daemon, and by ``sentinel rollback``
for manual rollbacks); their timelines are the ``events`` stream entries that carry their id.
``approve`` XADDs a signed ``resume`` Directive naming the incident to the run's ``approvals``
stream, which the leader daemon reads (``RunWatcher._read_approvals``) and acts on.
"""

from __future__ import annotations

import re
import shlex
import time

import click

from sentinel.cli.common import (
    WRONG_TYPE,
    FiniteFloat,
    OneLineText,
    SentinelError,
    bus_entry,
    count_bus_entries,
    emit_json,
    emit_runs,
    files_source_line,
    fmt_clock,
    friendly_errors,
    json_option,
    not_empty,
    offline_note,
    read_or_reject,
    read_unless_wrong_type,
    redis_url_option,
    secret_file_option,
)
from sentinel.protocol import finite_or_none

EVENTS_SCAN = 20_000  # newest events read per run to build timelines
APPROVABLE = ("awaiting_approval", "escalated")
# the shape of an incident id (RunPolicy: RUN-tTIMELINE-sSTEP[-n|-esc|-hang-T]; sentinel rollback:
# RUN-manual-YYYYmmddTHHMMSS-xxxx), to tell a person who passed one as RUN how to ask for it
INCIDENT_ID_SHAPE = re.compile(r"-(?:t\d+-s\d+|manual-\d{8}T\d{6})")
NOT_DAMAGE = ("suspect", "recovered")  # states of an episode the policy never judged to be damage


LAST = 20  # incidents shown by default, newest last: a long run closes thousands (each recovered spike is one)


def run_incidents(ref, *, only_open: bool = False, incident_id: str | None = None, last: int = 0) -> dict:
    """{"run", "incidents": [incident + "timeline" + "outcome"], "orphan_events": [...]} for one run;
    ``last`` > 0: only the newest ``last`` of them (``older_not_shown`` counts the rest)."""
    from sentinel import bus, rundir
    from sentinel.incidents_view import annotate_actions
    from sentinel.protocol import Ack, Event, SchemaError
    from sentinel.rundir import read_incidents_log

    out: dict = {"run": ref.run, "source": "bus" if ref.r is not None else "files", "only_open": only_open,
                 "incidents": []}
    rejected: list[str] = []  # malformed lines of the run directory's incidents.jsonl, skipped
    bad_entries: list[str] = []  # malformed entries of the bus's incidents hash, skipped
    trainer_log = rundir.read_directives_log(ref.run_dir, tail=2000) if ref.run_dir else []
    if ref.r is None:
        # no bus: what the run directory remembers (the incidents mirror, manual actions, applied directives)
        out["note"] = offline_note(ref)
        out["audit"] = rundir.read_audit(ref.run_dir, tail=200) if ref.run_dir else []
        out["directives"] = trainer_log[-200:]
        incs = read_incidents_log(ref.run_dir, rejected) if ref.run_dir else []
        entries, applied, acks = [], None, {}
    else:
        raw = read_or_reject(ref.r, "incidents", lambda: ref.r.hgetall(ref.keys.incidents), bad_entries, {})
        entries = read_or_reject(ref.r, "events", lambda: ref.r.xrevrange(ref.keys.events, count=EVENTS_SCAN), bad_entries, [])
        applied = read_or_reject(ref.r, "applied", lambda: ref.r.hgetall(ref.keys.applied), bad_entries, {})
        ack_entries = read_or_reject(ref.r, "acks", lambda: ref.r.xrevrange(ref.keys.acks, count=EVENTS_SCAN), bad_entries, [])
        incs = []
        for field, v in raw.items():
            inc = rundir.parse_incident(v)
            if inc is None:
                bad_entries.append(bus_entry("incidents", field))
            else:
                incs.append(inc)
        acks = {}
        for _eid, fields in ack_entries:
            try:
                a = Ack.from_json((fields or {}).get(bus.FIELD, "{}"))
            except SchemaError:
                continue
            acks.setdefault(a.directive_id, a.model_dump(mode="json"))
        if ref.run_dir is not None:  # a restarted bus forgot what the run dir's mirror remembers
            known = {i.id for i in incs}
            incs += [i for i in read_incidents_log(ref.run_dir, rejected) if i.id not in known]
    by_id: dict[str, list[dict]] = {}
    for eid, fields in reversed(entries):
        try:
            ev = bus.decode((eid, fields), Event)
        except SchemaError:
            continue
        if ev.incident_id:
            by_id.setdefault(ev.incident_id, []).append({"id": eid, **ev.model_dump(mode="json", exclude={"v", "run"})})
    incs.sort(key=lambda i: i.opened_at)
    incs = [i for i in incs if (not incident_id or i.id == incident_id) and not (only_open and i.closed_at is not None)]
    out["older_not_shown"] = max(0, len(incs) - last) if last > 0 else 0
    for inc in incs[len(incs) - last:] if last > 0 else incs:
        d = inc.model_dump(mode="json", exclude={"v"})
        d["open"] = inc.closed_at is None
        d["first_flagged_step"] = _first_flagged(inc)
        d["timeline"] = by_id.get(inc.id, [])
        d["outcome"] = _outcome(inc, d["timeline"])
        annotate_actions(d, applied=applied, acks=acks, trainer_log=trainer_log)
        d["state_text"] = state_text(d)
        out["incidents"].append(d)
    out["rejected_lines"], out["first_rejected"] = len(rejected), (rejected[0] if rejected else None)
    count_bus_entries(out, bad_entries)
    return out


def _first_flagged(inc) -> int | None:
    """The earliest step in the incident's evidence: the step a rule first flagged. ``detect_step``
    is the step the policy declared damage (or the episode's last flagged step), so a spike flagged
    at 101 and judged damage at 112 reads "detected 112" unless this is shown beside it."""
    steps = [e.get("step") for e in inc.evidence if isinstance(e, dict)]
    steps = [s for s in steps if isinstance(s, int) and not isinstance(s, bool)]
    return min(steps) if steps else None


def state_text(inc: dict) -> str:
    """What the incident's state means to a person: "rolled back to 80" when the trainer applied a
    rollback (and ", recovered" once the incident closed healthy), not the policy's bare word
    ``healthy``; else the state as it is (``verifying``, ``escalated``, ``recovered``, ...)."""
    rolled = [a for a in inc.get("actions") or [] if a.get("kind") == "rollback" and a.get("to_step") is not None
              and str(a.get("outcome") or "").startswith(("acked", "prepared"))]
    if not rolled:
        return str(inc.get("state"))
    text = f"rolled back to {rolled[-1]['to_step']}"
    if str(rolled[-1].get("outcome")).startswith("prepared"):
        text += " at the next start"
    if inc.get("closed_at") is not None and inc.get("state") == "healthy":
        return text + ", recovered"
    return text if inc.get("state") in ("healthy", "rollback") else f"{text}; {inc.get('state')}"


def _outcome(inc, timeline: list[dict]) -> str:
    """One line: what the incident came to. A closed incident says at which step and why (the
    policy's own reason, kept on the incident): "closed (healthy)" alone gives no evidence."""
    if inc.closed_at is None:
        if inc.actions and all(a.get("dry_run") for a in inc.actions):
            return "dry run: nothing was sent; one incident held open until the loss is back in band"
        return {"awaiting_approval": "run paused; waiting for `sentinel approve`",
                "escalated": "escalated: automation stopped, a human must act",
                "verifying": "rolled back; verifying recovery", "rollback": "rollback in progress",
                }.get(inc.state, f"open ({inc.state})")
    if inc.close_reason:
        at = f" at step {inc.closed_step}" if inc.closed_step is not None else ""
        return f"closed ({inc.state}){at}: {inc.close_reason}"
    for ev in reversed(timeline):
        if ev["kind"] in ("incident_closed", "manual_rollback", "approved"):
            return ev["message"]
    return f"closed ({inc.state})"


def _render(runs: list[dict]):
    """Rich renderables for people; every table fits 80 columns (long text wraps, never truncates)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    from sentinel.runref import fmt_duration

    parts = []
    for run in runs:
        if (line := files_source_line(run, "the run directory")) is not None:
            parts.append(line)
        if not run["incidents"]:
            parts.extend(_no_incidents(run))
            continue
        if run.get("older_not_shown"):
            parts.append(Text(f"{run['run']}: {run['older_not_shown']} older incident(s) not shown; the newest "
                              f"{len(run['incidents'])} follow (--limit 0 shows all, --id INCIDENT one)", style="dim"))
        for inc in run["incidents"]:
            style = "red" if inc["open"] else "green"
            dur = fmt_duration((inc["closed_at"] or time.time()) - inc["opened_at"])
            pat = inc.get("pattern")
            at = f" at step {inc['closed_step']}" if inc.get("closed_step") is not None else ""
            head = Text.assemble(("rule ", "dim"), (inc["rule"], "bold"), ("  state ", "dim"),
                                 (inc.get("state_text") or inc["state"], style),
                                 ("\nonset step ", "dim"), str(inc["onset_step"]), *_steps(inc),
                                 ("\nopened ", "dim"), _ts(inc["opened_at"]), "  ",
                                 (f"closed after {dur}{at}" if not inc["open"] else f"open for {dur}", style),
                                 *((("  spikes ", "dim"), (pat, "bold red" if pat == "increasing" else "bold")) if pat else ()))
            body = [head]
            ev = inc.get("evidence") or []
            if ev:
                et = Table(title="evidence", title_justify="left", show_edge=False, pad_edge=False)
                et.add_column("step", justify="right", no_wrap=True)
                et.add_column("loss", justify="right", no_wrap=True)
                et.add_column("grad norm", justify="right", no_wrap=True)
                et.add_column("detail", ratio=1)
                for e in ev[:12]:
                    skip = e.get("skip_reason") or ("skipped" if e.get("skipped") else "")
                    et.add_row(str(e.get("step", "")), _num(e.get("loss"), ".4f"), _num(e.get("grad_norm"), ".3f"),
                               Text(" ".join(x for x in (f"[{skip}]" if skip else "", str(e.get("detail", ""))) if x)))
                if len(ev) > 12:
                    et.caption = f"... {len(ev) - 12} more (--json)"
                body.append(et)
            body.extend(_actions_table(inc))
            tl = inc.get("timeline") or []
            if tl:
                tt = Table(title="timeline", title_justify="left", show_edge=False, pad_edge=False)
                tt.add_column("time (UTC)", no_wrap=True)
                tt.add_column("step", justify="right", no_wrap=True)
                tt.add_column("event", ratio=1)
                sev = {"critical": "red", "warning": "yellow"}
                for e in tl[-30:]:
                    tt.add_row(_utc(e["time"]),
                               "" if e.get("step") is None else str(e["step"]),
                               Text.assemble((e["kind"], sev.get(e["severity"], "bold")), " ", e["message"]))
                body.append(tt)
            body.append(Text.assemble("outcome: ", (inc["outcome"], style)))
            parts.append(Panel(Group(*body), title=Text(inc["id"], style="bold"), title_align="left",
                               border_style=style))
        if run.get("report"):
            parts.append(Text(f"report: {run['report']}", style="bold"))
        elif run.get("report_error"):
            parts.append(Text(f"report: not written ({run['report_error']})", style="yellow"))
    return Group(*parts)


def _no_incidents(run: dict) -> list:
    """What a run without (open) incidents shows: says so, whatever the source. Without a bus and
    without --open, the run directory's manual actions and applied directives follow; with --open
    they do not answer the question (--json still lists them)."""
    from rich.text import Text

    what = "no open incidents" if run.get("only_open") else "no incidents"
    out = [Text(f"{run['run']}: {what}", style="green")]
    if run["source"] == "files" and not run.get("only_open"):
        out.append(_files_table(run))
    return out


def _steps(inc: dict) -> tuple:
    """The heading's step words: ", detected D", or, when a rule flagged the episode before that,
    ", first flagged F, declared D" (damage) / ", first flagged F, last flagged D" (an episode that
    recovered), so the step damage was declared at does not hide the step it was first seen."""
    flagged, detect = inc.get("first_flagged_step"), inc["detect_step"]
    if flagged is None or flagged >= detect:
        return ((", detected ", "dim"), str(detect))
    last = "last flagged" if inc["state"] in NOT_DAMAGE else "declared"
    return ((", first flagged ", "dim"), str(flagged), (f", {last} ", "dim"), str(detect))


def _utc(t, fmt: str = "%H:%M:%S") -> str:
    """A wall-clock time in UTC: incidents are read next to other machines' logs and by people in
    other zones, so an unlabelled local time is ambiguous."""
    return fmt_clock(t, fmt, utc=True)


def _ts(t):
    """A date and time, labelled UTC."""
    if not t:
        return "-"
    s = _utc(t, "%Y-%m-%d %H:%M:%S")
    return s if s == "?" else f"{s} UTC"


_OUTCOME_STYLE = {"acked": "green", "acked (duplicate)": "green", "rejected": "bold red", "failed": "bold red",
                  "timed out": "bold red", "waiting for ack": "yellow", "paged": "yellow",
                  "would send (dry run)": "cyan"}


def _actions_table(inc: dict) -> list:
    """Only what was actually sent (with the trainer's answer) and what a dry run would have sent."""
    from rich.table import Table
    from rich.text import Text

    from sentinel import rundir

    acts = inc.get("actions") or []
    shown = [a for a in acts if a.get("sent") or a.get("dry_run")]
    hidden = len(acts) - len(shown)
    if not shown:
        return [Text(f"actions: none sent ({hidden} decided, not sent; --json lists them)", style="dim")] if hidden else []
    dry = all(a.get("dry_run") for a in shown)
    at = Table(title="would-be actions (dry run: nothing was sent)" if dry else "actions sent", title_justify="left",
               show_edge=False, pad_edge=False)
    at.add_column("time (UTC)", no_wrap=True)
    at.add_column("action", no_wrap=True)
    at.add_column("outcome", no_wrap=True)
    at.add_column("why", ratio=1)
    for a in shown:
        what = str(a.get("kind"))
        if a.get("to_step") is not None:
            what += f" to {a['to_step']}"
        rs = _ranges(a.get("ranges"))
        if rs:
            what += f", skip {rundir.count(rs)}"
        who = str(a.get("issuer") or "")
        why = str(a.get("reason") or "") + (f" (by {who})" if who.startswith("cli:") else "")
        outcome = a.get("outcome") or ""
        at.add_row(_utc(a["time"]) if a.get("time") else "-", what,
                   Text(outcome, style=_OUTCOME_STYLE.get(outcome, "")), Text(why))
    if hidden:
        at.caption = f"{hidden} more decided but not sent (rate limit, duplicate, hands off); --json lists them"
    return [at]


def _files_table(run: dict):
    from rich.table import Table
    from rich.text import Text

    t = Table(title="manual actions (audit.jsonl) and applied directives (directives.jsonl)", title_justify="left",
              show_edge=False, pad_edge=False)
    t.add_column("time (UTC)", no_wrap=True)
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("what", ratio=1)
    rows = [(a.get("time"), a.get("to_step", a.get("step", "")),
             f"{a.get('action')} {a.get('phase', '')} by {a.get('who', '?')}: {a.get('reason') or a.get('outcome') or ''}")
            for a in run.get("audit", [])]
    rows += [(d.get("time"), d.get("step", ""),
              f"{d.get('kind')} {d.get('status')} by {d.get('issuer', '?')}: {d.get('reason') or ''}")
             for d in run.get("directives", [])]
    for r in sorted(rows, key=lambda x: finite_or_none(x[0]) or 0.0):
        when = _utc(r[0], "%Y-%m-%d %H:%M:%S") if r[0] else "-"  # the column says UTC: no suffix per row
        t.add_row(when, "" if r[1] is None else str(r[1]), Text(r[2].rstrip(": ")))
    return t


def _attach_report(ref, run: dict, incident_id: str | None) -> None:
    """Draw the run's picture (``sentinel report``) for a person reading incidents; never fail for it."""
    from sentinel.cli.report_cmd import write_report

    try:
        run["report"] = write_report(ref, incident_id=incident_id)["path"]
    except Exception as e:  # noqa: BLE001 - the incidents are the answer; the picture is a bonus
        run["report_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__


def _num(x, fmt):
    if x is None:
        return ""
    try:
        return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)[:20]
    except OverflowError:  # an integer beyond float range, from a hostile line
        return "?"


def _ranges(raw) -> list[tuple[int, int]]:
    """An action's sample ranges as [lo, hi) int pairs; malformed ones (from a file) are dropped."""
    from sentinel.contract.ranges import valid_ranges

    return valid_ranges(raw)


@click.command("incidents")
@click.argument("runs", nargs=-1, metavar="[RUN]...", callback=not_empty)
@click.option("--open", "only_open", is_flag=True, help="Only incidents that are still open.")
@click.option("--id", "incident_id", metavar="INCIDENT", callback=not_empty, help="Only this incident.")
@click.option("--limit", "last", type=click.IntRange(min=0), default=LAST, show_default=True,
              help="Show the newest N incidents per run (0: all; a long run closes thousands).")
@redis_url_option
@json_option
@friendly_errors
def incidents(runs, only_open, incident_id, last, redis_url, as_json):
    """Incident timelines: evidence (the triggering step records), actions and outcomes.

    RUN is a run directory or a run id on the bus; without RUN, every run registered on the bus.
    One incident: sentinel incidents RUN --id INCIDENT. Times are UTC.
    """
    from sentinel.runref import ops_errors

    ops_errors(_incidents)(runs, only_open, incident_id, last, redis_url, as_json)


def _incidents(runs, only_open, incident_id, last, redis_url, as_json):
    refs = _resolve_runs(runs, redis_url)
    out = [run_incidents(ref, only_open=only_open, incident_id=incident_id, last=0 if incident_id else last) for ref in refs]
    if incident_id and not any(r["incidents"] for r in out):
        raise SentinelError(f"incident {incident_id} not found")
    if not as_json:
        for ref, run in zip(refs, out):
            if ref.run_dir is not None and run["incidents"]:
                _attach_report(ref, run, incident_id)
    emit_runs(out, as_json, _render)


def _resolve_runs(runs, redis_url):
    """The RUN arguments as run refs. RUN is variadic (several runs at once), so an incident id
    given positionally (``incidents RUN INCIDENT``) is taken for a run and fails to resolve: that
    error then says how to ask for one incident, instead of only that it is not a run."""
    from sentinel.runref import RunRefError, all_runs, resolve

    if not runs:
        return all_runs(redis_url)
    refs = []
    for x in runs:
        try:
            refs.append(resolve(x, redis_url, view=True))
        except RunRefError as e:
            if not INCIDENT_ID_SHAPE.search(x):
                raise
            run = next((r for r in runs if r != x and not INCIDENT_ID_SHAPE.search(r)), "RUN")
            raise RunRefError(f"{e}; {x!r} looks like an incident id: to show one incident: "
                              f"sentinel incidents {shlex.quote(run)} --id {shlex.quote(x)}") from None
    return refs


# --------------------------------------------------------------------------------------------
# approve
# --------------------------------------------------------------------------------------------


def find_incident(incident_id: str, run: str | None, redis_url: str | None):
    """(RunRef, Incident) for an incident id: in ``--run``'s incidents hash, else in every registered run's."""
    from sentinel.protocol import Incident, SchemaError
    from sentinel.runref import all_runs, printable, resolve

    if run:
        refs = [resolve(run, redis_url, need_bus=True)]
    else:
        try:
            refs = all_runs(redis_url)
        except Exception as e:
            from sentinel.runref import RunRefError

            if isinstance(e, RunRefError):
                raise RunRefError(f"{e}; or pass --run RUN_DIR") from None
            raise
    malformed = None
    for ref in refs:  # a run whose incidents key is of another type holds no incident: look on
        raw = read_unless_wrong_type(ref.r, lambda: ref.r.hget(ref.keys.incidents, incident_id))
        if raw and raw is not WRONG_TYPE:
            try:
                return ref, Incident.from_json(raw)
            except SchemaError as e:  # anyone with bus access can write it: look on, and say so if nothing else is found
                malformed = malformed or (ref, e)
    if malformed:
        ref, e = malformed
        raise SentinelError(f"run {printable(ref.run)}: incident {printable(incident_id)}: its entry in the bus's incidents "
                            f"hash is malformed ({printable(str(e), 200)}); nothing was approved")
    where = f"run {printable(refs[0].run)}" if run else f"any of the {len(refs)} run(s) on the bus"
    raise SentinelError(f"incident {printable(incident_id, 200)} not found in {where}")


def publish_approval(ref, inc, secret: bytes, who: str, reason: str | None):
    """A signed approval of ``inc`` on the run's approvals stream (the leader daemon acts on it), and
    an audit line; returns (directive, stream id). Used by ``approve`` and by ``resume``."""
    from sentinel import bus, rundir
    from sentinel.protocol import Directive

    d = Directive(run=ref.run, kind="resume", incident_id=inc.id, issuer=who,
                  reason=reason or f"approved by {who}").signed(secret)
    sid = bus.publish_own(ref.r, ref.keys.approvals, d)
    if ref.run_dir is not None:
        rundir.append_audit(ref.run_dir, {"action": "approve", "who": who, "run": ref.run, "incident_id": inc.id,
                                          "incident_state": inc.state, "reason": reason, "directive_id": d.id,
                                          "stream_id": sid})
    return d, sid


@click.command("approve")
@click.argument("incident_id", metavar="INCIDENT", callback=not_empty)
@click.option("--run", "run", metavar="RUN", callback=not_empty, help="The incident's run (a run dir or id); default: search every run on the bus.")
@click.option("--reason", type=OneLineText(), help="Why (recorded with the approval).")
@click.option("--force", is_flag=True, help="Send the approval even if the incident does not look like it is waiting for one.")
@click.option("--wait", "wait_s", type=FiniteFloat(0, 86_000), default=0.0, show_default=True,
              help="Seconds to wait for the sentinel to act on the approval (0: do not wait).")
@secret_file_option
@redis_url_option
@json_option
@friendly_errors
def approve(incident_id, run, reason, force, wait_s, secret_file, redis_url, as_json):
    """Approve the pending action of INCIDENT (require_approval mode) or hand an escalated run back
    to automation: a signed approval on the run's approvals stream, for the sentinel daemon.

    Incident ids look like RUNID-t0-s101; the run is found on the bus unless --run is given.
    """
    from sentinel.runref import ops_errors

    ops_errors(_approve)(incident_id, run, reason, force, wait_s, secret_file, redis_url, as_json)


def _approve(incident_id, run, reason, force, wait_s, secret_file, redis_url, as_json):
    from sentinel import bus
    from sentinel.protocol import Event, SchemaError
    from sentinel.runref import issuer

    ref, inc = find_incident(incident_id, run, redis_url)
    if not force and (inc.closed_at is not None or inc.state not in APPROVABLE):
        raise SentinelError(f"incident {inc.id} is {inc.state}{' (closed)' if inc.closed_at else ''}: nothing to approve "
                            f"(only {' / '.join(APPROVABLE)} incidents wait for one; --force sends it anyway)")
    secret = ref.secret(secret_file)
    who = issuer()
    with bus.bus_errors(ref.r):
        tail = ref.r.xrevrange(ref.keys.events, count=1)
    ev_cursor = tail[0][0] if tail else "0-0"
    d, sid = publish_approval(ref, inc, secret, who, reason)
    acted = None
    if wait_s > 0:
        deadline = time.monotonic() + wait_s
        while acted is None and time.monotonic() < deadline:
            with bus.bus_errors(ref.r):
                resp = ref.r.xread({ref.keys.events: ev_cursor}, count=100, block=500)
            for _, items in resp or []:
                for eid, fields in items:
                    ev_cursor = eid
                    try:
                        ev = bus.decode((eid, fields), Event)
                    except SchemaError:
                        continue
                    if ev.incident_id == inc.id and ev.kind == "approved":
                        acted = ev.message
    res = {"run": ref.run, "incident_id": inc.id, "incident_state": inc.state, "directive_id": d.id, "stream_id": sid,
           "issuer": who, "acted": acted}
    if as_json:
        emit_json(res)
    else:
        click.echo(f"approved {inc.id} ({inc.state}) as {who}: approval {sid} on the bus")
        if acted:
            click.echo(f"the sentinel acted: {acted}")
        elif wait_s > 0:
            click.echo(f"warning: no sentinel acted on it within {wait_s:.0f}s (is `sentinel run` watching {ref.run}?)", err=True)
    if wait_s > 0 and acted is None:
        raise SystemExit(1)
