"""A bus whose Redis server stops answering mid-run (SIGSTOP, later SIGCONT).

The trainer's steps, the daemon and the CLI's views rode it out (measured, not replayed here: the
step time and CPU of both sides unchanged, every record delivered once the server went on). Two
things did not. A trainer that ended while the bus was stalled lost the records it still held,
without a word (38 of 63, 886 of 1,003; rc 0, its last line "buffering up to 10000 records"), and
the daemon paged "trainer hung or dead" five minutes later. A ``sentinel pause`` whose ack wait met
the stall said "cannot reach Redis" (rc 2) while its directive was on the bus: the trainer paused.
Now the bus client's close says how many records the bus never took, and the command says that its
directive is out and until when the trainer may apply it (rc 1).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from sentinel import bus
from sentinel.client.bus import BusClient
from sentinel.protocol import Keys, StepRecord

pytestmark = pytest.mark.timeout(180)

SECRET = b"stall-audit-secret-0123456789abcdef"


def _step(run: str, step: int) -> StepRecord:
    return StepRecord(run=run, step=step, timeline=0, loss=2.0, loss_max_rank=2.0, grad_norm=1.0, lr=1e-3,
                      tokens=step * 256, batch_fingerprint="f", time=time.time())


def _until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_records_a_stalled_bus_never_took_are_counted_in_one_warning_at_close(redis_server, unique_run, caplog):
    r = bus.connect(redis_server.url)
    steps = Keys(unique_run).steps
    log = logging.getLogger("test_stalled_server.bus_client")
    client = BusClient(redis_server.url, unique_run, SECRET, logger=log, io_timeout_s=0.5)
    for s in range(1, 6):
        client.publish_step(_step(unique_run, s))
    _until(lambda: r.xlen(steps) == 5, "the first records on the bus")
    os.kill(redis_server.proc.pid, signal.SIGSTOP)
    try:
        for s in range(6, 31):  # the run goes on, and ends, while the server does not answer
            client.publish_step(_step(unique_run, s))
        with caplog.at_level(logging.WARNING, logger=log.name):
            client.close(timeout=1.0)
    finally:
        os.kill(redis_server.proc.pid, signal.SIGCONT)
    said = [rec for rec in caplog.records if rec.name == log.name]
    lost = [rec.getMessage() for rec in said if "not delivered" in rec.getMessage()]
    assert len(lost) == 1, [rec.getMessage() for rec in said]
    n = int(re.search(r"(\d+) record", lost[0]).group(1))
    assert n >= 1 and 30 - r.xlen(steps) <= n, (lost[0], r.xlen(steps))  # every record missing is counted
    assert not [rec for rec in said if rec.levelno >= logging.ERROR], "shutting down is no I/O error"


@pytest.mark.parametrize("command", [["pause", "--reason", "stall"], ["skip-list", "add", "5:8"]], ids=["pause", "skip-list"])
def test_a_directive_whose_ack_wait_meets_a_stalled_bus_is_said_to_be_out(redis_server, unique_run, command):
    r = bus.connect(redis_server.url)
    k = Keys(unique_run)
    r.sadd(Keys.RUNS, unique_run)
    r.set(k.heartbeat, json.dumps({"step": 5, "time": time.time(), "sent": time.time(), "pid": 1}), px=600_000)
    env = {**os.environ, "SENTINEL_SECRET": SECRET.decode()}
    proc = subprocess.Popen([sys.executable, "-m", "sentinel", command[0], unique_run, *command[1:], "--timeout", "60",
                             "--redis-url", redis_server.url], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _until(lambda: r.xlen(k.directives) == 1 or proc.poll() is not None, "the directive on the bus")
        assert proc.poll() is None, proc.communicate()
        did = json.loads(r.xrange(k.directives)[0][1]["json"])["id"]
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the trainer may have it; its ack cannot come back
        try:
            out, err = proc.communicate(timeout=120)
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    lines = [ln for ln in err.splitlines() if ln.strip() and "waiting for the trainer" not in ln]
    assert "Traceback" not in out + err, err
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, err)
    assert did[:8] in lines[0] and "may still apply it" in lines[0], lines[0]
