"""The daemon's log (sentinel/logs.py): stdlib logging with levels, text or one JSON object per line.

One real ``sentinel run`` on a Debian redis-server, started with ``--log-format json`` (and once with
``SENTINEL_LOG_FORMAT=json``), stopped with SIGTERM: every line it wrote is a JSON object with time,
level, logger, message and run, at the level its message deserves. The level table and the
formatters are checked on a table of the daemon's own messages.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sentinel.logs import JsonFormatter, configure, daemon_log, level_of, split_run, unconfigure

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"time", "level", "logger", "message", "run"}


@pytest.fixture(autouse=True)
def _sentinel_logger_restored():
    """configure() changes the process-wide `sentinel` logger: leave it as found for the next tests."""
    logger = logging.getLogger("sentinel")
    before = (list(logger.handlers), logger.level, logger.propagate)
    yield
    unconfigure()
    logger.handlers[:], logger.level, logger.propagate = before[0], before[1], before[2]


@pytest.mark.parametrize("message, level", [
    ("[gpt2-a] PAGE: loss stayed above its band", "ERROR"),
    ("[gpt2-a] SENTINEL CANNOT KEEP UP: 12 step records were trimmed", "ERROR"),
    ("[gpt2-a] could not reach Alertmanager (URLError: 'refused')", "ERROR"),
    ("[gpt2-a] internal error (KeyError), 3 polls in a row: starting afresh", "ERROR"),
    ("[gpt2-a] sent rollback to step 100 (loss spike)", "WARNING"),
    ("[gpt2-a] ack rollback 1a2b3c4d: failed (no checkpoint)", "WARNING"),
    ("[gpt2-a] ack rollback 1a2b3c4d: applied", "INFO"),
    ("[gpt2-a] rejected steps entry (bad_signature): ...", "WARNING"),
    ("control bus error (ConnectionError): refused; retrying in 1.0s", "WARNING"),
    ("WARNING: no --alertmanager-url: pages reach NOBODY.", "WARNING"),
    ("no --alertmanager-url: pages reach NOBODY.", "WARNING"),
    ("[gpt2-a] leader lease acquired by host-1", "INFO"),
    ("watching run gpt2-a", "INFO"),
    # severity is judged from how the message starts, not from a word anywhere in it
    ("[gpt2-a] incident 7 approved by alice (after the PAGE: rollback)", "INFO"),
])  # fmt: skip
def test_level_of_a_daemon_message(message, level):
    assert logging.getLevelName(level_of(message)) == level


def test_json_lines_move_the_run_out_of_the_message_and_keep_exceptions():
    stream = io.StringIO()
    log = daemon_log(configure("json", stream))
    log("[gpt2-a] PAGE: loss stayed up")
    log("watching run gpt2-b")
    log("[gpt2-a] a note", level=logging.ERROR)  # an explicit level wins
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("sentinel.embedded").exception("bus restart failed")
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [(x["level"], x["run"], x["message"]) for x in lines] == [
        ("ERROR", "gpt2-a", "PAGE: loss stayed up"), ("INFO", None, "watching run gpt2-b"),
        ("ERROR", "gpt2-a", "a note"), ("ERROR", None, "bus restart failed")]
    assert lines[0]["logger"] == "sentinel.daemon" and lines[3]["logger"] == "sentinel.embedded"
    assert "ValueError: boom" in lines[3]["exc"]
    assert lines[0]["time"].endswith("Z") and time.strptime(lines[0]["time"][:19], "%Y-%m-%dT%H:%M:%S")
    assert split_run("[a b] x") == (None, "[a b] x")  # a run id has no blank: not a prefix
    configure("text", io.StringIO())  # and back: one handler at a time
    assert sum(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger("sentinel").handlers) == 0


def _sentinel_run(redis_url: str, run: str, tmp_path: Path, args: list[str], env: dict[str, str]) -> list[str]:
    """`sentinel run RUN` until its startup lines are out, then SIGTERM: its stderr lines."""
    err = tmp_path / f"sentinel-{len(list(tmp_path.iterdir()))}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SENTINEL_SECRET": "x" * 32, **env}
    with open(err, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "sentinel", "run", run, "--redis-url", redis_url, *args],
                             cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=f)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "alertmanager" not in err.read_text() and p.poll() is None:
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0, err.read_text()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
    return err.read_text().splitlines()


def test_sentinel_run_writes_one_json_object_per_line(redis_server, unique_run, tmp_path):
    for args, env in ((["--log-format", "json"], {}), ([], {"SENTINEL_LOG_FORMAT": "json"})):
        lines = _sentinel_run(redis_server.url, unique_run, tmp_path, args, env)
        records = [json.loads(x) for x in lines]  # every line parses
        assert all(set(r) == KEYS for r in records), records
        by_level = {r["level"] for r in records}
        assert "INFO" in by_level and "WARNING" in by_level, records  # the no-Alertmanager warning
        assert any(r["message"].startswith("warm stop requested") for r in records), records
        assert records[-1]["message"] == "stopped"


def test_text_format_is_plain_lines_off_a_terminal_and_a_bad_format_is_one_line(redis_server, unique_run, tmp_path):
    lines = _sentinel_run(redis_server.url, unique_run, tmp_path, ["--log-format", "text"], {})
    assert lines and all(" INFO " in x or " WARNING " in x for x in lines), lines
    assert any(" WARNING no --alertmanager-url" in x for x in lines)
    p = subprocess.run([sys.executable, "-m", "sentinel", "run", unique_run, "--redis-url", redis_server.url],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "SENTINEL_LOG_FORMAT": "yaml"},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "SENTINEL_LOG_FORMAT" in p.stderr and "'yaml' is not one of 'text', 'json'" in p.stderr, p.stderr
