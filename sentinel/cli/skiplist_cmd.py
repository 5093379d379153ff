"""``sentinel skip-list``: show or edit a run's skip list (sample-id ranges never trained on again).

* ``show`` (default): the ranges and how many samples they cover.
* ``add LO:HI ...``: live (a trainer heartbeats on the bus) -> a signed ``skip-samples`` directive,
  and wait for the trainer's ack; offline -> grow ``RUN_DIR/skiplist.json`` (read at the next start).
* ``remove LO:HI ...``: offline only. While a trainer runs the list only grows: it is held in the
  trainer's memory, written back after every change and saved into every checkpoint, so an edit to
  the file would be silently undone, and the batches the run already logged would stop matching what
  a resume replays.
"""

from __future__ import annotations

import time
import uuid

import click

from sentinel.cli.common import (
    WRONG_TYPE,
    FiniteFloat,
    OneLineText,
    SentinelError,
    emit_json,
    friendly_errors,
    json_option,
    lost_ack_error,
    not_empty,
    read_unless_wrong_type,
    redis_url_option,
    secret_file_option,
)

ACTIONS = ("show", "add", "remove")
LIMIT = 20  # groups shown by default
EXAMPLES = 3  # ranges spelled out per group


@click.command("skip-list")
@click.argument("run", metavar="RUN", callback=not_empty)
@click.argument("action", required=False, default="show", type=click.Choice(ACTIONS), metavar="[show|add|remove]")
@click.argument("ranges", nargs=-1, metavar="[LO:HI]...")
@click.option("--reason", type=OneLineText(), default=None, help="Why (recorded in the audit log and the directive).")
@click.option("--timeout", type=FiniteFloat(1, 86_000), default=60.0, show_default=True,
              help="Seconds to wait for a live trainer's ack after `add`.")
@secret_file_option
@click.option("--limit", type=click.IntRange(min=0), default=LIMIT, show_default=True,
              help="`show`: at most N groups (0: all); --json always has every range.")
@redis_url_option
@json_option
@friendly_errors
def skip_list(run, action, ranges, reason, timeout, secret_file, limit, redis_url, as_json):
    """Show or edit RUN's skip list of sample-id ranges [LO, HI).

    `show` groups the ranges by why they are there (the incident and rollback, the skip-samples
    directive, the config, the operator who added them): one row per group, with its number of
    ranges and samples, the span they fall in and the first ranges as LO:HI.

    \b
      sentinel skip-list runs/x                 # show
      sentinel skip-list runs/x add 684:685 9000:9100
      sentinel skip-list runs/x remove 9000:9100   # offline only
    """
    from sentinel.runref import ops_errors

    ops_errors(_skip_list)(run, action, ranges, reason, timeout, secret_file, redis_url, as_json, limit)


def _parse(ranges) -> list[tuple[int, int]]:
    from sentinel.protocol import merge_ranges
    from sentinel.rundir import parse_range

    out = []
    for r in ranges:
        try:
            out.append(parse_range(r))
        except ValueError as e:
            raise SentinelError(str(e)) from None
    return merge_ranges(out)


def current_ranges(ref) -> tuple[list[tuple[int, int]], str]:
    """The run's skip list: ``skiplist.json`` when the run dir is here, else the bus's copy."""
    import json

    from sentinel import rundir
    from sentinel.protocol import MAX_SAMPLE_ID, merge_ranges

    if ref.run_dir is not None:
        return rundir.read_skiplist(ref.run_dir), "file"
    raw = read_unless_wrong_type(ref.r, lambda: ref.r.get(ref.keys.skiplist))
    if raw is WRONG_TYPE:
        raise SentinelError(f"the bus's skip list for run {ref.run} is malformed: a key of the wrong Redis type")
    try:
        ranges = [(int(lo), int(hi)) for lo, hi in json.loads(raw or "[]")]
    except (ValueError, TypeError, OverflowError, RecursionError):  # OverflowError: int(1e999)
        raise SentinelError(f"the bus's skip list for run {ref.run} is malformed") from None
    if any(not 0 <= lo <= hi <= MAX_SAMPLE_ID for lo, hi in ranges):
        raise SentinelError(f"the bus's skip list for run {ref.run} is malformed: ids beyond int64")
    return merge_ranges(ranges), "bus"


def _skip_list(run, action, ranges, reason, timeout, secret_file, redis_url, as_json, limit=LIMIT):
    from sentinel.runref import resolve

    ref = resolve(run, redis_url)
    if action == "show":
        if ranges:
            raise SentinelError("`show` takes no ranges (did you mean `add`?)")
        return _show(ref, as_json, limit)
    want = _parse(ranges)
    if not want:
        raise SentinelError(f"`{action}` needs at least one range LO:HI")
    if action == "add":
        return _add(ref, want, reason, timeout, secret_file, as_json)
    return _remove(ref, want, reason, as_json)


def group_ranges(rs: list[tuple[int, int]], why: list[dict | None]) -> list[dict]:
    """The ranges grouped by incident (a rollback and the skip-samples directives of one incident are
    one group), else by origin (``rundir.skip_origins``: the config, an operator's add, an unexplained
    range), in the order of their first range: ``{"why", "incident_id", "ranges": [[lo, hi], ...], "samples"}``."""
    groups: dict[str, dict] = {}
    for (lo, hi), o in zip(rs, why):
        iid = (o or {}).get("incident_id")
        key = f"incident {iid}" if iid else _why(o)
        g = groups.setdefault(key, {"why": key, "incident_id": iid, "what": [], "ranges": [], "samples": 0})
        what = _why({**o, "incident_id": None}) if iid else None
        if what and what not in g["what"]:
            g["what"].append(what)
        g["ranges"].append([lo, hi])
        g["samples"] += hi - lo
    for g in groups.values():
        if g["what"]:
            g["why"] += ": " + "; ".join(g["what"])
        del g["what"]
    return list(groups.values())


def _show(ref, as_json, limit=LIMIT):
    from sentinel import rundir

    rs, source = current_ranges(ref)
    cfg = rundir.config_skip_ranges(ref.run_dir) if ref.run_dir else []
    pending = rundir.pending_rollback_for_view(ref.run_dir)
    origins = rundir.skip_origins(ref.run_dir) if ref.run_dir else []
    why = [rundir.origin_of(lo, hi, origins) for lo, hi in rs]
    out = {"run": ref.run, "source": source, "ranges": [list(r) for r in rs], "samples": rundir.count(rs),
           "config_ranges": [list(r) for r in cfg],
           "pending_rollback_ranges": (pending or {}).get("ranges", []) if pending else [],
           "origins": [None if o is None else {k: v for k, v in o.items() if k != "ranges"} for o in why]}
    groups = group_ranges(rs, why)
    if as_json:
        emit_json({**out, "groups": groups})
        return
    from rich.markup import escape
    from rich.table import Table

    from sentinel.cli.status_cmd import console_for_output

    t = Table(title=f"skip list of {ref.run}: {len(rs)} range(s), {rundir.count(rs):,} samples, {len(groups)} group(s) "
                    f"({source})", title_justify="left")
    t.add_column("why", overflow="fold")
    t.add_column("ranges", justify="right", no_wrap=True)
    t.add_column("samples", justify="right", no_wrap=True)
    t.add_column("within [from, to)", no_wrap=True)
    t.add_column("as LO:HI", overflow="fold")  # the form --skip / skip-list add / --inject-fault take
    shown = groups if limit == 0 else groups[:limit]
    for g in shown:
        rows = g["ranges"]
        first = " ".join(f"{lo}:{hi}" for lo, hi in rows[:EXAMPLES]) + (f" +{len(rows) - EXAMPLES} more" if len(rows) > EXAMPLES else "")
        t.add_row(escape(g["why"]), str(len(rows)), f"{g['samples']:,}", f"[{rows[0][0]}, {rows[-1][1]})", first)
    if len(shown) < len(groups):
        t.caption = f"... and {len(groups) - len(shown)} more group(s) (--limit 0 for all, --json for every range)"
    console_for_output().print(t)


def _why(o: dict | None) -> str:
    """An origin (``rundir.skip_origins``) in a few words: "rollback to 80 (incident r-t0-s101)"."""
    if o is None:
        return "-"
    what = {"rollback": f"rollback to step {o['step']}", "skip-samples": f"skip-samples, applied at step {o['step']}",
            "config": "config (--skip)", "operator": f"added by {o.get('who') or 'an operator'}"}.get(o["source"], o["source"])
    return what + (f", incident {o['incident_id']}" if o.get("incident_id") else "")


def _audit(ref, record: dict) -> None:
    from sentinel import rundir

    if ref.run_dir is not None:
        rundir.append_audit(ref.run_dir, record)


def _add(ref, want, reason, timeout, secret_file, as_json):
    from sentinel import bus, rundir
    from sentinel.protocol import Directive, Event
    from sentinel.runref import issuer, last_ack_id, publish_event, wait_ack

    who = issuer()
    n = rundir.count(want)
    if ref.r is not None and ref.trainer_attached():
        secret = ref.secret(secret_file)
        d = Directive(run=ref.run, kind="skip-samples", ranges=want, reason=reason or "manual skip", issuer=who,
                      expires_at=time.time() + timeout + 5).signed(secret)
        after = last_ack_id(ref)
        _audit(ref, {"action": "skip-samples", "phase": "issued", "who": who, "run": ref.run, "ranges": want,
                     "reason": reason, "directive_id": d.id, "mode": "live"})
        eid = bus.publish_own(ref.r, ref.keys.directives, d)
        publish_event(ref, Event(run=ref.run, kind="manual_skip", severity="warning",
                                 message=f"{who} asked to skip {n} samples ({rundir.fmt_ranges(want)})"
                                 + (f": {reason}" if reason else ""),
                                 data={"directive_id": d.id, "ranges": want, "issuer": who, "reason": reason}))
        try:
            if as_json:
                ack = wait_ack(ref, d.id, after, timeout, secret=secret, entry_id=eid)
            else:
                from sentinel.cli.status_cmd import console_for_output

                console = console_for_output(stderr=True)
                with console.status("waiting for the trainer's ack...") as st:
                    ack = wait_ack(ref, d.id, after, timeout, secret=secret, entry_id=eid,
                                   on_tick=lambda el: st.update(f"waiting for the trainer's ack... {el:.0f}s / {timeout:.0f}s"))
        except bus.BusError as e:
            raise lost_ack_error(ref, d, e) from None
        outcome = ack.status if ack else "timeout"
        _audit(ref, {"action": "skip-samples", "phase": "outcome", "who": who, "run": ref.run, "directive_id": d.id,
                     "outcome": outcome, "detail": ack.detail if ack else None})
        res = {"run": ref.run, "mode": "live", "directive_id": d.id, "added": [list(r) for r in want], "samples": n,
               "status": outcome, "detail": ack.detail if ack else None, "step": ack.step if ack else None}
        if ack is None:
            if as_json:
                emit_json(res)
            raise SentinelError(f"no ack from the trainer of {ref.run} within {timeout:.0f}s (directive {d.id[:8]} "
                                f"expires unapplied); is the trainer stuck? check `sentinel status {ref.run}`", exit_code=1)
        if ack.status not in ("applied", "duplicate"):
            if as_json:
                emit_json(res)
            raise SentinelError(f"the trainer {ack.status} the skip directive: {ack.detail or 'no detail'}", exit_code=1)
        if as_json:
            emit_json(res)
        else:
            click.echo(f"skip list of {ref.run}: +{n} samples ({rundir.fmt_ranges(want)}) applied at step {ack.step}"
                       + (f" — {ack.detail}" if ack.detail else ""))
        return
    # offline: grow the file the trainer reads at its next start
    if ref.run_dir is None:
        raise SentinelError(f"run {ref.run} has no live trainer and its run directory is not on this machine; "
                            "run this on the host that has it (sentinel skip-list RUN_DIR add ...)")
    after_ranges, new = rundir.grow_skiplist(ref.run_dir, want)
    rundir.change_skip_removals(ref.run_dir, drop=want)  # added back after a removal: it stays
    if ref.r is not None:
        import json

        with bus.bus_errors(ref.r):
            ref.r.set(ref.keys.skiplist, json.dumps([list(r) for r in after_ranges]))
        publish_event(ref, Event(run=ref.run, kind="manual_skip", severity="warning",
                                 message=f"{who} added {new} samples to the skip list offline ({rundir.fmt_ranges(want)})",
                                 data={"ranges": want, "issuer": who, "reason": reason, "mode": "offline"}))
    _audit(ref, {"action": "skip-samples", "phase": "applied", "who": who, "run": ref.run, "ranges": want,
                 "reason": reason, "mode": "offline", "new_samples": new, "directive_id": uuid.uuid4().hex})
    res = {"run": ref.run, "mode": "offline", "added": [list(r) for r in want], "new_samples": new,
           "ranges": [list(r) for r in after_ranges], "samples": rundir.count(after_ranges), "status": "applied"}
    if as_json:
        emit_json(res)
    else:
        click.echo(f"skip list of {ref.run}: +{new} new samples, now {rundir.count(after_ranges):,} samples in "
                   f"{len(after_ranges)} range(s) (offline: the trainer reads it at its next start)")


def _remove(ref, want, reason, as_json):
    from sentinel import bus, rundir
    from sentinel.protocol import Event
    from sentinel.runref import issuer, publish_event

    if ref.r is not None and ref.trainer_attached():
        raise SentinelError(
            f"run {ref.run} is live: the skip list only grows while a trainer runs (the trainer holds it in memory, "
            "writes it back after every change and saves it in every checkpoint, so a removal would be undone and the "
            "logged batches would stop matching what a resume replays); stop the trainer, then remove")
    if ref.run_dir is None:
        raise SentinelError(f"the run directory of {ref.run} is not on this machine; run this where it is")
    before = rundir.read_skiplist(ref.run_dir)
    after = rundir.subtract_ranges(before, want)
    removed = rundir.count(before) - rundir.count(after)
    if removed == 0:
        raise SentinelError(f"none of {rundir.fmt_ranges(want)} is in the skip list of {ref.run}")
    rundir.write_skiplist(ref.run_dir, after)
    # a checkpoint's saved list would add them back at the resume: the trainer subtracts these at its
    # next start (and forgets them once it saved a checkpoint without them)
    rundir.change_skip_removals(ref.run_dir, add=rundir.intersect_ranges(before, want))
    who = issuer()
    # where the trainer would re-add them from after that start: the run's own config
    sticky = []
    cfg = rundir.intersect_ranges(rundir.config_skip_ranges(ref.run_dir), want)
    if cfg:
        sticky.append(f"config.yaml data.skip ({rundir.fmt_ranges(cfg)}): edit it, or they come back at the start after next")
    if ref.r is not None:
        import json

        with bus.bus_errors(ref.r):
            ref.r.set(ref.keys.skiplist, json.dumps([list(r) for r in after]))
        publish_event(ref, Event(run=ref.run, kind="manual_skip_removed", severity="warning",
                                 message=f"{who} removed {removed} samples from the skip list ({rundir.fmt_ranges(want)})",
                                 data={"ranges": want, "issuer": who, "reason": reason}))
    rundir.append_audit(ref.run_dir, {"action": "skip-remove", "who": who, "run": ref.run, "ranges": want,
                                      "reason": reason, "removed_samples": removed, "mode": "offline"})
    res = {"run": ref.run, "mode": "offline", "removed": [list(r) for r in want], "removed_samples": removed,
           "ranges": [list(r) for r in after], "samples": rundir.count(after), "status": "applied",
           "still_skipped_by": sticky}
    if as_json:
        emit_json(res)
        return
    click.echo(f"skip list of {ref.run}: -{removed} samples, now {rundir.count(after):,} samples in {len(after)} range(s)")
    for s in sticky:
        click.echo(f"warning: the trainer re-adds ranges from {s}", err=True)
