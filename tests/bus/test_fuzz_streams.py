"""Fuzz every stream reader with hypothesis-generated entries, on a real embedded valkey bus.

Readers under test: the daemon's step-stream reader (``Daemon.iterate`` -> ``StepGate``), its ack
and approval readers, the trainer's directive reader (``BusClient.poll_directives``) and the
protocol parsers every other reader (CLI, events) goes through. For each generated batch of
hostile entries followed by one genuine record, the invariant is the same:

* nothing raises (no crash), nothing stays pending (every entry XACKed / passed: no re-read);
* every hostile entry is counted under one reason from ``REJECT_REASONS``;
* the genuine record behind them still gets through (no wedge).

Examples per property: a CI-sized default; ``SENTINEL_CHAOS_LONG=1`` runs 20x more.
"""

from __future__ import annotations

import json
import os
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest

from sentinel import bus
from sentinel.daemon import Daemon, Options
from sentinel.metrics import SentinelMetrics
from sentinel.protocol import (
    MAX_STEP,
    MAX_TIMELINE,
    REJECT_REASONS,
    STEP_CONSUMER_GROUP,
    Ack,
    Directive,
    Event,
    Keys,
    SchemaError,
    StepRecord,
    TimelineRecord,
    parse_step_line,
    record_mac,
)
from sentinel.rules import default_rules

pytestmark = pytest.mark.timeout(900)

LONG = os.environ.get("SENTINEL_CHAOS_LONG") == "1"
EXAMPLES = 400 if LONG else 20
SECRET = b"fuzz-secret-0123456789abcdef"
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------ payload strategies

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                       st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
_json = st.recursive(_json_leaf, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
                     max_leaves=20)


def _step_like(run: str) -> st.SearchStrategy[dict]:
    """Records that look like a StepRecord with one or more fields replaced by hostile values."""
    base = {"kind": "step", "run": run, "step": 5, "timeline": 0, "loss": 2.5, "loss_max_rank": 2.6, "grad_norm": 1.0,
            "lr": 3e-4, "tokens": 1024, "batch_fingerprint": "ab", "sample_ids": [1, 2], "time": time.time()}
    hostile = st.one_of(_json, st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -1.0, -5, 2**64, "1", [], {}]))
    return st.dictionaries(st.sampled_from(sorted(base) + ["v", "world_size", "phases", "rank_losses"]), hostile,
                           min_size=1, max_size=3).map(lambda over: {**base, **over})


def _deep(n: int) -> str:
    return '{"a":' * n + "1" + "}" * n


def _payloads(run: str) -> st.SearchStrategy[bytes]:
    """A raw ``json`` field value: junk bytes, JSON of any shape, hostile step-like records, deep nesting."""
    as_json = lambda o: json.dumps(o, allow_nan=True).encode()  # noqa: E731
    return st.one_of(
        st.binary(max_size=64),
        _json.map(as_json),
        _step_like(run).map(as_json),
        st.integers(min_value=20, max_value=100_000).map(lambda n: _deep(n).encode()),
        st.just(b'{"v": "abc"}'), st.just(b'{"v": null}'), st.just(b'{"v": []}'),
        st.binary(min_size=1, max_size=16).map(lambda b: b"\xff\xfe" + b),  # never UTF-8
    )


def _entry_fields(run: str, stream: str) -> st.SearchStrategy[dict[bytes, bytes]]:
    """Fields of one hostile entry: a payload under ``json`` (MAC'd correctly or not), or odd field names."""

    def build(payload: bytes, how: str, extra: bytes) -> dict[bytes, bytes]:
        if how == "no_json":
            return {extra or b"v": payload}
        fields = {b"json": payload}
        if how == "mac_ok":  # authentic but hostile content: the gate must still refuse it
            try:
                fields[b"mac"] = record_mac(SECRET, stream, payload.decode()).encode()
            except UnicodeDecodeError:
                fields[b"mac"] = b"00"
        elif how == "mac_bad":
            fields[b"mac"] = extra or b"\xff"
        elif how == "bad_name":
            fields[b"\xff" + extra] = b"x"
        return fields

    return st.builds(build, _payloads(run), st.sampled_from(["no_mac", "mac_ok", "mac_bad", "no_json", "bad_name"]),
                     st.binary(max_size=8))


def _raw(url: str):
    return bus.connect(url, decode=False)


# ------------------------------------------------------------------ daemon: step stream


def _daemon(r, run: str) -> Daemon:
    opts = Options(rules=default_rules(), secret=SECRET, consumer=f"fuzz-{uuid.uuid4().hex[:6]}", lease_ms=30_000)
    return Daemon(r, opts, runs=[run], metrics=SentinelMetrics(), log=lambda _m: None)


def _watched_run(url: str):
    """A fresh run id, its keys, a text and a bytes client, and a daemon that leads it already."""
    run = f"fz-{uuid.uuid4().hex[:10]}"
    r = bus.connect(url)
    d = _daemon(r, run)
    _pump(d, 2)  # leader, group created
    return run, Keys(run), r, _raw(url), d


def _rejected(d: Daemon, run: str, stream: str) -> float:
    return sum(d.m.registry.get_sample_value("sentinel_records_rejected_total", {"run": run, "stream": stream, "reason": why}) or 0
               for why in REJECT_REASONS)


def _pump(d: Daemon, n: int = 6) -> None:
    for _ in range(n):
        d.iterate(block_ms=10)


def _good_step(run: str, step: int, timeline: int = 0) -> StepRecord:
    return StepRecord(run=run, step=step, timeline=timeline, loss=2.5, loss_max_rank=2.6, grad_norm=1.0, lr=3e-4,
                      tokens=step * 64, batch_fingerprint="fp", sample_ids=[step], time=time.time())


@FUZZ
@given(data=st.data())
def test_fuzz_daemon_step_reader(embedded_bus, data):
    run, k, r, raw, d = _watched_run(embedded_bus.url)
    hostile = data.draw(st.lists(_entry_fields(run, k.steps), min_size=1, max_size=6))
    for fields in hostile:
        raw.xadd(k.steps, fields)
    # behind the junk, and above any step/timeline the junk could have set: must still be processed
    bus.publish(r, k.steps, _good_step(run, MAX_STEP, MAX_TIMELINE), secret=SECRET)
    _pump(d)
    processed = d.m.registry.get_sample_value("sentinel_steps_processed_total", {"run": run}) or 0
    assert processed + _rejected(d, run, "steps") == len(hostile) + 1
    assert d.watchers[run].policy.last_step == MAX_STEP, "the genuine record behind the junk was not processed (wedged)"
    assert r.xpending(k.steps, STEP_CONSUMER_GROUP)["pending"] == 0  # all XACKed: a restart re-reads nothing
    # a restarted daemon (same consumer) has nothing to re-read and does not crash
    d2 = Daemon(r, d.opts, runs=[run], metrics=SentinelMetrics(), log=lambda _m: None)
    d.watchers[run].release()
    _pump(d2, 3)
    assert (d2.m.registry.get_sample_value("sentinel_steps_processed_total", {"run": run}) or 0) == 0
    generate_latest(d.m.registry)  # the metrics still render


@FUZZ
@given(data=st.data())
def test_fuzz_daemon_ack_and_approval_readers(embedded_bus, data):
    run, k, r, raw, d = _watched_run(embedded_bus.url)
    acks = data.draw(st.lists(_entry_fields(run, k.acks), min_size=1, max_size=5))
    approvals = data.draw(st.lists(_entry_fields(run, k.approvals), min_size=1, max_size=5))
    for f in acks:
        raw.xadd(k.acks, f)
    for f in approvals:
        raw.xadd(k.approvals, f)
    good = Ack(run=run, directive_id="d1", kind="pause", status="applied", step=1)
    bus.publish(r, k.acks, good, secret=SECRET)
    _pump(d, 3)
    w = d.watchers[run]
    assert w.acks_id == r.xrevrange(k.acks, count=1)[0][0]  # read to the end, junk included
    assert _rejected(d, run, "acks") == len(acks)  # every hostile ack refused; the genuine one was not
    assert _rejected(d, run, "approvals") == len(approvals)


# ------------------------------------------------------------------ trainer: directive stream


@FUZZ
@given(data=st.data())
def test_fuzz_trainer_directive_reader(embedded_bus, data, tmp_path_factory):
    from sentinel.client.bus import BusClient

    run = f"fz-{uuid.uuid4().hex[:10]}"
    k = Keys(run)
    r = bus.connect(embedded_bus.url)
    raw = _raw(embedded_bus.url)
    hostile = data.draw(st.lists(_entry_fields(run, k.directives), min_size=1, max_size=6))
    for f in hostile:
        raw.xadd(k.directives, f)
    good = Directive(run=run, kind="pause").signed(SECRET)
    bus.publish(r, k.directives, good)
    cursor = tmp_path_factory.mktemp("cur") / "directives.cursor"
    c = BusClient(embedded_bus.url, run, SECRET, cursor_file=cursor, poll_interval_s=0.01)
    try:
        got, deadline = [], time.monotonic() + 30
        while not got and time.monotonic() < deadline:
            got += c.poll_directives()
            time.sleep(0.01)
        assert [x.id for x in got] == [good.id]
        assert c.rejected == len(hostile) and set(c.rejected_by_reason) <= set(REJECT_REASONS)
        assert c.flush(10)
        assert r.xlen(k.acks) == len(hostile)  # each rejection acked once, nothing re-sent
        c.poll_directives()  # the caller handled `good`: the cursor now covers it
    finally:
        c.close()
    # a restart resumes after the cursor: nothing is rejected (or delivered) twice
    c2 = BusClient(embedded_bus.url, run, SECRET, cursor_file=cursor, poll_interval_s=0.01)
    try:
        time.sleep(0.2)
        assert c2.poll_directives() == [] and c2.rejected == 0
    finally:
        c2.close()


# ------------------------------------------------------------------ pure parsers (events, CLI readers)


@settings(max_examples=EXAMPLES * 25, deadline=None)
@given(payload=_payloads("r1"))
def test_fuzz_parsers_raise_only_schema_errors(payload):
    for parse in (parse_step_line, Event.from_json, Ack.from_json, Directive.from_json, TimelineRecord.from_json):
        try:
            rec = parse(payload)
        except SchemaError as e:
            assert e.reason in REJECT_REASONS
            continue
        rec.to_json()  # whatever parses also serialises


@settings(max_examples=EXAMPLES * 10, deadline=None)
@given(fields=_entry_fields("r1", Keys("r1").events))
def test_fuzz_bus_decode_of_raw_entries(fields):
    e = bus.to_entry(Keys("r1").events, b"1-1", fields)
    try:
        ev = bus.decode(e)
    except SchemaError as err:
        assert err.reason in REJECT_REASONS
        return
    assert isinstance(ev, Event)
