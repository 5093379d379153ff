"""A training loop that is not ours (no torch): one-number weights, poison samples, the contract through sentinel.client."""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from sentinel.client import BusClient, CheckpointInfo, ControlLoop, RestoreFailed, StepLog, StepRecord

PER_STEP = 8  # samples per step
POISON = range(1200, 1208)  # the samples of step 150 on the first pass
CKPT_EVERY = 25


class ToyLoop:
    """The smallest loop that honours the contract, as a ``ControlHost``: state, data cursor, checkpoints.
    The skip list, timelines, markers, dedupe and acks are the ``ControlLoop``'s (sentinel.client)."""

    def __init__(self, client: BusClient, run: str, run_dir: Path | None = None):
        self.bus, self.run = client, run
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix="toy-loop-")) / run
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.step, self.cursor, self.w = 0, 0, 0.0  # w: the "weights" (0 = healthy)
        self.ckpts: dict[int, tuple[int, float]] = {}  # step -> (data cursor, weights)
        self.rng = random.Random(0)
        self.control = ControlLoop(run_dir, run, host=self, bus=client, steplog=StepLog(run_dir / "steps.jsonl"))
        self.applied: list[dict] = []  # what the ControlLoop applied: kind, status, to_step, id, ranges

    def _batch(self) -> list[int]:
        ids = []
        while len(ids) < PER_STEP:
            if not self.control.skip.contains(self.cursor):
                ids.append(self.cursor)
            self.cursor += 1
        return ids

    # ControlHost
    def save_checkpoint(self) -> None:
        self.ckpts[self.step] = (self.cursor, self.w)
        self.bus.register_checkpoint(CheckpointInfo(run=self.run, step=self.step, path=f"mem://{self.run}/{self.step}",
                                                    created=time.time(), bytes=16, manifest_sha256="0" * 64, world_size=1,
                                                    timeline=self.control.timeline))

    def restore_checkpoint(self, step: int) -> None:
        if step not in self.ckpts:
            raise RestoreFailed(f"no checkpoint of step {step}")
        self.cursor, self.w = self.ckpts[step]
        self.step = step

    def train_step(self) -> None:
        ids = self._batch()
        if any(i in POISON for i in ids):
            self.w += 1.0  # a bad batch: damage that persists
        self.step += 1
        loss = 3.0 - 0.0005 * self.step + 0.5 * self.w + self.rng.gauss(0.0, 0.03)
        rec = StepRecord(run=self.run, step=self.step, timeline=self.control.timeline, loss=loss, loss_max_rank=loss,
                         grad_norm=1.0, lr=1e-3, tokens=self.step * PER_STEP * 1024, batch_fingerprint=f"{ids[0]:016x}",
                         sample_ids=ids, time=time.time())
        self.control.steplog.write(rec)  # steps.jsonl: what a rollback's skip_after reads back
        self.bus.publish_step(rec)
        if self.step % CKPT_EVERY == 0:
            self.save_checkpoint()

    def _skipped(self, i: int) -> bool:
        return self.control.skip.contains(i)

    def apply_directives(self) -> None:
        done = self.control.poll(self.step)  # signed, fresh and for this run: BusClient checked
        if done:  # the ranges each put on the skip list: from the ControlLoop's own record
            logged = {d["id"]: d for d in map(json.loads, (self.run_dir / "directives.jsonl").read_text().splitlines())}
            self.applied += [{"kind": a.kind, "status": a.status, "to_step": a.to_step, "id": a.directive_id,
                              "ranges": [tuple(r) for r in logged[a.directive_id].get("ranges", [])],
                              "skip_list": list(self.control.skip.ranges)} for a in done]
