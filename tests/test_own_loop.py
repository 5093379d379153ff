"""A training loop that is not ours, watched by the real `sentinel run` daemon (docs/integrate.md).

The loop here has no torch and no model: its "weights" are one number, its loss a function of them
and its data a counter of sample ids. It speaks the contract any loop must speak, through
``sentinel.client.bus.BusClient`` only: register the run, publish a ``StepRecord`` per step,
register each checkpoint, apply signed directives, ack them, and after a rollback publish a
``TimelineRecord`` marker. Samples 1200-1207 are poison: training on them corrupts the weights
for good (a persistent +0.5 nats). The daemon must see the damage, order a rollback to a
checkpoint from before it that skips those samples, and the loop, once it has applied it, must
train on healthy data to the end.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest

from sentinel import bus
from sentinel.client.bus import BusClient
from sentinel.protocol import Ack, CheckpointInfo, StepRecord, TimelineRecord

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PER_STEP = 8  # samples per step
POISON = range(1200, 1208)  # the samples of step 150 on the first pass
CKPT_EVERY = 25
STEPS = 320


class ToyLoop:
    """The smallest loop that honours the contract: state, data cursor, skip list, checkpoints."""

    def __init__(self, client: BusClient, run: str):
        self.bus, self.run = client, run
        self.step, self.timeline, self.cursor, self.w = 0, 0, 0, 0.0  # w: the "weights" (0 = healthy)
        self.skip: list[tuple[int, int]] = []  # [lo, hi) sample-id ranges never to train on (half-open, as directives say)
        self.ckpts: dict[int, tuple[int, float]] = {}  # step -> (data cursor, weights)
        self.rng = random.Random(0)
        self.applied: list[dict] = []

    def _skipped(self, i: int) -> bool:
        return any(lo <= i < hi for lo, hi in self.skip)

    def _batch(self) -> list[int]:
        ids = []
        while len(ids) < PER_STEP:
            if not self._skipped(self.cursor):
                ids.append(self.cursor)
            self.cursor += 1
        return ids

    def save_checkpoint(self) -> None:
        self.ckpts[self.step] = (self.cursor, self.w)
        self.bus.register_checkpoint(CheckpointInfo(run=self.run, step=self.step, path=f"mem://{self.run}/{self.step}",
                                                    created=time.time(), bytes=16, manifest_sha256="0" * 64, world_size=1,
                                                    timeline=self.timeline))

    def train_step(self) -> None:
        ids = self._batch()
        if any(i in POISON for i in ids):
            self.w += 1.0  # a bad batch: damage that persists
        self.step += 1
        loss = 3.0 - 0.0005 * self.step + 0.5 * self.w + self.rng.gauss(0.0, 0.03)
        self.bus.publish_step(StepRecord(run=self.run, step=self.step, timeline=self.timeline, loss=loss, loss_max_rank=loss,
                                         grad_norm=1.0, lr=1e-3, tokens=self.step * PER_STEP * 1024,
                                         batch_fingerprint=f"{ids[0]:016x}", sample_ids=ids, time=time.time()))
        if self.step % CKPT_EVERY == 0:
            self.save_checkpoint()

    def apply_directives(self) -> None:
        for d in self.bus.poll_directives():  # signed, fresh and for this run: BusClient checked
            status, detail = "applied", None
            if d.kind == "rollback" and d.to_step in self.ckpts:
                self.skip += [tuple(r) for r in d.ranges]
                self.cursor, self.w = self.ckpts[d.to_step]
                self.step, self.timeline = d.to_step, self.timeline + 1
                self.bus.publish_step(TimelineRecord(kind="rollback", run=self.run, from_step=d.to_step, timeline=self.timeline,
                                                     time=time.time(), reason=d.reason, directive_id=d.id,
                                                     skip_ranges=[list(r) for r in d.ranges]))
            elif d.kind == "skip-samples":
                self.skip += [tuple(r) for r in d.ranges]
            elif d.kind == "rollback":
                status, detail = "failed", f"no checkpoint of step {d.to_step}"
            self.applied.append({"kind": d.kind, "to_step": d.to_step, "ranges": d.ranges, "status": status})
            self.bus.ack(Ack(run=self.run, directive_id=d.id, kind=d.kind, status=status, step=self.step,
                             timeline=self.timeline, detail=detail))


def test_a_foreign_loop_is_rolled_back_past_its_poison_samples_by_the_daemon(embedded_bus, unique_run, tmp_path):
    url, run = embedded_bus.url, unique_run
    secret = tmp_path / "secret"
    secret.write_bytes(b"a-secret-the-loop-and-the-daemon-share-0123")
    secret.chmod(0o600)
    daemon = subprocess.Popen([sys.executable, "-m", "sentinel", "run", run, "--redis-url", url, "--secret-file", str(secret),
                               "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = BusClient(url, run, secret.read_bytes())
    client.register({"world_size": 1, "model": "toy", "started": time.time()})
    loop = ToyLoop(client, run)
    try:
        loop.save_checkpoint()  # the initial state (step 0)
        deadline = time.monotonic() + 150
        while loop.step < STEPS and time.monotonic() < deadline:
            loop.train_step()
            loop.apply_directives()
            time.sleep(0.01)  # a step takes time; the daemon reads as the steps come
        assert loop.step >= STEPS, f"stuck at step {loop.step}: {loop.applied}"
        client.flush()
        incidents = json.loads(subprocess.run([sys.executable, "-m", "sentinel", "incidents", run, "--redis-url", url, "--json"],
                                              capture_output=True, text=True, timeout=60, check=True).stdout)
    finally:
        client.close()
        daemon.terminate()
        try:
            out, _ = daemon.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            out, _ = daemon.communicate()
    rollbacks = [a for a in loop.applied if a["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["status"] == "applied", (loop.applied, out[-3000:])
    rb = rollbacks[0]
    assert rb["to_step"] < 150 and any(lo <= min(POISON) and max(POISON) < hi for lo, hi in rb["ranges"]), rb
    assert loop.w == 0.0 and loop.timeline == 1  # healthy weights to the end: the poison was never trained on again
    assert all(loop._skipped(i) for i in POISON)
    [view] = incidents["runs"]
    [inc] = [i for i in view["incidents"] if i["state"] != "recovered"]  # recovered: a spike the loop never saw as damage
    assert inc["state"] == "healthy" and inc["onset_step"] <= 151 and inc["closed_at"], inc  # verified after the rollback
    [act] = [a for a in inc["actions"] if a["kind"] == "rollback"]
    assert act["outcome"] == "acked" and act["to_step"] == rb["to_step"]
