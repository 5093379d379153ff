"""Hostile inputs to ``sentinel run``: what one bad input (a run's poll, a saved state, a page, an address) did.

Before: one exception in one run's poll (a corrupt saved state, a page that failed in an
unforeseen way, any bug) dropped the step batch of *every* run the daemon watched, for good (the
entries sat unacknowledged and were never read again): a NaN on a healthy sibling run was never
rolled back, and nothing counted it. The saved policy state was taken field by field: a state
name of 5, a timeline ahead of the run or a gate position of 2^62 ended the run's judging in
silence; a list where an incident id goes raised at every poll; a ranges list of 10^12 ids was
expanded into memory.
"""

from __future__ import annotations

import json

import pytest

from sentinel import bus
from sentinel.daemon import Daemon, Options
from sentinel.metrics import SentinelMetrics
from sentinel.protocol import STEP_CONSUMER_GROUP, Keys
from sentinel.rules import parse_rules
from tests.helpers.daemon import RULES, SECRET, publish_steps, pump, register_checkpoints, sample
from tests.helpers.services import talker

pytestmark = pytest.mark.timeout(120)


def _judged(r, run: str) -> bool:
    """A rollback directive for the NaN at step 45, and nothing of the run left pending."""
    k = Keys(run)
    return r.xlen(k.directives) > 0 and r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0


def _daemon(r, runs, consumer="b") -> Daemon:
    logs: list[str] = []
    d = Daemon(r, Options(rules=parse_rules(RULES), secret=SECRET, consumer=consumer), runs=runs,
               metrics=SentinelMetrics(), log=logs.append)
    d.logs = logs  # type: ignore[attr-defined]
    return d


def test_one_runs_failing_poll_costs_the_other_runs_nothing_and_its_own_entries_are_read_again(redis_url, unique_run):
    r = bus.connect(redis_url)
    a, b = f"{unique_run}-a", f"{unique_run}-b"
    for run in (a, b):
        register_checkpoints(r, run)
    d = _daemon(r, [a, b])
    pump(d, until=lambda: all(w.leader for w in d.watchers.values()) and len(d.watchers) == 2)
    wa = d.watchers[a]
    real_read_acks = wa._read_acks

    def broken():  # a bug in run a's poll, after its records were judged (before they are acknowledged)
        raise KeyError("a bug")

    wa._read_acks = broken
    for run in (a, b):
        publish_steps(r, run, range(1, 61), nan_at=45)
    pump(d, until=lambda: _judged(r, b), min_iter=3)
    assert r.xpending(Keys(a).steps, STEP_CONSUMER_GROUP)["pending"] > 0, "run a's entries stay pending, not lost"
    assert sample(d, "sentinel_internal_errors_total", run=a) >= 1
    assert any("internal error (KeyError" in line for line in d.logs)
    wa._read_acks = real_read_acks  # the fault passes: a's pending entries are read again and judged
    pump(d, until=lambda: _judged(r, a), min_iter=2)


def test_a_record_whose_judging_raises_is_skipped_and_counted_not_read_forever(redis_url, unique_run):
    r = bus.connect(redis_url)
    register_checkpoints(r, unique_run)
    d = _daemon(r, [unique_run])
    pump(d, until=lambda: d.watchers.get(unique_run) is not None and d.watchers[unique_run].leader)
    w = d.watchers[unique_run]
    real = w.policy.on_step

    def on_step(rec, *args, **kw):
        if rec.step == 7:
            raise ZeroDivisionError("a record no check foresaw")
        return real(rec, *args, **kw)

    w.policy.on_step = on_step
    publish_steps(r, unique_run, range(1, 61), nan_at=45)
    pump(d, until=lambda: _judged(r, unique_run), min_iter=3)
    assert sample(d, "sentinel_records_rejected_total", run=unique_run, stream="steps", reason="internal_error") == 1


def _corrupt(st: dict, field: str) -> None:
    p, g = st["policy"], st["gate"]
    if field == "state-x":
        p["state"] = "x"
    elif field == "state-5":
        p["state"] = 5
    elif field == "timeline-ahead":
        p["timeline"] = 5
    elif field == "gate-timeline":
        g["timeline"] = 10**30
    elif field == "gate-step":
        g["last_step"] = 2**62
    elif field == "current-int":
        p["current"] = 7
    elif field == "hang-list":
        p["hang"] = ["x"]
    elif field == "samples-huge":
        p["samples"] = [[1, [[0, 10**12]]]]
    elif field == "pattern":
        p["pattern"] = {"a": 1}
    elif field == "suspect-no-episode":
        p["state"], p["current"] = "suspect", None
    else:
        raise AssertionError(field)


@pytest.mark.parametrize("field", ["state-x", "state-5", "timeline-ahead", "gate-timeline", "gate-step", "current-int",
                                   "hang-list", "samples-huge", "pattern", "suspect-no-episode"])
def test_a_saved_policy_state_that_breaks_its_bounds_starts_afresh_counted_and_the_run_is_still_protected(redis_url, unique_run, field):
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    register_checkpoints(r, run)
    d0 = _daemon(r, [run], consumer="z")
    publish_steps(r, run, range(1, 31))
    pump(d0, until=lambda: d0.watchers.get(run) is not None and r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0
         and d0.watchers[run].policy.last_step == 30, min_iter=3)
    for w in d0.watchers.values():
        w.release()
    st = json.loads(r.get(k.policy))
    _corrupt(st, field)
    r.set(k.policy, json.dumps(st))
    d = _daemon(r, [run])
    pump(d, until=lambda: d.watchers.get(run) is not None and d.watchers[run].leader)
    assert any("persisted policy state is unreadable" in line for line in d.logs), d.logs
    assert sample(d, "sentinel_records_rejected_total", run=run, stream="policy", reason="malformed") == 1
    publish_steps(r, run, range(31, 61), nan_at=45)
    pump(d, until=lambda: _judged(r, run), min_iter=3)
    assert sample(d, "sentinel_internal_errors_total", run=run) == 0


def test_a_real_saved_state_mid_incident_still_loads(redis_url, unique_run):
    """The checks take nothing the daemon writes itself: a state saved while an incident is open
    (suspect, then verifying after the rollback) loads as it was."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    register_checkpoints(r, run)
    d0 = _daemon(r, [run], consumer="z")
    publish_steps(r, run, range(1, 47), nan_at=45)
    pump(d0, until=lambda: r.xlen(k.directives) > 0 and r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0, min_iter=3)
    state = d0.watchers[run].policy.state
    assert state != "healthy"
    for w in d0.watchers.values():
        w.release()
    d = _daemon(r, [run])
    pump(d, until=lambda: d.watchers.get(run) is not None and d.watchers[run].leader)
    assert not any("unreadable" in line for line in d.logs), d.logs
    assert d.watchers[run].policy.state == state


def test_a_page_to_an_alertmanager_that_is_no_http_is_still_on_the_bus(redis_url, unique_run):
    """Before: a BadStatusLine from a server that is no HTTP raised out of the poll (the page event
    never written, the batch stranded). Every other hostile answer (none, a trickle, 5xx, a redirect,
    huge lines) is a row of tests/observability/test_hostile_http.py, on the ``Pager`` the daemon calls."""
    import time

    port, stop = talker(b"\x00\xffSSH-2.0-not-http\r\n\r\n")
    url = f"http://127.0.0.1:{port}"
    try:
        r = bus.connect(redis_url)
        run, k = unique_run, Keys(unique_run)
        register_checkpoints(r, run)
        publish_steps(r, run, range(1, 61), nan_at=45)
        logs: list[str] = []
        d = Daemon(r, Options(rules=parse_rules(RULES), secret=SECRET, consumer="x", require_approval=True,
                              alertmanager_url=url), runs=[run], metrics=SentinelMetrics(), log=logs.append)
        t0 = time.monotonic()
        pump(d, until=lambda: any(f.get("kind") == "page" or '"page"' in f.get("json", "") for _, f in r.xrange(k.events))
             and r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0, timeout=30, min_iter=2)
        assert time.monotonic() - t0 < 20
        assert any("could not reach Alertmanager (BadStatusLine" in line for line in logs), logs
        assert sample(d, "sentinel_internal_errors_total", run=run) == 0
    finally:
        stop.set()


def test_an_alertmanager_url_whose_host_is_no_host_name_is_refused_at_the_start():
    from click.testing import CliRunner

    from sentinel.cli import main

    res = CliRunner().invoke(main, ["run", "--alertmanager-url", "http://a..b:9093", "--redis-url", "redis://127.0.0.1:1/0"])
    assert res.exit_code == 2 and "is no valid host name" in res.output and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("host, port", [("a..b", 0), ("a" * 64, 0), ("127.0.0.1", 65536)])
def test_a_metrics_address_that_cannot_be_served_on_is_an_os_error(host, port):
    """Before: a host name IDNA refuses was a UnicodeError traceback (daemon and trainer), and the
    trainer's base port + local rank past 65535 an OverflowError traceback."""
    with pytest.raises(OSError, match="not an address to serve on"):
        SentinelMetrics().serve(host, port)


def test_sentinel_run_with_a_metrics_host_idna_refuses_is_one_line(redis_server, monkeypatch):
    from click.testing import CliRunner

    from sentinel.cli import main

    monkeypatch.setenv("SENTINEL_SECRET", "x" * 32)
    res = CliRunner().invoke(main, ["run", "--redis-url", redis_server.url, "--metrics-port", "0", "--metrics-host", "a..b"])
    lines = [ln for ln in res.output.splitlines() if ln.strip() and "lease" not in ln]
    assert res.exit_code == 2 and lines[-1].startswith("error: cannot serve metrics on 'a..b'"), res.output
    assert "Traceback" not in res.output


def _talker(first: bytes, then: bytes, sent: list[int] | None = None):
    """``talker`` as a bus URL."""
    port, stop = talker(first, then, sent=sent)
    return f"redis://127.0.0.1:{port}/0", stop


@pytest.mark.parametrize("first, then, said", [
    (b"$999999999\r\n", b"A" * 65536, "is not a Redis server: it answered a PING with '$999999999"),  # was: GBs, for good
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", b"", "is not a Redis server: it answered a PING with 'HTTP/1.1 400"),
    pytest.param(b"+", b"A" * 65536, "no answer to PING within 8 s", marks=pytest.mark.slow),  # a line with no end: was 100 % CPU, for good; waits out the 8 s
])
def test_a_bus_url_at_a_server_that_is_no_redis_is_one_line_in_bounded_time(first, then, said):
    import time

    url, stop = _talker(first, then)
    try:
        t0 = time.monotonic()
        with pytest.raises(bus.BusError) as ei:
            bus.connect(url)
        assert said in str(ei.value) and len(str(ei.value)) < 300, str(ei.value)[:400]
        assert time.monotonic() - t0 < 15
    finally:
        stop.set()


@pytest.mark.parametrize("name, said", [
    ("d:x y{z}", "its name is the run id"),  # was: the bus and the trainer started, then a traceback in its log
    ("a\nb", "no quotes or line breaks"),
    ("d_\udcffx", "not valid UTF-8"),  # was: a UnicodeEncodeError traceback writing the bus's config
])
def test_a_demo_run_dir_that_cannot_be_a_run_is_refused_before_anything_starts(tmp_path, name, said):
    from click.testing import CliRunner

    from sentinel.cli import main

    target = f"{tmp_path}/{name}"
    res = CliRunner().invoke(main, ["demo", "--run-dir", target])
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and said in lines[0], res.output
    assert list(tmp_path.iterdir()) == [], "nothing was made"


def test_the_trainers_bus_client_does_not_read_what_a_server_that_is_no_redis_announces(caplog):
    """Before: a trainer pointed at a port where something else answers ``$999999999`` read the
    announced gigabyte into memory at every retry (3.2 GB peak measured, 20 tiny steps)."""
    import logging
    import time

    from sentinel.client.bus import BusClient

    sent: list[int] = []
    url, stop = _talker(b"$999999999\r\n", b"A" * 65536, sent)
    try:
        with caplog.at_level(logging.ERROR, logger="t-not-redis"):
            c = BusClient(url, "r-not-redis", SECRET, logger=logging.getLogger("t-not-redis"), poll_interval_s=0.05)
            try:
                deadline = time.monotonic() + 10
                while not any("is not a Redis server" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                    time.sleep(0.1)
                time.sleep(1.5)  # a few retries
                assert not c.connected
            finally:
                c.close()
        assert sent and max(sent) < 32 << 20, f"the client took {max(sent) >> 20} MiB of what the server announced"
    finally:
        stop.set()


def test_an_alertmanager_behind_basic_auth_gets_the_page_and_the_password_is_never_shown(redis_url, unique_run):
    """``https://user:password@am:9093``: before, urllib read ``user:password@am`` as the host (a
    nonnumeric-port error with the password in the daemon's log line, and no page delivered)."""
    import base64
    import http.server
    import threading

    got: list[tuple[str, str | None]] = []

    class AM(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            got.append((self.path, self.headers.get("Authorization")))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), AM)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = bus.connect(redis_url)
        run = unique_run
        register_checkpoints(r, run)
        publish_steps(r, run, range(1, 61), nan_at=45)
        logs: list[str] = []
        url = f"http://pager%40corp:s3cr3t%2Fpw@127.0.0.1:{srv.server_address[1]}"
        d = Daemon(r, Options(rules=parse_rules(RULES), secret=SECRET, consumer="x", require_approval=True,
                              alertmanager_url=url), runs=[run], metrics=SentinelMetrics(), log=logs.append)
        pump(d, until=lambda: bool(got), min_iter=2)
        assert got[0] == ("/api/v2/alerts", "Basic " + base64.b64encode(b"pager@corp:s3cr3t/pw").decode())
        assert not any("s3cr3t" in line for line in logs)
    finally:
        srv.shutdown()

    from click.testing import CliRunner

    from sentinel.cli import main

    res = CliRunner().invoke(main, ["run", "--alertmanager-url", "http://bob:hunter2@a..b:9093"])
    assert res.exit_code == 2 and "bob:***@a..b" in res.output and "hunter2" not in res.output, res.output


def test_a_checkpoints_hash_lost_whole_keeps_the_known_targets_until_the_trainer_registers_again(redis_url, unique_run):
    """The bus lost its data (FLUSHALL) and damage came before the trainer's next heartbeat put its
    checkpoints back: before, every known checkpoint was forgotten at once and the NaN got a pause
    instead of a rollback (1 run in 6 of test_a_flushall_mid_run..., under load more)."""
    r = bus.connect(redis_url)
    run, k = unique_run, Keys(unique_run)
    register_checkpoints(r, run)
    d = _daemon(r, [run])
    publish_steps(r, run, range(1, 31))
    pump(d, until=lambda: d.watchers.get(run) is not None and d.watchers[run].policy.last_step == 30, min_iter=3)
    r.delete(k.checkpoints)  # the whole hash: retention never drops the newest, so this is lost data
    publish_steps(r, run, range(31, 61), nan_at=45)
    pump(d, until=lambda: _judged(r, run), min_iter=3)
    from tests.helpers.daemon import TARGET, directives

    assert [(x.kind, x.to_step) for x in directives(r, run)][:1] == [("rollback", TARGET)]
    assert any("holds no checkpoint entry any more" in line for line in d.logs)


def test_after_three_failing_polls_the_fresh_policy_knows_the_checkpoints_and_still_rolls_back(redis_url, unique_run):
    r = bus.connect(redis_url)
    run = unique_run
    register_checkpoints(r, run)
    d = _daemon(r, [run])
    pump(d, until=lambda: d.watchers.get(run) is not None and d.watchers[run].leader)
    w = d.watchers[run]
    real = w._read_acks

    def broken():
        raise KeyError("a persistent bug")

    w._read_acks = broken
    publish_steps(r, run, range(1, 31))
    pump(d, until=lambda: any("starting this run's policy state afresh" in line for line in d.logs), min_iter=3)
    w._read_acks = real
    publish_steps(r, run, range(31, 61), nan_at=45)
    pump(d, until=lambda: _judged(r, run), min_iter=3)
    from tests.helpers.daemon import TARGET, directives

    assert [(x.kind, x.to_step) for x in directives(r, run)][:1] == [("rollback", TARGET)]
