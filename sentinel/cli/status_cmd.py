"""``sentinel status``: one row per run, with what is out of band marked.

Live runs are read from the control bus (the step stream's tail, heartbeat, checkpoints, incidents,
acks); a run directory with no reachable bus is read from its files (``steps.jsonl``, checkpoint
manifests, ``directives.jsonl``). Torch-free.
"""

from __future__ import annotations

import json
import time

import click

from sentinel.cli.common import (
    FiniteFloat,
    bus_entry,
    console_for_output,
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

WINDOW = 200  # step records read per run (loss median, guard skips, last val PPL)
LOSS_BAND = 1.20  # loss above 1.2x its recent median is out of band
CKPT_OLD_S = 2 * 3600.0
# no new step for this long (or 10x the recent median step time, if longer) while the trainer's bus
# thread still heartbeats: the step loop is stuck (a hung rank, a dead collective), not the process
HUNG_AFTER_S = 30.0
HUNG_STEP_FACTOR = 10.0


def hung_after_seconds(records) -> float:
    """How long without a new step before a heartbeating run counts as hung, given its recent steps."""
    times = sorted(r.step_seconds for r in records if getattr(r, "step_seconds", None))
    return max(HUNG_AFTER_S, HUNG_STEP_FACTOR * times[len(times) // 2]) if times else HUNG_AFTER_S


def run_status(ref, now: float | None = None) -> dict:
    """Everything status shows for one run, as a JSON-able dict."""
    from sentinel import bus, rundir
    from sentinel.protocol import MAX_SAMPLE_ID, Ack, CheckpointInfo, Incident, SchemaError, finite_or_none
    from sentinel.runref import HEARTBEAT_STALE_S

    now = time.time() if now is None else now
    row: dict = {"run": ref.run, "run_dir": str(ref.run_dir) if ref.run_dir else None, "bus": ref.describe_bus(),
                 "source": "bus" if ref.r is not None else "files"}
    bad_entries: list[str] = []  # malformed entries (or keys of the wrong type) on the bus, skipped
    records: list = []
    hb = None
    if ref.r is not None:
        k = ref.keys
        with bus.bus_errors(ref.r):  # a steps key of the wrong type costs this run's bus view, not the listing
            entries = read_or_reject(ref.r, "steps", lambda: ref.r.xrevrange(k.steps, count=WINDOW), bad_entries, [])
        for eid, fields in reversed(entries):
            try:
                records.append(bus.decode((eid, fields)))
            except SchemaError:
                continue
        hb = ref.heartbeat()
    if not records and ref.run_dir is not None:
        rejected: list[str] = []
        records = rundir.tail_records(ref.run_dir, WINDOW, rejected)
        row["rejected_lines"], row["first_rejected"] = len(rejected), (rejected[0] if rejected else None)
        if ref.r is not None:
            row["source"] = "bus+files"
    s = rundir.summarize(records, now)
    row.update(s.to_json())

    # liveness
    if ref.r is None:
        mt = rundir.steps_mtime(ref.run_dir) if ref.run_dir else None
        row["state"] = "offline"
        row["heartbeat_age_seconds"] = None
        row["note"] = offline_note(ref)
        if mt is not None and now - mt < 60:
            row["state"] = "offline-writing"  # steps.jsonl moving, but no bus: a trainer without telemetry
    elif hb is None:
        row["state"] = "stopped" if records else "no-data"
        row["heartbeat_age_seconds"] = None
        row["last_step_age_seconds"] = max(0.0, now - s.last_time) if s.last_time else None
    else:
        # anyone with bus access can write the heartbeat: a time of 1e999 or 400 digits is no time
        sent = finite_or_none(hb.get("sent")) or finite_or_none(hb.get("time"))
        age = (now - sent) if sent is not None else None
        step_time = finite_or_none(hb.get("time"))
        # "sent" is the bus thread's heartbeat (the process lives); "time" is the last step it published
        step_age = max(0.0, now - step_time) if step_time is not None and step_time > 0 else None
        row["heartbeat_age_seconds"] = age
        row["last_step_age_seconds"] = step_age
        row["hung_after_seconds"] = hung_after_seconds(records)
        if age is None or age > HEARTBEAT_STALE_S:  # no readable time (a hostile or broken key) proves no life
            row["state"] = "stale"
        elif hb.get("paused") is True:
            row["state"] = "paused"
        elif step_age is not None and step_age > row["hung_after_seconds"]:
            row["state"] = "hung"
        else:
            row["state"] = "live"
        hb_step = hb.get("step")
        if type(hb_step) is int and 0 <= hb_step <= MAX_SAMPLE_ID and (row.get("step") is None or hb_step > row["step"]):
            row["step"] = hb["step"]

    end = records[-1] if records and getattr(records[-1], "marker", None) == "run_end" else None
    if end is not None and row["state"] in ("offline", "offline-writing", "stopped", "stale", "hung", "no-data"):
        # the trainer said it ended on purpose, and nothing trained since: not hung, not a crash
        row["state"] = "finished" if end.detail == "completed" else "stopped"
        row["ended"] = {"step": end.step, "detail": end.detail, "time": end.time}
    if row["state"] in ("offline", "offline-writing", "stopped") and ref.run_dir is not None:
        planned = rundir.planned_steps(ref.run_dir)
        row["max_steps"] = planned
        if planned is not None and row.get("step") is not None and row["step"] >= planned:
            row["state"] = "finished"

    # checkpoints: the newest one's age
    newest = None
    if ref.r is not None:
        raw = read_or_reject(ref.r, "checkpoints", lambda: ref.r.hgetall(ref.keys.checkpoints), bad_entries, {})
        for field, v in raw.items():
            try:
                ci = CheckpointInfo.from_json(v)
            except SchemaError:
                bad_entries.append(bus_entry("checkpoints", field))
                continue
            if newest is None or ci.created > newest:
                newest = ci.created
    if newest is None and ref.run_dir is not None:
        cks = rundir.checkpoint_steps(ref.run_dir)
        for _, p in cks[:1]:
            ck = rundir.load_checkpoint(_, p, rehash=False)
            newest = ck.created
    if newest is not None:
        row["checkpoint_age_seconds"] = max(0.0, now - newest)
    # a stopped run's checkpoint is not getting older in a way anyone needs to act on
    row["checkpoint_stale"] = bool(row.get("checkpoint_age_seconds") is not None and row["checkpoint_age_seconds"] > CKPT_OLD_S
                                   and row["state"] in ("live", "stale", "offline-writing"))

    # incidents
    open_ids: list[str] = []
    if ref.r is not None:
        inc_raw = read_or_reject(ref.r, "incidents", lambda: ref.r.hgetall(ref.keys.incidents), bad_entries, {})
        for field, v in inc_raw.items():
            try:
                inc = Incident.from_json(v)
            except SchemaError:
                bad_entries.append(bus_entry("incidents", field))
                continue
            if inc.closed_at is None:
                open_ids.append(inc.id)
                if inc.rule == "heartbeat_stale" and row["state"] in ("live", "stopped"):
                    # the sentinel opened a hang incident: trust it over our own bound, and over a missing
                    # heartbeat (a frozen rank 0 stops heartbeating too; it is not a clean stop)
                    row["state"] = "hung"
        row["incidents_total"] = len(inc_raw)
    elif ref.run_dir is not None:  # no bus: the daemon's mirror of its incidents in the run dir
        mirrored = rundir.read_incidents_log(ref.run_dir)
        open_ids = [i.id for i in mirrored if i.closed_at is None]
        row["incidents_total"] = len(mirrored)
    row["open_incidents"] = len(open_ids)
    row["open_incident_ids"] = sorted(open_ids)

    # last action: the newest ack on the bus, else the trainer's directive log
    last = None
    if ref.r is not None:
        with bus.bus_errors(ref.r):
            acks = read_or_reject(ref.r, "acks", lambda: ref.r.xrevrange(ref.keys.acks, count=1), bad_entries, [])
        for _, fields in acks:
            try:
                a = Ack.from_json(fields.get("json", "{}"))
                last = {"kind": a.kind, "status": a.status, "step": a.step, "time": a.time, "detail": a.detail}
            except SchemaError:
                pass
    if last is None and ref.run_dir is not None:
        log = rundir.read_directives_log(ref.run_dir, tail=1)
        if log:
            d = log[-1]
            last = {k: d.get(k) for k in ("kind", "status", "step", "time", "issuer")}
    if ref.run_dir is not None:
        pending = rundir.pending_rollback_for_view(ref.run_dir)
        if pending:
            row["pending_rollback"] = pending
    row["last_action"] = last
    if ref.r is not None:  # the sentinel that leads (acts for) the run, and until when its lease runs
        from sentinel.daemon_lease import read_holder

        h = read_holder(ref.r, ref.keys.leader, now)
        row["leader"] = None if h is None else {"consumer": h.consumer, "host": h.host, "pid": h.pid, "until": h.until}
    count_bus_entries(row, bad_entries)
    loss, med = row.get("loss"), row.get("loss_median")
    row["loss_out_of_band"] = bool(loss is not None and med and (loss != loss or loss > LOSS_BAND * med))
    return row


def _fmt_num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _fmt_rate(x) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def state_text(r: dict) -> str:
    """The state cell: never a bare "live" for a run whose steps stopped; always the age that matters."""
    from sentinel.runref import fmt_duration

    st, step_age = r["state"], r.get("last_step_age_seconds")
    if st == "live":
        return f"live (step {fmt_duration(step_age)} ago)" if step_age is not None else "live"
    if st == "hung":
        return f"HUNG: no step {fmt_duration(step_age)}"
    if st == "stale":
        age = r.get("heartbeat_age_seconds")
        return f"stale: no hb {fmt_duration(age)}" if age is not None else "stale: heartbeat unreadable"
    if st == "paused":
        return f"paused (step {fmt_duration(step_age)} ago)" if step_age is not None else "paused"
    if st == "stopped" and step_age is not None:
        return f"stopped (step {fmt_duration(step_age)} ago)"
    if st == "finished":
        n = r.get("max_steps") or r.get("step")  # planned steps, else the run_end marker's last step
        return f"finished ({n} steps)" if n is not None else "finished"
    return st


def render(rows: list[dict], errors: list[str], now: float | None = None):
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from sentinel.runref import ago, fmt_duration

    now = time.time() if now is None else now
    t = Table(title=f"sentinel status  ({time.strftime('%H:%M:%S UTC', time.gmtime(now))})", title_justify="left")
    for col, just in (("run", "left"), ("state", "left"), ("step", "right"), ("loss", "right"), ("val PPL", "right"),
                      ("grad norm", "right"), ("tokens/s", "right"), ("MFU", "right"), ("ckpt age", "right"),
                      ("incidents", "right"), ("guard skips", "right"), ("last action", "left")):
        t.add_column(col, justify=just, no_wrap=col != "last action")
    cards: list = []
    state_style = {"live": "green", "stale": "bold red", "hung": "bold red", "paused": "yellow", "stopped": "dim", "offline": "dim",
                   "offline-writing": "yellow", "no-data": "dim", "finished": "green"}
    for r in rows:
        st_txt = state_text(r)
        loss = _fmt_num(r.get("loss"), ".4f")
        if r.get("loss_out_of_band"):
            loss = f"[bold red]{loss}[/] [red](med {r['loss_median']:.3f})[/]"
        ck = fmt_duration(r.get("checkpoint_age_seconds"))
        if r.get("checkpoint_stale"):
            ck = f"[bold red]{ck}[/]"
        n_open, total = r.get("open_incidents", 0), r.get("incidents_total")
        inc = f"[bold red]{n_open} open[/]" if n_open else "[green]0 open[/]"
        if total:
            inc += f" / {total}"
        skips = r.get("guard_skips", 0)
        skips_txt = (f"[yellow]{skips}[/]" if skips else "0") + (f" [dim]of last {r['window']}[/]" if r.get("window") else "")
        la = r.get("last_action")
        la_txt = "-"
        if la:
            color = {"applied": "green", "rejected": "red", "failed": "red"}.get(str(la.get("status")), "")
            la_txt = f"{la.get('kind')} [{color}]{la.get('status')}[/]" if color else escape(f"{la.get('kind')} {la.get('status')}")
            if la.get("step") is not None:
                la_txt += f" @ {la['step']}"
            la_txt += f", {ago(la.get('time'), now)} ago"
        if r.get("pending_rollback"):
            la_txt += f" [yellow](pending rollback to {r['pending_rollback'].get('to_step')})[/]"
        ev = r.get("last_timeline_event")
        if ev and ev.get("kind") in ("rollback", "resume"):  # the restore behind the directives that followed it
            la_txt += f"; [yellow]{escape(str(ev['kind']))} to step {ev.get('from_step')}[/], {ago(ev.get('time'), now)} ago"
        mfu = r.get("mfu")
        cells = (Text(r["run"]), Text(st_txt, style=state_style.get(r["state"], "")), _fmt_num(r.get("step"), "d"), loss,
                 _fmt_num(r.get("val_ppl"), ".2f"), _fmt_num(r.get("grad_norm"), ".3f"),
                 _fmt_rate(r.get("tokens_per_second")), "-" if mfu is None else f"{mfu * 100:.1f}%", ck, inc, skips_txt,
                 la_txt)
        t.add_row(*cells)
        cards.append(_card(cells))
    parts = [_Responsive(t, Group(Text(t.title, style="italic"), *[x for c in cards for x in (c, Text(""))][:-1]))]
    if not rows and not errors:
        parts.append(Text("no runs registered on the bus", style="dim"))
    notes = [f"{r['run']}: {r['note']}" for r in rows if r.get("note")]
    for r in rows:
        if "leader" in r:
            ld = r["leader"]
            parts.append(Text(f"{r['run']}: " + (
                f"sentinel leader {ld['consumer']}" + (f" on {ld['host']}" if ld.get("host") else "")
                + f", lease until {time.strftime('%H:%M:%S UTC', time.gmtime(ld['until']))}" if ld
                else "no sentinel leads this run: nobody watches it"), style="dim" if ld else "yellow"))
    for n in notes:
        parts.append(Text(f"note: {n}", style="dim"))
    for e in errors:
        parts.append(Text(f"error: {e}", style="red"))
    return Group(*parts)


WIDE_STATUS = 132  # below this many columns one table row per run cannot fit: one card per run instead
_CARD_KEYS = ("step", "loss", "val PPL", "grad norm", "tokens/s", "MFU", "ckpt age", "incidents", "guard skips")


def _card(cells):
    """One run as a two-pair key/value grid: every field readable at 80 columns, nothing cut."""
    from rich.table import Table
    from rich.text import Text

    run, state, *vals = cells
    last_action = vals.pop()
    g = Table.grid(padding=(0, 2))
    for _ in range(2):
        g.add_column(style="dim", no_wrap=True)
        g.add_column(no_wrap=True)
    pairs = list(zip(_CARD_KEYS, vals))
    for i in range(0, len(pairs), 2):
        row = [x for k, v in pairs[i:i + 2] for x in (k, v)]
        g.add_row(*row, *([""] * (4 - len(row))))
    out = Table.grid()
    out.add_column(overflow="fold")
    out.add_row(Text.assemble((run.plain, "bold"), "  ", state))
    out.add_row(g)
    out.add_row(Text.from_markup(f"[dim]last action[/]  {last_action}"))
    return out


class _Responsive:
    """The wide table when the terminal has room, else the cards (re-decided at every refresh)."""

    def __init__(self, wide, narrow):
        self.wide, self.narrow = wide, narrow

    def __rich_console__(self, console, options):
        yield self.wide if options.max_width >= WIDE_STATUS else self.narrow


def collect(runs, redis_url) -> tuple[list[dict], list[str]]:
    from sentinel.runref import resolve_many

    refs = resolve_many(runs, redis_url, view=True)
    rows, errors = [], []
    now = time.time()
    for ref in refs:
        rows.append(run_status(ref, now))
    return rows, errors


@click.command("status")
@click.argument("runs", nargs=-1, metavar="[RUN]...", callback=not_empty)
@click.option("--watch", is_flag=True, help="Refresh live until Ctrl-C.")
@click.option("--interval", type=FiniteFloat(0.2, 3600), default=2.0, show_default=True, help="Seconds between refreshes with --watch.")
@click.option("--exit-status", is_flag=True,
              help="Exit 1 when a run is HUNG, stale or paused (with --watch: as soon as one is), for scripts and probes.")
@redis_url_option
@json_option
@friendly_errors
def status(runs, watch, interval, redis_url, as_json, exit_status):
    """One row per run: step, loss, val PPL, grad norm, tokens/s, MFU, checkpoint age, open incidents,
    guard skips, last action. Out-of-band values are red: loss >20% above its recent median, the
    newest checkpoint older than 2 h, a stale heartbeat, a hung run (heartbeat, but no new step
    for max(30 s, 10 steps), or an open hang incident), open incidents. The state says how old the
    last step is: live, HUNG, paused, stale or stopped; with no bus, offline (from steps.jsonl) or
    offline-writing (steps.jsonl changed in the last minute: a trainer without telemetry); no-data;
    finished (stopped or offline at its configured max_steps). Incidents: open / all; guard skips:
    of the last steps read (the window); last action: the newest directive, then the newest
    rollback or resume.

    RUN is a run directory (works offline, from steps.jsonl) or a run id on the bus; without RUN,
    every run registered on the bus (--redis-url / SENTINEL_REDIS_URL). A run directory whose own
    embedded bus is down gets a note saying so, unless the run has stopped: no process on this
    machine holds RUN_DIR/trainer.lock and steps.jsonl has not changed for a minute (the same rule
    in incidents, pages and checkpoints). An explicit bus that is down is always said.

    --exit-status makes it a probe: exit 1 when a run is HUNG, stale or paused.
    """
    from sentinel.runref import ops_errors

    ops_errors(_status)(runs, watch, interval, redis_url, as_json, exit_status)


NEEDS_ATTENTION = ("hung", "stale", "paused")  # the states --exit-status exits 1 for


def needs_attention(rows: list[dict]) -> list[str]:
    """``run (state)`` of each run that is HUNG, stale or paused."""
    return [f"{r['run']} ({r['state']})" for r in rows if r.get("state") in NEEDS_ATTENTION]


def _attention_exit(rows: list[dict], exit_status: bool) -> None:
    bad = needs_attention(rows) if exit_status else []
    if bad:
        click.echo(f"needs attention: {', '.join(bad)}", err=True)
        raise click.exceptions.Exit(1)


def _status(runs, watch, interval, redis_url, as_json, exit_status=False):
    rows, errors = collect(runs, redis_url)
    if not watch:
        if as_json:
            emit_json({"runs": rows, "time": time.time()})
        else:
            warn_rejected(rows)
            console_for_output().print(render(rows, errors))
        _attention_exit(rows, exit_status)
        return
    try:
        if as_json:  # one compact JSON document per refresh (NDJSON)
            while True:
                click.echo(json.dumps({"runs": rows, "time": time.time()}, default=str, sort_keys=True))
                _attention_exit(rows, exit_status)
                time.sleep(interval)
                rows, errors = collect(runs, redis_url)
        from rich.live import Live

        console = console_for_output()
        with Live(render(rows, errors), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                if exit_status and needs_attention(rows):
                    break
                time.sleep(interval)
                try:
                    rows, errors = collect(runs, redis_url)
                    live.update(render(rows, errors))
                except Exception as e:  # keep watching through a bus blip
                    from sentinel.bus import BusError

                    if not isinstance(e, BusError):
                        raise
                    live.update(render(rows, [f"{e} (showing the last good data)"]))
        _attention_exit(rows, exit_status)
    except KeyboardInterrupt:
        return
