"""The policy's vocabulary: the ``Action`` it asks the daemon to take, the open ``Episode`` it
tracks, and the limits its parts share."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from pydantic import BaseModel, Field

from sentinel.protocol import StepRecord
from sentinel.rules import Finding

ActionKind = Literal["rollback", "skip-samples", "pause", "resume", "stop", "checkpoint-now", "page"]
DIRECTIVE_KINDS = frozenset({"rollback", "skip-samples", "pause", "resume", "stop", "checkpoint-now"})
MAX_EVIDENCE = 50  # per incident: enough to see the shape, bounded so incidents stay small
SPIKE_PATTERNS = ("one-off", "periodic", "increasing")
PATTERN_HISTORY = 32  # spike episodes remembered for the pattern (one-off / periodic / increasing)
PATTERN_RANGES = 64  # sample-id ranges kept per episode to recognise the same data coming back
_PRIORITY = {"divergence": 0, "nonfinite": 1, "loss_spike": 2}  # which anomaly names the incident
# spikes that keep coming: this many separate spikes (flagged steps apart, not one spike's steps) in
# one open episode, each within episode_gap_steps of the last, page as "increasing" although none
# was damage: spikes every 6-12 steps merge into one episode that never closes, so the pattern of
# closed episodes never sees them (a 1000-step storm of 125 spikes paged nothing)
SPIKE_STORM = 10
SKIP_LATER_MAX_STEPS = 16  # steps after a sent rollback whose samples still join its skip (a trainer acts within 1-2)


def _overlap(a: list, b: list) -> bool:
    """Do two lists of half-open [lo, hi) id ranges share an id?"""
    return any(lo < hi2 and lo2 < hi for lo, hi in a for lo2, hi2 in b)


class Action(BaseModel):
    """Something the daemon should do. Directive kinds become signed Directives; "page" notifies a human."""

    kind: ActionKind
    run: str
    incident_id: str | None
    to_step: int | None = None
    ranges: list[tuple[int, int]] = Field(default_factory=list)
    # a rollback's data window in steps, first and last: the samples of these steps are the ones in
    # ``ranges`` (empty when the records carried no sample ids, as in a loss-only trace)
    skip_steps: tuple[int, int] | None = None
    reason: str
    idempotency_key: str  # deterministic: a restarted daemon that replays the same input gets the same key


def _evidence(rec: StepRecord, f: Finding) -> dict[str, Any]:
    return {
        "step": rec.step, "timeline": rec.timeline, "loss": rec.loss, "grad_norm": rec.grad_norm, "lr": rec.lr,
        "skipped": rec.skipped, "skip_reason": rec.skip_reason, "batch_fingerprint": rec.batch_fingerprint,
        "n_samples": len(rec.sample_ids), "rule": f.rule, "detail": f.detail,
    }


class Episode(TypedDict, total=False):
    """The open episode of a run (``RunPolicy._ep``): what the state machine knows about the anomaly
    it is handling. Plain JSON, saved with the policy's state; every key is optional (an episode
    gains them as it goes: suspect → incident → rollback → verifying)."""

    onset: int  # the first step of the anomaly (the detectors' estimate, or the spike)
    count: int  # anomalous steps seen in it
    last: int  # the newest anomalous step
    spikes: int  # separate spikes in it (SPIKE_STORM)
    baseline: float | None  # the loss level before the onset: the verdict's reference
    rollback_seen: int  # steps_seen when the rollback was sent (or the newest step that predates it)
    skip_to: int  # the last step whose samples the rollback's skip covers
    skip_base: int  # the step the follow-up window counts from (SKIP_LATER_MAX_STEPS)
    skip_timeline: int  # the timeline of the damaged branch
    skip_capped: bool  # the follow-up window is closed: the trainer did not apply the rollback in time
    verify_from: int  # the restored step
    verify_recent: list[float]  # the newest losses, for the verdict's median
    held: bool  # a dry run holds the incident open until the loss is back in band
