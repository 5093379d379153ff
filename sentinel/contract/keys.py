"""Redis key names. Everything for a run lives under one prefix so ACLs can scope it."""

from __future__ import annotations

from sentinel.contract.limits import SCHEMA_VERSION


class Keys:
    """Redis key names for one run. ``Keys(run).steps`` etc.; ``Keys.RUNS`` is the run registry."""

    PREFIX = f"sentinel:v{SCHEMA_VERSION}"
    RUNS = f"{PREFIX}:runs"  # set of run ids

    MAX_RUN_ID = 256

    def __init__(self, run: str):
        # no control characters either: a run id is printed in every log line and table, and one
        # registered by anyone with bus access must not drive the operator's terminal (escapes)
        if (not run or len(run) > self.MAX_RUN_ID or any(c in run for c in " :{}\n")
                or any(ord(c) < 32 or 127 <= ord(c) < 160 for c in run)):
            raise ValueError(f"invalid run id {run[:64]!r}: use letters, digits, '-', '_' or '.' (at most {self.MAX_RUN_ID})")
        self.run = run
        p = f"{self.PREFIX}:run:{run}"
        self.steps = f"{p}:steps"  # stream of StepRecord / TimelineRecord / MarkerRecord
        self.directives = f"{p}:directives"  # stream of Directive
        self.acks = f"{p}:acks"  # stream of Ack
        self.events = f"{p}:events"  # stream of Event
        self.skiplist = f"{p}:skiplist"  # string: JSON list of [lo, hi) ranges
        self.checkpoints = f"{p}:checkpoints"  # hash step -> CheckpointInfo JSON
        self.incidents = f"{p}:incidents"  # hash id -> Incident JSON
        self.applied = f"{p}:applied"  # hash action idempotency key -> directive id
        self.heartbeat = f"{p}:heartbeat"  # string with TTL: last step + time
        self.leader = f"{p}:leader"  # lease: holder id, with TTL
        self.info = f"{p}:info"  # hash: run metadata (run dir, world size, model, ...)
        self.policy = f"{p}:policy"  # string: the leader sentinel's persisted policy state (JSON)
        self.approvals = f"{p}:approvals"  # stream of signed approvals (`sentinel approve`)


STEP_CONSUMER_GROUP = "sentinel"
