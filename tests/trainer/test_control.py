"""The trainer's control client, end to end: a live 2-rank torchrun run on its embedded bus takes
every directive kind, signed with the run's secret, at one step boundary on all ranks, and acks it.

- checkpoint-now writes a checkpoint at the ack's step;
- pause stops stepping (the heartbeat goes on), resume restarts it;
- skip-samples grows the skip list, and no sample in it is trained afterwards;
- rollback restores a checkpoint in-process; the *same* directive sent again is acked "duplicate"
  and not applied twice, because the applied-directive log survives the rollback;
- stop checkpoints and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from sentinel import bus
from sentinel.protocol import Directive, Keys, TimelineRecord
from tests.helpers.trainer import kill_all, read_steps, trainer_cmd, trainer_env, wait_for

pytestmark = pytest.mark.slow


_wait, _steps = wait_for, read_steps


class Control:
    def __init__(self, run_dir: Path):
        self.r = bus.connect(bus.resolve_url(run_dir))
        self.secret = bus.load_secret(run_dir)
        self.keys = Keys(run_dir.name)

    def send(self, d: Directive) -> Directive:
        d = d if d.sig else d.signed(self.secret)
        bus.publish(self.r, self.keys.directives, d)
        return d

    def ack(self, d: Directive, proc, timeout: float = 60.0) -> dict:
        def find():
            for _, fields in self.r.xrange(self.keys.acks):
                a = json.loads(fields["json"])
                if a["directive_id"] == d.id:
                    return a
            return None

        return _wait(find, timeout, f"ack of {d.kind}", proc)

    def acks(self, d: Directive) -> list[dict]:
        return [a for a in (json.loads(f["json"]) for _, f in self.r.xrange(self.keys.acks)) if a["directive_id"] == d.id]


def test_every_directive_kind_on_a_live_two_rank_run(tmp_path, dataset):
    run_dir = tmp_path / "ctl"
    run = run_dir.name
    proc = subprocess.Popen(
        trainer_cmd(run_dir, "--preset", "tiny", "--data", str(dataset), "--max-steps", "100000", "--ckpt-every", "0",
                    "--eval-every", "0", "--redis-url", "embedded", "--metrics-port", "0", nproc=2),
        env=trainer_env(dataset), stdout=open(tmp_path / "train.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: len(_steps(run_dir)) > 20 and (run_dir / "bus" / "secret").is_file(), 120, "first steps", proc)
        ctl = Control(run_dir)

        # checkpoint-now
        d = ctl.send(Directive(run=run, kind="checkpoint-now", reason="test"))
        a = ctl.ack(d, proc)
        assert a["status"] == "applied"
        ck_step = a["step"]
        _wait(lambda: (run_dir / "checkpoints" / f"step-{ck_step:08d}" / "manifest.json").is_file(), 30, "checkpoint", proc)

        # pause / resume
        d = ctl.send(Directive(run=run, kind="pause"))
        assert ctl.ack(d, proc)["status"] == "applied"
        time.sleep(0.5)  # a step already in flight may still land
        n = len(_steps(run_dir))
        time.sleep(2.0)
        assert len(_steps(run_dir)) == n, "steps kept coming while paused"
        d = ctl.send(Directive(run=run, kind="resume"))
        assert ctl.ack(d, proc)["status"] == "applied"
        _wait(lambda: len(_steps(run_dir)) > n + 5, 30, "steps after resume", proc)

        # skip-samples: from the ack on, no sample of the range is trained
        lo, hi = 0, 40000  # about half of the ~78k samples: any batch would hit it
        d = ctl.send(Directive(run=run, kind="skip-samples", ranges=[(lo, hi)]))
        a = ctl.ack(d, proc)
        assert a["status"] == "applied"
        assert [lo, hi] in json.loads((run_dir / "skiplist.json").read_text())
        _wait(lambda: any(r.get("step", 0) > a["step"] + 10 for r in _steps(run_dir)), 30, "steps after skip", proc)
        after = [r for r in _steps(run_dir) if r.get("kind") == "step" and r["step"] > a["step"]]
        assert after and all(not (lo <= i < hi) for r in after for i in r["sample_ids"])

        # rollback to the checkpoint-now checkpoint, then the very same directive again
        rb = ctl.send(Directive(run=run, kind="rollback", to_step=ck_step, reason="test"))
        a = ctl.ack(rb, proc)
        assert a["status"] == "applied" and a["step"] == ck_step
        _wait(lambda: len(ctl.acks(rb)) >= 1, 10, "rollback ack")
        ctl.send(rb)  # replayed (same id, same signature)
        _wait(lambda: len(ctl.acks(rb)) >= 2, 60, "second ack", proc)
        assert [x["status"] for x in ctl.acks(rb)] == ["applied", "duplicate"]
        rollbacks = [r for r in _steps(run_dir) if r.get("kind") == "rollback"]
        assert len(rollbacks) == 1 and rollbacks[0]["from_step"] == ck_step and rollbacks[0]["directive_id"] == rb.id
        log = [json.loads(x) for x in (run_dir / "directives.jsonl").read_text().splitlines()]
        assert [e["status"] for e in log if e["id"] == rb.id] == ["applied"]

        # stop: a final checkpoint, then a clean exit
        d = ctl.send(Directive(run=run, kind="stop"))
        a = ctl.ack(d, proc)
        assert a["status"] == "applied"
        assert proc.wait(60) == 0
        last = max(int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*"))
        final = [r for r in _steps(run_dir) if r.get("kind") == "step"][-1]["step"]
        assert last == final
        assert isinstance(TimelineRecord.from_json(rollbacks[0]), TimelineRecord)
    finally:
        if proc.poll() is None:
            kill_all(proc)  # with torchrun's workers, which have their own sessions
        from sentinel.embedded import stop_embedded

        stop_embedded(run_dir)
