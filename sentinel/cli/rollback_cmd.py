"""``sentinel rollback``: roll a run back to a checkpoint and skip the data that hurt it.

Live (the trainer heartbeats on the bus): a signed ``rollback`` Directive goes on the directives
stream and we wait for the trainer's Ack (it reloads the checkpoint in-process, grows its skip list
and writes a ``rollback`` TimelineRecord). No trainer attached: the run directory is prepared so that
the next start resumes from the chosen checkpoint with the skips in force (``pending_rollback.json``,
written atomically, plus a grown ``skiplist.json``).

Either way it is audited: who, when and why, as a ``manual_rollback`` Event and an incident record
on the bus (when there is one) and a line in ``RUN_DIR/audit.jsonl`` (when the run dir is here).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import click

from sentinel.cli.common import (
    FiniteFloat,
    OneLineText,
    SentinelError,
    emit_json,
    friendly_errors,
    json_option,
    no_ack_error,
    not_empty,
    redis_url_option,
    secret_file_option,
    send_and_wait,
)

DEFAULT_TIMEOUT = 120.0
WRITING_RECENTLY_S = 60.0


def _parse_checkpoint_id(text: str) -> int:
    import re

    from sentinel.rundir import MANIFEST

    t = text.strip().rstrip("/")
    m = re.fullmatch(r"(?:.*/)?step-0*(\d{1,18})", t) or re.fullmatch(r"0*(\d{1,18})", t)  # int() refuses 4300+ digits
    if m:
        return int(m.group(1))
    p = Path(t)
    try:
        is_checkpoint_dir = (p / MANIFEST).is_file()
    except OSError:  # a name too long for the file system, ...: not a checkpoint directory
        is_checkpoint_dir = False
    if is_checkpoint_dir:
        import json

        try:
            return int(json.loads((p / MANIFEST).read_text())["step"])
        except (ValueError, KeyError, TypeError):
            pass
    shown = text if len(text) <= 60 else text[:60] + "..."
    raise SentinelError(f"bad checkpoint id {shown!r}: use step-NNNNNNNN, a step number, or a checkpoint directory")


def _current(ref) -> tuple[int | None, int | None]:
    """(current step, current timeline) of the run: heartbeat > step stream > steps.jsonl."""
    from sentinel import bus, rundir
    from sentinel.protocol import SchemaError, TimelineRecord

    step = timeline = None
    hb = ref.heartbeat() if ref.r is not None else None
    if hb and isinstance(hb.get("step"), int):
        step = hb["step"]
    recs = []
    if ref.r is not None:
        with bus.bus_errors(ref.r):
            items = ref.r.xrevrange(ref.keys.steps, count=50)
        for eid, fields in reversed(items):
            try:
                recs.append(bus.decode((eid, fields)))
            except SchemaError:
                continue
    if not recs and ref.run_dir is not None:
        recs = rundir.tail_records(ref.run_dir, 50)
    if recs:
        last = recs[-1]
        timeline = last.timeline
        s = last.from_step if isinstance(last, TimelineRecord) else last.step  # a step or a marker
        step = max(step, s) if step is not None else s
    return step, timeline


def _candidates(ref):
    """Checkpoint candidates (newest first) as dicts: step, name, status, problem, created, timeline."""
    from sentinel import rundir
    from sentinel.cli.checkpoints_cmd import checkpoint_rows

    if ref.run_dir is not None:
        return [c.to_json() for c in rundir.list_checkpoints(ref.run_dir, rehash=False)]
    rows, _ = checkpoint_rows(ref)
    return rows


def last_clean_checkpoint_step(onset: int) -> int:
    """The newest checkpoint step that can hold no damage from an anomaly first seen at ``onset``
    (``onset - 2``: the rule and its reasons are ``sentinel.contract.targets``)."""
    from sentinel.contract.targets import clean_bound

    return clean_bound(onset)


ONSET_PAST_LOG_MAX = 10_000


def _pick(ref, to_step, before_step, checkpoint, current):
    from sentinel import rundir

    cands = _candidates(ref)
    have = sorted(c["step"] for c in cands)
    listing = ", ".join(map(str, have[-8:])) or "none"
    if checkpoint is not None:
        to_step = _parse_checkpoint_id(checkpoint)
    if to_step is not None:
        match = next((c for c in cands if c["step"] == to_step), None)
        if match is None:
            raise SentinelError(f"no checkpoint at step {to_step} for run {ref.run} (checkpoints: {listing})")
        if current is not None and to_step > current:
            raise SentinelError(f"checkpoint step {to_step} is ahead of the run (step {current}); "
                                "it belongs to an abandoned timeline")
    else:
        # an onset far past the log is a typo (a few steps past it: a log that lags the trainer's own output)
        if current is not None and before_step > current + ONSET_PAST_LOG_MAX:
            raise SentinelError(f"--before-step {before_step} is past the run's last step ({current}): "
                                "name the step where the damage began")
        from sentinel.contract.targets import rollback_target

        bound = last_clean_checkpoint_step(before_step)
        ok = {c["step"]: c for c in cands if c["verified"] in ("checksum_ok", "unverified", "resume_verified")
              and (current is None or c["step"] <= current)}
        match = None
        while match is None and (target := rollback_target(ok, before_step)) is not None:
            c = ok.pop(target)
            if ref.run_dir is None:
                match = c
            else:  # re-hash the target; one that fails passes the choice to the next
                ck = rundir.find_checkpoint(ref.run_dir, target, rehash=True)
                if ck is not None and ck.status in ("checksum_ok", "resume_verified"):
                    match = ck.to_json()
        if match is None:
            raise SentinelError(f"no usable checkpoint at or before step {bound} (onset {before_step} - 2) for run "
                                f"{ref.run} (checkpoints: {listing})")
    if ref.run_dir is not None:
        ck = rundir.find_checkpoint(ref.run_dir, match["step"], rehash=True)
        if ck is None:
            raise SentinelError(f"checkpoint {rundir.step_dir_name(match['step'])} disappeared (retention?); pick another")
        match = ck.to_json()
        if ck.checksum in ("corrupt", "incomplete"):
            raise SentinelError(f"checkpoint {ck.name} is {ck.checksum}: {ck.problem}; pick another "
                                f"(sentinel checkpoints {ref.run_dir})")
    return match


def build_plan(ref, *, to_step, before_step, checkpoint, skips, reason) -> dict:
    from sentinel import rundir
    from sentinel.protocol import StepRecord

    live = ref.r is not None and ref.trainer_attached()
    current, timeline = _current(ref)
    target = _pick(ref, to_step, before_step, checkpoint, current)
    existing = rundir.read_skiplist(ref.run_dir) if ref.run_dir else []
    new_ranges = rundir.subtract_ranges(skips, existing)
    seen = None
    if ref.run_dir is not None and skips and current is not None:
        n = min(max(current - target["step"], 0), 200_000) + 200
        steps = [r for r in rundir.effective_steps(rundir.tail_records(ref.run_dir, n)) if r.step > target["step"]]
        if steps:
            from bisect import bisect_right

            los = [lo for lo, _ in skips]
            seen = 0
            for r in steps:
                if not isinstance(r, StepRecord):
                    continue
                for sid in r.sample_ids:
                    j = bisect_right(los, sid) - 1
                    if j >= 0 and sid < skips[j][1]:
                        seen += 1
    try:
        pending = rundir.read_pending_rollback(ref.run_dir) if ref.run_dir else None
    except rundir.RunDirError as e:  # a new plan replaces a broken one: say so, never refuse to write it
        pending = {"to_step": "?", "unreadable": str(e)}
    writing = False
    if not live and ref.run_dir is not None:
        mt = rundir.steps_mtime(ref.run_dir)
        writing = mt is not None and time.time() - mt < WRITING_RECENTLY_S
    return {
        "run": ref.run, "run_dir": str(ref.run_dir) if ref.run_dir else None, "mode": "live" if live else "offline",
        "bus": ref.describe_bus(), "current_step": current, "current_timeline": timeline,
        "target": {"step": target["step"], "name": target.get("name"), "verified": target["verified"],
                   "created": target.get("created"), "timeline": target.get("timeline"), "problem": target.get("problem")},
        "steps_lost": (current - target["step"]) if current is not None else None,
        "skip_ranges": [list(r) for r in skips], "skip_samples": rundir.count(skips),
        "skip_samples_new": rundir.count(new_ranges), "skip_samples_seen_in_lost_steps": seen,
        "reason": reason, "replaces_pending_rollback": pending, "trainer_may_be_running_without_bus": writing,
    }


def _print_plan(console, plan: dict) -> None:
    from sentinel import rundir
    from sentinel.runref import ago

    t = plan["target"]
    vstyle = {"resume_verified": "bold green", "checksum_ok": "yellow", "failed": "bold red"}.get(t["verified"], "yellow")
    vnote = {"resume_verified": "resume verified bitwise",
             "checksum_ok": "checksums match; resume not verified (sentinel verify-resume)",
             "failed": "verify-resume FAILED for this checkpoint: the resume may not be exact",
             "unverified": "not re-hashed (run dir not on this machine)"}.get(t["verified"], t["verified"])
    mode = ("[green]live[/]: a signed directive to the running trainer" if plan["mode"] == "live" else
            "[yellow]offline[/]: no trainer attached; prepares the run dir for its next start")
    lines = [
        f"[bold]Rollback plan for {plan['run']}[/]  ({mode})",
        f"  target      {t['name'] or t['step']}  (step {t['step']}, created {ago(t.get('created'))} ago)",
        f"  verified    [{vstyle}]{t['verified']}[/]  {vnote}",
        f"  now at      step {plan['current_step'] if plan['current_step'] is not None else '?'}"
        + (f", timeline {plan['current_timeline']}" if plan["current_timeline"] is not None else ""),
        f"  steps lost  [bold]{plan['steps_lost'] if plan['steps_lost'] is not None else '?'}[/]",
    ]
    if plan["skip_ranges"]:
        extra = f", {plan['skip_samples_new']} new to the skip list"
        if plan["skip_samples_seen_in_lost_steps"] is not None:
            extra += f", {plan['skip_samples_seen_in_lost_steps']} trained in the lost steps"
        lines.append(f"  skip        {plan['skip_samples']} samples ({rundir.fmt_ranges([tuple(r) for r in plan['skip_ranges']])}){extra}")
    else:
        lines.append("  skip        nothing (the same data will be replayed)")
    if plan["reason"]:
        lines.append(f"  reason      {plan['reason']}")
    if plan["replaces_pending_rollback"]:
        lines.append(f"  [yellow]replaces the pending rollback to step {plan['replaces_pending_rollback'].get('to_step')}[/]")
    if plan["trainer_may_be_running_without_bus"]:
        lines.append("  [yellow]steps.jsonl changed in the last minute: a trainer may be running without a bus; "
                     "the rollback applies at its next start[/]")
    for ln in lines:
        console.print(ln, highlight=False)


@click.command("rollback")
@click.argument("run", metavar="RUN", callback=not_empty)
@click.option("--to-step", type=click.IntRange(min=0), help="Roll back to the checkpoint at exactly this step.")
@click.option("--before-step", type=click.IntRange(min=2), metavar="ONSET",
              help="ONSET is the first bad step (an incident's onset): roll back to the newest good checkpoint at "
                   "step <= ONSET-2. Checkpoint N holds the weights after N updates, and step ONSET's loss was "
                   "computed on checkpoint ONSET-1's weights: a bad batch damages update ONSET, a bad update "
                   "(LR spike) at ONSET-1 shows only in step ONSET, so neither ONSET nor ONSET-1 is safe.")
@click.option("--checkpoint", "checkpoint", metavar="ID", help="Roll back to this checkpoint (step-NNNNNNNN, a step, or its directory).")
@click.option("--skip", "skips", multiple=True, metavar="LO:HI", help="Also skip sample ids [LO, HI) from now on (repeatable).")
@click.option("--dry-run", is_flag=True, help="Show the plan and change nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--reason", type=OneLineText(), help="Why (goes into the directive, the incident log and the audit log).")
@click.option("--timeout", type=FiniteFloat(1, 86_000), default=DEFAULT_TIMEOUT, show_default=True,
              help="Seconds to wait for a live trainer's ack.")
@secret_file_option
@redis_url_option
@json_option
@friendly_errors
def rollback(run, to_step, before_step, checkpoint, skips, dry_run, yes, reason, timeout, secret_file, redis_url, as_json):
    """Roll RUN back to a checkpoint and skip the data that hurt it.

    Shows the plan (target checkpoint and whether it is verified, steps lost, samples to skip) and
    asks before acting. Live runs get a signed directive and we wait for the trainer's ack; a run
    with no trainer attached is prepared to resume from that checkpoint at its next start.
    """
    from sentinel.runref import ops_errors

    ops_errors(_rollback)(run, to_step, before_step, checkpoint, skips, dry_run, yes, reason, timeout, secret_file,
                          redis_url, as_json)


def _rollback(run, to_step, before_step, checkpoint, skips, dry_run, yes, reason, timeout, secret_file, redis_url, as_json):
    from sentinel import rundir
    from sentinel.cli.status_cmd import console_for_output
    from sentinel.protocol import merge_ranges
    from sentinel.runref import resolve

    chosen = [x for x in (to_step, before_step, checkpoint) if x is not None]
    if len(chosen) != 1:
        raise SentinelError("give exactly one of --to-step N, --before-step N, --checkpoint ID")
    try:
        ranges = merge_ranges(rundir.parse_range(s) for s in skips)
    except ValueError as e:
        raise SentinelError(str(e)) from None
    ref = resolve(run, redis_url)
    plan = build_plan(ref, to_step=to_step, before_step=before_step, checkpoint=checkpoint, skips=ranges, reason=reason)
    console = console_for_output(stderr=as_json)
    if plan["mode"] == "offline" and ref.run_dir is None:
        raise SentinelError(f"run {ref.run} has no trainer attached and its run directory is not on this machine; "
                            "run `sentinel rollback RUN_DIR ...` on the host that has it")
    if not as_json or not yes or dry_run:
        _print_plan(console, plan)
    if dry_run:
        if as_json:
            emit_json({"plan": plan, "dry_run": True})
        else:
            console.print("[dim]dry run: nothing changed[/]")
        return
    if plan["mode"] == "live":  # fail before asking: no secret, no rollback
        secret = ref.secret(secret_file)
    if not yes:
        try:
            ok = click.confirm(f"Roll back {ref.run} to step {plan['target']['step']}?", default=False, err=True)
        except click.Abort:
            click.echo("", err=True)
            ok = False
        if not ok:
            raise SentinelError("not confirmed: nothing changed (pass --yes to skip the question)", exit_code=1)
    if plan["mode"] == "live":
        return _live(ref, plan, ranges, reason, timeout, secret, console, as_json)
    return _offline(ref, plan, ranges, reason, console, as_json)


def _incident(ref, plan, directive_id, who, reason, now):
    from sentinel.protocol import Incident

    iid = f"{ref.run}-manual-{time.strftime('%Y%m%dT%H%M%S', time.gmtime(now))}-{directive_id[:4]}"
    cur = plan["current_step"] or 0
    return Incident(
        id=iid, run=ref.run, state="rollback", rule="manual", onset_step=cur, detect_step=cur, opened_at=now,
        evidence=[{"step": cur, "detail": f"manual rollback by {who}" + (f": {reason}" if reason else ""),
                   "issuer": who, "rule": "manual"}],
        actions=[{"kind": "rollback", "run": ref.run, "incident_id": iid, "to_step": plan["target"]["step"],
                  "ranges": plan["skip_ranges"], "reason": reason, "issuer": who, "directive_id": directive_id,
                  "mode": plan["mode"], "time": now}],
        rollback_to=plan["target"]["step"], skip_ranges=[tuple(r) for r in plan["skip_ranges"]],
    )


def _record(ref, inc, event_kwargs) -> None:
    from sentinel import bus
    from sentinel.protocol import Event
    from sentinel.runref import publish_event

    if ref.r is None:
        return
    with bus.bus_errors(ref.r):
        ref.r.hset(ref.keys.incidents, inc.id, inc.to_json())
    publish_event(ref, Event(run=ref.run, incident_id=inc.id, **event_kwargs))


def _audit(ref, record) -> None:
    from sentinel import rundir

    if ref.run_dir is not None:
        rundir.append_audit(ref.run_dir, record)


def _live(ref, plan, ranges, reason, timeout, secret, console, as_json):
    from sentinel.protocol import Directive
    from sentinel.runref import issuer

    who = issuer()
    now = time.time()
    to = plan["target"]["step"]
    d = Directive(run=ref.run, kind="rollback", to_step=to, ranges=ranges, reason=reason or f"manual rollback by {who}",
                  issuer=who, issued_at=now, expires_at=now + timeout + 5)
    inc = _incident(ref, plan, d.id, who, reason, now)
    d = d.model_copy(update={"incident_id": inc.id}).signed(secret)
    base = {"action": "rollback", "who": who, "run": ref.run, "to_step": to, "ranges": plan["skip_ranges"],
            "reason": reason, "directive_id": d.id, "incident_id": inc.id, "mode": "live",
            "from_step": plan["current_step"], "checkpoint_verified": plan["target"]["verified"]}
    _audit(ref, {**base, "phase": "issued"})
    _record(ref, inc, dict(kind="manual_rollback", severity="warning", step=plan["current_step"],
                           message=f"{who} rolled back to step {to}" + (f": {reason}" if reason else ""),
                           data={"phase": "issued", "directive_id": d.id, "to_step": to, "ranges": plan["skip_ranges"],
                                 "issuer": who, "reason": reason, "mode": "live"}))
    ack = send_and_wait(ref, d, timeout, console=console, as_json=as_json, doing=f"rolling back to step {to}", secret=secret)
    outcome = ack.status if ack else "timeout"
    done = time.time()
    inc.actions[0]["outcome"] = outcome
    inc.actions[0]["detail"] = ack.detail if ack else f"no ack within {timeout:.0f}s"
    if ack is not None and ack.status in ("applied", "duplicate"):
        inc.closed_at = done
        inc.actions[0].update({"resumed_step": ack.step, "timeline": ack.timeline})
    _record(ref, inc, dict(kind="manual_rollback", severity="info" if inc.closed_at else "critical",
                           step=ack.step if ack else plan["current_step"],
                           message=(f"manual rollback {outcome}: " + (ack.detail or "") if ack else
                                    f"manual rollback: no ack from the trainer within {timeout:.0f}s"),
                           data={"phase": outcome, "directive_id": d.id, "issuer": who}))
    _audit(ref, {**base, "phase": "outcome", "outcome": outcome, "detail": ack.detail if ack else None,
                 "resumed_step": ack.step if ack else None, "timeline": ack.timeline if ack else None})
    res = {"plan": plan, "status": outcome, "directive_id": d.id, "incident_id": inc.id,
           "resumed_step": ack.step if ack else None, "timeline": ack.timeline if ack else None,
           "detail": ack.detail if ack else None}
    if as_json:
        emit_json(res)
    if ack is None:
        raise no_ack_error(ref, d, timeout)
    if ack.status not in ("applied", "duplicate"):
        raise SentinelError(f"the trainer {ack.status} the rollback: {ack.detail or 'no detail'}", exit_code=1)
    if not as_json:
        console.print(f"[bold green]rolled back[/]: {ref.run} resumed at step {ack.step}, timeline {ack.timeline}"
                      + (f", skipping {plan['skip_samples']} samples" if plan["skip_samples"] else "")
                      + f"  (incident {inc.id})", highlight=False)


def _offline(ref, plan, ranges, reason, console, as_json):
    from sentinel import rundir
    from sentinel.runref import issuer

    who = issuer()
    now = time.time()
    to = plan["target"]["step"]
    did = uuid.uuid4().hex
    inc = _incident(ref, plan, did, who, reason, now)
    base = {"action": "rollback", "who": who, "run": ref.run, "to_step": to, "ranges": plan["skip_ranges"],
            "reason": reason, "directive_id": did, "incident_id": inc.id, "mode": "offline",
            "from_step": plan["current_step"], "checkpoint_verified": plan["target"]["verified"]}
    # skip list first: if we die in between, the data is skipped and no rollback is pending (safe)
    skl, new = rundir.grow_skiplist(ref.run_dir, ranges) if ranges else (rundir.read_skiplist(ref.run_dir), 0)
    path = rundir.write_pending_rollback(ref.run_dir, to_step=to, ranges=ranges,
                                         reason=reason or f"manual rollback by {who}", id=did, issuer=who,
                                         created=now, checkpoint=rundir.step_dir_name(to), incident_id=inc.id)
    _audit(ref, {**base, "phase": "prepared", "outcome": "pending", "pending_file": str(path)})
    inc.closed_at = now
    inc.actions[0].update({"outcome": "prepared", "detail": f"{path.name} written; applies at the next start"})
    if ref.r is not None:
        import json

        from sentinel import bus

        with bus.bus_errors(ref.r):
            ref.r.set(ref.keys.skiplist, json.dumps([list(r) for r in skl]))
    _record(ref, inc, dict(kind="manual_rollback", severity="warning", step=plan["current_step"],
                           message=f"{who} prepared a rollback to step {to} for the next start"
                           + (f": {reason}" if reason else ""),
                           data={"phase": "prepared", "directive_id": did, "to_step": to, "ranges": plan["skip_ranges"],
                                 "issuer": who, "reason": reason, "mode": "offline"}))
    res = {"plan": plan, "status": "prepared", "pending_rollback": str(path), "directive_id": did, "incident_id": inc.id,
           "resumed_step": None, "timeline": (plan["current_timeline"] + 1) if plan["current_timeline"] is not None else None,
           "skiplist_samples": rundir.count(skl), "skiplist_new_samples": new}
    if as_json:
        emit_json(res)
        return
    console.print(f"[bold green]prepared[/]: the next start of {ref.run} resumes from step {to}"
                  + (f" (timeline {res['timeline']})" if res["timeline"] is not None else "")
                  + (f", skipping {plan['skip_samples']} samples ({new} new)" if ranges else "")
                  + f"\n  wrote {path}; restart the trainer with the same --run-dir", highlight=False)
