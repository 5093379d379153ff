"""A training loop that is not ours, watched by the real `sentinel run` daemon (docs/integrate.md).

The loop here has no torch and no model: its "weights" are one number, its loss a function of them
and its data a counter of sample ids. It speaks the contract any loop must speak, through
``sentinel.client`` only: register the run, publish a ``StepRecord`` per step, register each
checkpoint, and hand directives to a ``ControlLoop`` (which applies, logs and acks them, and writes
the rollback marker). Samples 1200-1207 are poison: training on them corrupts the weights
for good (a persistent +0.5 nats). The daemon must see the damage, order a rollback to a
checkpoint from before it that skips those samples, and the loop, once it has applied it, must
train on healthy data to the end.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sentinel.client import BusClient, CheckpointInfo, ControlLoop, RestoreFailed, StepLog, StepRecord

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PER_STEP = 8  # samples per step
POISON = range(1200, 1208)  # the samples of step 150 on the first pass
CKPT_EVERY = 25
STEPS = 320


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


def test_a_foreign_loop_is_rolled_back_past_its_poison_samples_by_the_daemon(embedded_bus, unique_run, tmp_path):
    url, run = embedded_bus.url, unique_run
    secret = tmp_path / "secret"
    secret.write_bytes(b"a-secret-the-loop-and-the-daemon-share-0123")
    secret.chmod(0o600)
    daemon = subprocess.Popen([sys.executable, "-m", "sentinel", "run", run, "--redis-url", url, "--secret-file", str(secret),
                               "--metrics-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = BusClient(url, run, secret.read_bytes())
    client.register({"world_size": 1, "model": "toy", "started": time.time()})
    run_dir = tmp_path / run
    run_dir.mkdir()
    loop = ToyLoop(client, run, run_dir)
    try:
        loop.control.begin(0)  # the start marker, timeline 0
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
    assert loop.w == 0.0 and loop.control.timeline == 1  # healthy weights to the end: the poison was never trained on again
    assert all(loop.control.skip.contains(i) for i in POISON)
    # the ControlLoop's record on disk: each directive once, the skip list, and the rollback marker
    logged = [json.loads(ln) for ln in (run_dir / "directives.jsonl").read_text().splitlines()]
    assert [d["id"] for d in logged] == [a["id"] for a in loop.applied] and len({d["id"] for d in logged}) == len(logged)
    assert json.loads((run_dir / "skiplist.json").read_text()) == [list(r) for r in loop.control.skip.ranges]
    markers = [m for m in map(json.loads, (run_dir / "steps.jsonl").read_text().splitlines()) if m["kind"] != "step"]
    assert [(m["kind"], m["timeline"]) for m in markers] == [("start", 0), ("rollback", 1)]
    assert markers[1]["from_step"] == rb["to_step"] and markers[1]["directive_id"] == rb["id"]
    [view] = incidents["runs"]
    [inc] = [i for i in view["incidents"] if i["state"] != "recovered"]  # recovered: a spike the loop never saw as damage
    assert inc["state"] == "healthy" and inc["onset_step"] <= 151 and inc["closed_at"], inc  # verified after the rollback
    [act] = [a for a in inc["actions"] if a["kind"] == "rollback"]
    assert act["outcome"] == "acked" and act["to_step"] == rb["to_step"]
