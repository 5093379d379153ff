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
import subprocess
import sys
import time

import numpy as np
import pytest

from sentinel.client import BusClient, RestoreFailed
from tests.helpers.toy_loop import POISON, ToyLoop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 320


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


def test_the_sentinel_starts_first_and_pages_a_dead_run_but_not_one_that_ended(tmp_path):
    """``sentinel run`` before the training: it creates the missing run dirs and their embedded buses, and the
    loops (``RunSession``, torch-free) find the bus waiting there. One loop ends on purpose (``end``: a
    ``run_end`` marker), the other dies; with the heartbeat rule at 2 s the dead one is paged as hung, the
    finished one never is, and ``status`` shows it finished."""
    from sentinel.client.session import RunSession, stop_bus

    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  heartbeat_stale:\n    stale_seconds: 2\n    cooldown_seconds: 3600\n")
    runs = tmp_path / "runs"
    runs.mkdir()
    done, dead = runs / "done", runs / "dead"
    daemon = subprocess.Popen([sys.executable, "-m", "sentinel", "run", str(done), str(dead), "--rules", str(rules)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ((done / "bus" / "url").is_file() and (dead / "bus" / "url").is_file()):
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.communicate()[0][-3000:]
            time.sleep(0.1)

        class Host:
            def restore_checkpoint(self, step):
                raise RestoreFailed("no checkpoints in this test")

            def save_checkpoint(self):
                pass

        for run_dir in (done, dead):
            s = RunSession(run_dir, host=Host(), log=lambda m: None)
            s.begin(0)
            for step in range(1, 6):
                ids = np.arange(step * 8, step * 8 + 8)
                if step <= 2:  # plain values
                    s.log_step(step, loss=3.0, grad_norm=1.0, lr=1e-3, batch_tokens=64, sample_ids=range(step * 8, step * 8 + 8))
                elif step == 3:  # a 0-dim loss and an id array, as a tensor loop has them: read when the record is built
                    s.log_step(step, loss=np.float32(3.0), grad_norm=np.float32(1.0), lr=1e-3, batch_tokens=64, sample_ids=ids)
                else:  # the values themselves computed on the writer thread
                    s.log_step_later(step, lambda ids=ids: {"loss": np.float32(3.0), "grad_norm": 1.0, "lr": 1e-3,
                                                            "batch_tokens": 64, "sample_ids": ids})
                s.poll(step)
            if run_dir is done:
                s.end(5, "completed")
            s.close()  # the dead one just goes quiet: what a crash looks like from the bus
        deadline = time.monotonic() + 60
        while not (dead / "pages.jsonl").is_file():
            assert daemon.poll() is None and time.monotonic() < deadline, "the dead run was never paged"
            time.sleep(0.2)
        time.sleep(3)  # the finished run has been quiet as long as the dead one was when it was paged
    finally:
        daemon.terminate()
        out = daemon.communicate(timeout=30)[0]
        for run_dir in (done, dead):
            stop_bus(run_dir)
    assert "created" in out and "the run has not started yet" in out, out[-3000:]
    recs = [json.loads(ln) for ln in (done / "steps.jsonl").read_text().splitlines()]
    recs = [(r["step"], r["loss"], r["grad_norm"], r["tokens"], r["sample_ids"]) for r in recs if r.get("kind") == "step"]
    assert recs == [(n, 3.0, 1.0, 64 * n, list(range(n * 8, n * 8 + 8))) for n in range(1, 6)], recs
    pages = [json.loads(ln) for ln in (dead / "pages.jsonl").read_text().splitlines()]
    assert any("heartbeat" in json.dumps(p) for p in pages), pages
    assert not (done / "pages.jsonl").is_file() or "heartbeat" not in (done / "pages.jsonl").read_text()
    st = json.loads(subprocess.run([sys.executable, "-m", "sentinel", "status", str(done), "--json"], capture_output=True,
                                   text=True, timeout=60, check=True).stdout)["runs"][0]
    assert (st["state"], st["step"], st.get("ended", {}).get("detail")) == ("finished", 5, "completed"), st
