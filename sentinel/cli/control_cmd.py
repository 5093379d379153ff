"""``sentinel pause / resume / stop``: hold, restart or end a live run by hand.

Each sends one signed Directive over the run's control bus and waits for the trainer's Ack, like
``sentinel rollback`` (same plumbing: ``common.send_and_wait``). The trainer acts at the next step
boundary: ``pause`` stops stepping (the heartbeat goes on), ``resume`` restarts it, ``stop`` writes a
checkpoint and exits. Every use is audited (``RUN_DIR/audit.jsonl`` and a ``manual_*`` event).

``resume`` also hands an *escalated* run back to automation: the sentinel paused it and stopped
acting, so a plain resume would leave the daemon hands-off. It therefore posts the same signed
approval as ``sentinel approve`` for each escalated incident, then resumes the trainer itself (so it
works with no daemon running). A rollback waiting for approval is left waiting: resuming does not
approve it.
"""

from __future__ import annotations

import time

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
    send_and_wait,
)

DEFAULT_TIMEOUT = 60.0
DOING = {"pause": "pausing", "resume": "resuming", "stop": "stopping"}
DONE = {"pause": "paused", "resume": "resumed", "stop": "stopping (checkpoint, then exit)"}


def _options(fn):
    fn = click.option("--reason", type=OneLineText(), help="Why (goes into the signed directive, the events stream and the audit log).")(fn)
    fn = click.option("--timeout", type=FiniteFloat(1, 86_000), default=DEFAULT_TIMEOUT, show_default=True,
                      help="Seconds to wait for the trainer's ack.")(fn)
    fn = click.option("--secret-file", type=click.Path(dir_okay=False),
                      help="HMAC secret file (mode 0600); without it: env SENTINEL_SECRET, then RUN_DIR/bus/secret.")(fn)
    return fn


def _open_incidents(ref) -> list:
    from sentinel import bus
    from sentinel.protocol import Incident, SchemaError

    with bus.bus_errors(ref.r):
        raw = ref.r.hgetall(ref.keys.incidents)
    out = []
    for v in raw.values():
        try:
            inc = Incident.from_json(v)
        except SchemaError:
            continue
        if inc.closed_at is None:
            out.append(inc)
    return sorted(out, key=lambda i: i.opened_at)


def control(kind: str, run: str, reason: str | None, timeout: float, secret_file: str | None, redis_url: str | None,
            as_json: bool) -> dict:
    """Send one pause/resume/stop directive to RUN's trainer and wait for its ack; returns the result."""
    from sentinel import rundir
    from sentinel.cli.incidents_cmd import publish_approval
    from sentinel.cli.status_cmd import console_for_output
    from sentinel.protocol import Directive, Event
    from sentinel.runref import issuer, publish_event, resolve

    ref = resolve(run, redis_url, need_bus=True)
    hb = ref.heartbeat()
    if hb is None:
        raise SentinelError(f"no trainer attached to run {ref.run} (no heartbeat on {ref.describe_bus()}): "
                            f"nothing to {kind}", exit_code=1)
    secret = ref.secret(secret_file)
    console = console_for_output(stderr=as_json)
    who = issuer()
    approved, waiting = [], []
    if kind == "resume":
        for inc in _open_incidents(ref):
            if inc.state == "escalated":  # hand the run back to the daemon, as `sentinel approve` does
                publish_approval(ref, inc, secret, who, reason or f"resumed by {who}")
                approved.append(inc.id)
            elif inc.state == "awaiting_approval":
                waiting.append(inc.id)
    now = time.time()
    d = Directive(run=ref.run, kind=kind, reason=reason or f"manual {kind} by {who}", issuer=who, issued_at=now,
                  expires_at=now + timeout + 5, incident_id=approved[0] if approved else None).signed(secret)
    base = {"action": kind, "who": who, "run": ref.run, "reason": reason, "directive_id": d.id,
            "step": hb.get("step"), "approved_incidents": approved}
    if ref.run_dir is not None:
        rundir.append_audit(ref.run_dir, {**base, "phase": "issued"})
    ack = send_and_wait(ref, d, timeout, console=console, as_json=as_json, doing=DOING[kind], secret=secret)
    outcome = ack.status if ack else "timeout"
    publish_event(ref, Event(run=ref.run, kind=f"manual_{kind}", severity="warning" if kind != "resume" else "info",
                             step=ack.step if ack else hb.get("step"), incident_id=d.incident_id,
                             message=f"{who}: {kind} {outcome}" + (f": {reason}" if reason else ""),
                             data={"directive_id": d.id, "issuer": who, "outcome": outcome, "reason": reason}))
    if ref.run_dir is not None:
        rundir.append_audit(ref.run_dir, {**base, "phase": "outcome", "outcome": outcome,
                                          "detail": ack.detail if ack else None, "ack_step": ack.step if ack else None})
    res = {"run": ref.run, "kind": kind, "status": outcome, "directive_id": d.id, "step": ack.step if ack else None,
           "timeline": ack.timeline if ack else None, "detail": ack.detail if ack else None,
           "approved_incidents": approved, "awaiting_approval": waiting}
    if as_json:
        emit_json(res)
    if ack is None:
        raise no_ack_error(ref, d, timeout)
    if ack.status not in ("applied", "duplicate"):
        raise SentinelError(f"the trainer {ack.status} the {kind}: {ack.detail or 'no detail'}", exit_code=1)
    if not as_json:
        console.print(f"[bold green]{DONE[kind]}[/]: {ref.run} at step {ack.step}", highlight=False)
        for iid in approved:
            console.print(f"  escalated incident {iid}: handed back to automation", highlight=False)
        for iid in waiting:
            console.print(f"  [yellow]incident {iid} still awaits approval of its rollback[/] "
                          f"(`sentinel approve {iid}`)", highlight=False)
    return res


def _command(kind: str, doc: str):
    @click.command(kind, help=doc)
    @click.argument("run", metavar="RUN", callback=not_empty)
    @_options
    @redis_url_option
    @json_option
    @friendly_errors
    def cmd(run, reason, timeout, secret_file, redis_url, as_json):
        from sentinel.runref import ops_errors

        ops_errors(control)(kind, run, reason, timeout, secret_file, redis_url, as_json)

    return cmd


pause = _command("pause", """Pause RUN's trainer at the next step boundary (it keeps its heartbeat).

A signed directive over the run's control bus; waits for the trainer's ack. Exit 0 when acked,
1 when the trainer rejects it or does not ack within --timeout (or the bus fails once the directive
is out: it may still be applied), 2 for bad input or no bus.""")

resume = _command("resume", """Resume a paused RUN, including one the sentinel paused on escalation.

For an escalated incident this also posts the approval that hands the run back to automation (what
`sentinel approve INCIDENT` does), then resumes the trainer directly and waits for its ack. A
rollback that awaits approval stays waiting.""")

stop = _command("stop", """Stop RUN cleanly: the trainer writes a checkpoint, then exits.

Waits for the trainer's ack (the checkpoint is written right after it). Resume later by starting
the trainer again with the same --run-dir.""")
