"""The rollback-target rule: which checkpoint to restore for damage first seen at a step.

One function, called by the policy (``RunPolicy._pick_target``), the CLI (``sentinel rollback
--before-step``) and the offline replay (``sentinel replay-batch``, which restores the state a
step trained from).

Why ``onset - 2``: a checkpoint saved at step ``s`` holds the weights after update ``s``, and the
loss of step ``s + 1`` is computed on exactly those weights. An anomaly first seen in the loss of
step ``o`` (the onset) therefore has one of two causes the loss cannot tell apart: a bad batch of
step ``o`` (its damage enters with update ``o``: checkpoints ``>= o`` hold it), or bad weights
coming out of update ``o - 1`` (an LR spike, a corrupt optimizer step, a batch of normal loss with
a huge gradient: checkpoint ``o - 1`` holds it; its loss at ``o`` is the first sign). Only a
checkpoint whose weights produced a normal loss is vouched for: checkpoint ``s`` is, when step
``s + 1 < o``, so ``s <= o - 2``. Checkpoint ``o - 1`` is the one that *produced* the anomalous
loss and is never a target. (The policy used to accept it; the CLI already required ``o - 2``.)

On top, the policy keeps a margin (``rollback_margin_steps``, PaLM's ~100 steps): a detector's
onset is an estimate, and damage often starts a little before it shows, so the newest checkpoint
at least ``margin`` steps before the onset is preferred. When none is that old, the oldest vouched
one is taken: it is the furthest from the onset there is. No vouched checkpoint at all: None (the
caller escalates).

A replay is the one caller that wants the state a step *trained from*, damage included: to
reproduce step ``n`` exactly, only update ``n`` must not be in the weights, so it passes
``suspect_updates=1`` (checkpoint ``<= n - 1``).
"""

from __future__ import annotations

from collections.abc import Iterable

# updates that may hold the damage of an anomaly first seen in step o's loss: o (a bad batch) and
# o - 1 (bad weights, first measured at o)
SUSPECT_UPDATES = 2


def clean_bound(onset: int, *, suspect_updates: int = SUSPECT_UPDATES) -> int:
    """The newest checkpoint step that can hold none of the damage first seen at ``onset``."""
    return int(onset) - suspect_updates


def rollback_target(checkpoints: Iterable[int], onset: int, *, margin: int = 0,
                    suspect_updates: int = SUSPECT_UPDATES) -> int | None:
    """The checkpoint step to restore for an anomaly first seen in the loss of step ``onset``.

    ``checkpoints``: the usable checkpoint steps (the caller drops corrupt ones and those of an
    abandoned timeline). The newest one ``<= min(onset - suspect_updates, onset - margin)``; else
    the oldest one ``<= onset - suspect_updates``; else None. See the module docstring for why.
    """
    bound = clean_bound(onset, suspect_updates=suspect_updates)
    vouched = sorted(s for s in set(checkpoints) if s <= bound)
    preferred = [s for s in vouched if s <= min(bound, int(onset) - margin)]
    if preferred:
        return preferred[-1]
    return vouched[0] if vouched else None
