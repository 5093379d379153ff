"""What each incident action became: sent or not, and the trainer's answer.

Incidents live in the run's ``incidents`` hash on the bus and in the run dir's ``incidents.jsonl``
mirror (``sentinel.rundir.read_incidents_log``). For every action the policy decided, this module
works out whether it was actually sent and what came of it:

* a directive is *sent* when the daemon recorded it in the run's ``applied`` hash (idempotency key
  -> directive id); its outcome is the trainer's Ack (``acked`` / ``rejected`` / ``failed`` /
  ``duplicate``), ``timed out`` once the directive expired unanswered, else ``waiting for ack``;
* without a bus, the trainer's own ``directives.jsonl`` says what it applied (matched by id, else by
  incident and kind, one to one in order: two ``skip-samples`` of one incident are two directives,
  each with its own answer, never both the first one's);
* a dry-run decision is shown as ``would send (dry run)`` and never as sent;
* anything else (rate-limited, duplicate, a hands-off escalation) was *not sent* and is left out of
  the action table (counted in its caption; ``--json`` keeps every action with its outcome).

Torch-free and Redis-free: the caller passes what it read from the bus.
"""

from __future__ import annotations

import time
from typing import Any

from sentinel.protocol import finite_or_none

DIRECTIVE_KINDS = frozenset({"rollback", "skip-samples", "pause", "resume", "stop", "checkpoint-now"})
DIRECTIVE_TTL_S = 600.0  # the daemon's directive lifetime (sentinel.daemon.DIRECTIVE_TTL_S)
ACK_WORDS = {"applied": "acked", "duplicate": "acked (duplicate)", "rejected": "rejected", "failed": "failed"}
NOT_SENT = "not sent"
DRY_RUN = "would send (dry run)"


def _typed(act: dict[str, Any]) -> dict[str, Any]:
    """The fields of an action this module reads, each of its type or None: actions are free-form
    dicts from the bus or a run dir's mirror, and a hostile one ("kind": [1], "time": "x") must
    read as "not sent", never raise."""
    def text(k):
        v = act.get(k)
        return v if isinstance(v, str) else None

    return {"kind": text("kind"), "directive_id": text("directive_id"), "idempotency_key": text("idempotency_key") or "",
            "incident_id": text("incident_id"), "outcome": text("outcome"), "time": finite_or_none(act.get("time")),
            "dry_run": bool(act.get("dry_run"))}


def _log_entry(d: dict[str, Any]) -> dict[str, Any]:
    """A ``directives.jsonl`` entry with the same care: strings or None, a finite time or 0."""
    return {"id": d.get("id") if isinstance(d.get("id"), str) else None,
            "incident_id": d.get("incident_id") if isinstance(d.get("incident_id"), str) else None,
            "kind": d.get("kind") if isinstance(d.get("kind"), str) else None,
            "status": d.get("status") if isinstance(d.get("status"), str) else None,
            "time": finite_or_none(d.get("time")) or 0.0}


def _status_word(status: Any) -> str:
    return ACK_WORDS.get(status, str(status)) if isinstance(status, str) else str(status)


def _entry_key(i: int, d: dict[str, Any]) -> str | int:
    """What one directive is in the trainer's log: its id (a redelivered directive logged twice, as
    ``applied`` then ``duplicate``, is still one directive), else the line's position."""
    return d["id"] if d["id"] is not None else i


def _match_by_kind(act: dict[str, Any], log: list[dict], claimed: set) -> dict[str, Any] | None:
    """The first log entry of the action's incident and kind, applied no earlier than it was
    decided, that no other action has claimed; claims it. One to one, in order: the n-th
    ``skip-samples`` of an incident is the n-th one the trainer logged for it."""
    for i, d in enumerate(log):
        key = _entry_key(i, d)
        if key in claimed or d["incident_id"] != act["incident_id"] or d["kind"] != act["kind"]:
            continue
        if d["time"] >= (act["time"] or 0.0) - 1:
            claimed.add(key)
            return d
    return None


def action_outcome(act: dict[str, Any], *, applied: dict[str, str] | None, acks: dict[str, dict],
                   trainer_log: list[dict], now: float | None = None) -> dict[str, Any]:
    """``{"sent": bool, "outcome": str, "directive_id": str | None}`` for one incident action.

    ``applied``: the bus's idempotency hash (None without a bus); ``acks``: directive id -> Ack dict;
    ``trainer_log``: the trainer's ``directives.jsonl`` entries. For every action of an incident use
    ``annotate_actions``: only it keeps one log entry from answering for two actions."""
    log = [_log_entry(d) for d in trainer_log if isinstance(d, dict)]
    return _outcome(_typed(act), applied=applied, acks=acks, log=log, now=now, claimed=set())


def _outcome(act: dict[str, Any], *, applied: dict[str, str] | None, acks: dict[str, dict], log: list[dict],
             now: float | None, claimed: set) -> dict[str, Any]:
    """``action_outcome`` of a typed action against a typed log; ``claimed``: the log entries
    (``_entry_key``) already answering for other actions of the incident, grown by this one."""
    now = time.time() if now is None else now
    kind = act["kind"]
    if act["dry_run"]:
        return {"sent": False, "outcome": DRY_RUN, "directive_id": None}
    did = act["directive_id"]
    if kind == "page":
        sent = bool(applied and applied.get(act["idempotency_key"])) or act["outcome"] == "paged"
        return {"sent": sent, "outcome": "paged" if sent else NOT_SENT, "directive_id": None}
    if kind not in DIRECTIVE_KINDS:
        return {"sent": False, "outcome": act["outcome"] or NOT_SENT, "directive_id": did}
    if did is None and applied is not None:
        did = applied.get(act["idempotency_key"])
    if did is None and applied is None:  # no bus: the trainer's own log, by incident and kind
        hit = _match_by_kind(act, log, claimed)
        if hit is not None:
            return {"sent": True, "outcome": _status_word(hit["status"]), "directive_id": hit["id"]}
    if did is None:
        recorded = act["outcome"]
        if recorded == "prepared":  # a manual offline rollback: written to the run dir, applied at the next start
            return {"sent": True, "outcome": "prepared (next start)", "directive_id": None}
        return {"sent": False, "outcome": NOT_SENT, "directive_id": None}
    ack = acks.get(did)
    if ack is None:
        hit = next((d for d in log if d["id"] == did), None)
        if hit is not None:
            ack = {"status": hit["status"]}
    if ack is not None:
        return {"sent": True, "outcome": _status_word(ack.get("status")), "directive_id": did}
    recorded = act["outcome"]
    if recorded in ("timeout", "timed out"):
        return {"sent": True, "outcome": "timed out", "directive_id": did}
    if recorded in ACK_WORDS:
        return {"sent": True, "outcome": ACK_WORDS[recorded], "directive_id": did}
    issued = act["time"] or now
    expired = now - issued > DIRECTIVE_TTL_S
    return {"sent": True, "outcome": "timed out" if expired else "waiting for ack", "directive_id": did}


def annotate_actions(inc: dict[str, Any], *, applied: dict[str, str] | None, acks: dict[str, dict],
                     trainer_log: list[dict], now: float | None = None) -> None:
    """Add ``sent``/``outcome``/``directive_id`` to every action of an incident dict, in place.

    Each ``directives.jsonl`` entry answers for one action at most: the directives the actions name
    by id are claimed first, so matching the others by incident and kind, in order, cannot hand one
    of them an entry that belongs to an action named later."""
    acts = [a for a in inc.get("actions") or [] if isinstance(a, dict)]
    typed = [_typed(a) for a in acts]
    log = [_log_entry(d) for d in trainer_log if isinstance(d, dict)]
    claimed: set = {t["directive_id"] for t in typed if t["directive_id"] is not None}
    for a, t in zip(acts, typed):
        a.update(_outcome(t, applied=applied, acks=acks, log=log, now=now, claimed=claimed))

