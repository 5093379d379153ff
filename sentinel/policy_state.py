"""The policy's state as plain JSON, and back: a restarted daemon resumes mid-incident. The state is
input too (a bus key anyone with write access can set): every field is checked on the way in."""

from __future__ import annotations

import math
from array import array
from typing import Any, get_args

from sentinel.policy_types import SPIKE_PATTERNS
from sentinel.protocol import (
    CheckpointInfo,
    Event,
    Incident,
    IncidentState,
    StepRecord,
    TimelineRecord,
    ids_to_ranges,
)


def pack_ids(ids) -> bytes:
    """A step's sample ids as the history keeps them: 8 bytes an id (a list of ints takes about
    36), in an object the garbage collector does not track (2048 steps a run, each a list, made
    every gen-2 collection of a daemon watching 300 runs walk over a million containers: pauses of
    a tenth of a second and more, growing with the history; bench/daemon_scale.py)."""
    return array("q", ids).tobytes()


def unpack_ids(blob: bytes) -> array:
    out = array("q")
    out.frombytes(blob)
    return out


class PolicyStateMixin:
    def restore_samples(self, records) -> None:
        """Rebuild the sample-id history from step-stream records (oldest first), so ``state_dict``
        need not carry it: the daemon persists state on every poll, and the ids are already in the
        stream. Timeline markers drop the samples of the steps they abandoned."""
        self._samples.clear()
        for r in records:
            if isinstance(r, TimelineRecord):
                while self._samples and self._samples[-1][0] > r.from_step:
                    self._samples.pop()
            elif isinstance(r, StepRecord) and r.sample_ids:
                self._samples.append((r.step, pack_ids(r.sample_ids)))
        self._samples_in_order = _in_order(self._samples)

    def state_dict(self, include_samples: bool = True) -> dict[str, Any]:
        """Everything needed to continue exactly where this policy is, as plain JSON.

        ``include_samples=False`` leaves out the sample-id history (up to ``sample_history_steps``
        steps x batch ids: the bulk of the state); restore it with ``restore_samples``."""
        return {
            "version": 1,
            "run": self.run,
            "state": self._state,
            "timeline": self.timeline,
            "last_step": self.last_step,
            "last_time": self.last_time,
            "incidents": [i.model_dump(mode="json") for i in self.recent_incidents()],
            "current": self._current,
            "episode": self._ep,
            "pending": self._pending,
            "checkpoints": [c.model_dump(mode="json") for c in self._checkpoints.values()],
            "samples": [[s, [list(r) for r in ids_to_ranges(unpack_ids(ids))]] for s, ids in self._samples] if include_samples else None,
            "rollback_log": self._rollback_log,
            "steps_seen": self.steps_seen,
            "episodes": list(self._episodes),
            "pattern": self.pattern,
            "last_fire": self._last_fire,
            "hang": self._hang,
            "rebaselined_at": self._rebaselined_at,
            "forks": [list(f) for f in self._forks],
            "engine": self.engine.state_dict(),
            "events": [e.model_dump(mode="json") for e in self._events],
            "later": self._later,
            "ended": self.ended,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Continue from ``state_dict``'s output. The state is input too (a bus key anyone with write
        access can set, or one a bug or another version wrote): every field is checked for its type
        and its bounds, and for agreement with the others, and a ValueError says which one failed
        (the caller then starts afresh). Before, a state name of 5 or a timeline ahead of the run
        silently ended the run's judging, and a ranges list of 10^12 ids was expanded into memory."""
        self._init_state()
        state = d["state"]
        if state not in _STATES:
            raise ValueError(f"state {str(state)[:40]!r} is not a state")
        self._state = state
        self.timeline = _bounded_int(d["timeline"], "timeline")
        last_step, last_time = d["last_step"], d["last_time"]
        self.last_step = None if last_step is None else _bounded_int(last_step, "last_step")
        if last_time is not None and not (isinstance(last_time, (int, float)) and math.isfinite(last_time)):
            raise ValueError("last_time is not a finite number")
        self.last_time = last_time
        self._incidents = {i["id"]: Incident.model_validate(i) for i in d["incidents"]}
        self._current, self._hang = d["current"], d.get("hang")
        for name, iid in (("current", self._current), ("hang", self._hang)):
            if iid is not None and (not isinstance(iid, str) or iid not in self._incidents):
                raise ValueError(f"{name} names no incident of the state")
        if (state == "healthy") != (self._current is None):
            raise ValueError(f"state {state} with current incident {self._current!r}")
        self._ep = dict(d["episode"])
        if state == "suspect" and not all(_is_int(self._ep.get(k)) for k in ("onset", "last")):
            raise ValueError("the open episode has no onset or last step")
        if any(not isinstance(k, str) or isinstance(v, dict) or (isinstance(v, list) and (
                len(v) > 1 << 16 or not all(isinstance(x, (int, float)) for x in v))) for k, v in self._ep.items()):
            raise ValueError("episode holds a value of the wrong kind")
        self._pending = dict(d["pending"])
        if any(not isinstance(k, str) or not isinstance(v, dict) for k, v in self._pending.items()):
            raise ValueError("pending is not a map of incident id to action")
        self._checkpoints = {c["step"]: CheckpointInfo.model_validate(c) for c in d["checkpoints"]}
        budget = self.cfg.sample_history_steps * MAX_SAVED_IDS_PER_STEP
        for s, ranges in d.get("samples") or []:
            n = 0
            for lo, hi in ranges:
                if not (_is_int(lo) and _is_int(hi) and 0 <= lo <= hi):
                    raise ValueError("samples hold a range that is not 0 <= lo <= hi")
                n += hi - lo
            budget -= n
            if budget < 0:  # the daemon saves none (they are read back from the stream): a hostile list
                raise ValueError(f"samples hold more than {self.cfg.sample_history_steps * MAX_SAVED_IDS_PER_STEP} ids")
            self._samples.append((_bounded_int(s, "samples step"), pack_ids(i for lo, hi in ranges for i in range(lo, hi))))
        self._samples_in_order = _in_order(self._samples)
        self._rollback_log = [[float(t), float(n)] for t, n in d.get("rollback_log", [])]
        self.steps_seen = _bounded_int(d.get("steps_seen", 0), "steps_seen")
        episodes = d.get("episodes", [])
        if not isinstance(episodes, list) or any(not isinstance(e, dict) for e in episodes):
            raise ValueError("episodes is not a list of maps")
        self._episodes.extend(episodes)
        self.pattern = d.get("pattern", "none")
        if self.pattern not in ("none", *SPIKE_PATTERNS):
            raise ValueError(f"pattern {str(self.pattern)[:40]!r} is not a spike pattern")
        self._last_fire = {k: list(v) for k, v in d["last_fire"].items()}
        if any(not isinstance(k, str) or len(v) != 2 or not all(
                x is None or (isinstance(x, (int, float)) and math.isfinite(x)) for x in v) for k, v in self._last_fire.items()):
            raise ValueError("last_fire is not a map of rule to [step, time]")
        rb = d.get("rebaselined_at")
        self._rebaselined_at = int(rb) if rb is not None else None
        self._forks = [[int(t), int(s)] for t, s in d.get("forks", [])]
        self._fork_cut = None
        self.engine.load_state_dict(d["engine"])
        self._events = [Event.model_validate(e) for e in d.get("events", [])]
        later = d.get("later")
        if later is not None:
            if not (isinstance(later, dict) and later.get("incident") in self._incidents
                    and isinstance(later.get("steps"), list) and len(later["steps"]) == 2
                    and all(_is_int(x) for x in later["steps"]) and isinstance(later.get("ranges"), list)
                    and all(isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and 0 <= r[0] <= r[1]
                            for r in later["ranges"])):
                raise ValueError("later is not a follow-up skip of an incident of the state")
            self._later = {"incident": later["incident"], "steps": list(later["steps"]), "ranges": [list(r) for r in later["ranges"]]}
        ended = d.get("ended")
        if ended is not None:
            e = ended if isinstance(ended, dict) else {}
            t, detail = e.get("time"), e.get("detail")
            if not (e and _is_int(e.get("step")) and isinstance(t, (int, float)) and not isinstance(t, bool)
                    and math.isfinite(t) and (detail is None or (isinstance(detail, str) and len(detail) <= 1000))):
                raise ValueError("ended is not a run_end marker's step, time and detail")
            self.ended = {"step": _bounded_int(ended["step"], "ended step"), "time": float(t), "detail": detail}


_STATES = frozenset(get_args(IncidentState))
MAX_SAVED_IDS_PER_STEP = 1 << 16  # a saved state's sample history: at most this many ids per remembered step
_MAX_COUNT = 1 << 53  # a step, timeline or count from a saved state: above it, not a number this policy wrote


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bounded_int(x: Any, what: str) -> int:
    if not _is_int(x) or not 0 <= x <= _MAX_COUNT:
        raise ValueError(f"{what} is not a count")
    return x


def _in_order(samples) -> bool:
    """Do the remembered steps never decrease?"""
    prev = None
    for s, _ in samples:
        if prev is not None and s < prev:
            return False
        prev = s
    return True
