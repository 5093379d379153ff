"""Hostile values in the bus's non-stream keys never crash or wedge either side.

Streams are fuzzed in test_fuzz_streams and run-dir files in test_hostile_run_files; this attacks
the other keys of a run (``Keys``): the heartbeat and skip-list strings, the checkpoints,
incidents, applied and info hashes, the leader lease and the run registry set. Each gets values
that are not JSON, JSON of the wrong type, nested 100,000 deep, 1e999 (inf once parsed), integers
no float holds, negative and huge steps, non-UTF-8 bytes, ~1 MB strings, and a key of the wrong
Redis type (WRONGTYPE). Then, against a real Redis (embedded valkey):

* every on-call command that reads the key (click's CliRunner, ``--redis-url``): never a
  traceback; exit 0 showing the good entries, or exit 2 with one ``error:`` line;
* the daemon (``Daemon.iterate``, as tests/daemon/test_daemon drives it): no exception, and it still
  judges the steps and sends its rollback;
* the trainer's bus client, which reads the checkpoints hash back for retention: the step records
  behind it still arrive.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel import bus
from sentinel.cli import main
from sentinel.protocol import CheckpointInfo, Incident, Keys, StepRecord
from tests.helpers.daemon import NAN_STEP, incident_run, make_daemon, pump, sample

pytestmark = pytest.mark.timeout(120)

DEEP = 100_000
HUGE_INT = b"1" + b"0" * 400  # no float holds it; int() of its text is fine, float() overflows
VALUES: dict[str, bytes] = {
    "not-json": b"not json {",
    "number": b"42",
    "list": b"[1, 2]",
    "string": b'"x"',
    "null": b"null",
    "object": b"{}",
    "empty": b"",
    "deep": b"[" * DEEP + b"]" * DEEP,
    "deep-object": b'{"a": ' * DEEP + b"1" + b"}" * DEEP,
    "1e999": b"1e999",
    "huge-int": HUGE_INT,
    "binary": b"\xff\xfe\x00\x80garbage",
    "long": b"x" * 1_000_000,
}
# a good record of each JSON key with its fields made hostile
FIELD_VALUES: dict[str, dict[str, bytes]] = {
    "heartbeat": {
        "time-huge-int": b'{"step": 10, "time": ' + HUGE_INT + b', "sent": ' + HUGE_INT + b', "pid": 1}',
        "time-1e999": b'{"step": 10, "time": 1e999, "sent": -1e999, "pid": 1, "paused": true}',
        "step-huge": b'{"step": ' + HUGE_INT + b', "time": "x", "sent": null}',
        "step-negative": b'{"step": -5, "time": [], "sent": {}, "paused": "yes"}',
        "missing-fields": b'{"pid": 1}',
    },
    "skiplist": {
        "range-1e999": b"[[1e999, 2]]",
        "range-huge": b"[[0, " + HUGE_INT + b"]]",
        "range-negative": b"[[-5, 9]]",
        "range-three": b"[[1, 2, 3]]",
        "range-text": b'[["a", "b"]]',
        "object": b'{"5": 9}',
    },
    "checkpoints": {
        "step-negative": b'{"run": "RUN", "step": -5, "path": "/x", "created": 1, "bytes": 1, "manifest_sha256": "0", "world_size": 1}',
        "created-1e999": b'{"run": "RUN", "step": 10, "path": "/x", "created": 1e999, "bytes": 1, "manifest_sha256": "0", "world_size": 1}',
        "bytes-huge": b'{"run": "RUN", "step": 10, "path": "/x", "created": 1, "bytes": ' + HUGE_INT + b', "manifest_sha256": "0", "world_size": 1}',
        "wrong-run": b'{"run": "other", "step": 10, "path": "/x", "created": 1, "bytes": 1, "manifest_sha256": "0", "world_size": 1}',
        "missing-fields": b'{"run": "RUN"}',
    },
    "incidents": {
        "onset-huge": b'{"id": "RUN-t0-s99", "run": "RUN", "state": "incident", "rule": "x", "onset_step": ' + HUGE_INT + b', "detect_step": 1}',
        "opened-1e999": b'{"id": "RUN-t0-s98", "run": "RUN", "state": "incident", "rule": "x", "onset_step": 1, "detect_step": 1, "opened_at": 1e999}',
        "state-number": b'{"id": "RUN-t0-s97", "run": "RUN", "state": 5, "rule": "x", "onset_step": 1, "detect_step": 1}',
        "missing-fields": b'{"id": "RUN-t0-s96"}',
    },
}
# hostile field *names* of the hashes, next to the good entries
FIELD_NAMES = {"999": "a step", "-5": "a negative step", "9" * 5000: "a step of 5,000 digits", "\xff\xfe": "not UTF-8"}
GOOD_CKPT, GOOD_INCIDENT = 10, "t0-s5"


def _good_run(r, run: str) -> Keys:
    """A run with one good entry in every key: 10 steps, checkpoint 10, one open incident, a heartbeat."""
    k = Keys(run)
    bus.register_run(r, run, {"run_dir": "/nonexistent/elsewhere", "world_size": 1})
    for s in range(1, 11):
        bus.publish(r, k.steps, StepRecord(run=run, step=s, loss=2.0, loss_max_rank=2.0, grad_norm=1.0, lr=1e-3, tokens=s,
                                           batch_fingerprint="x", sample_ids=[s], time=time.time()))
    r.hset(k.checkpoints, str(GOOD_CKPT), CheckpointInfo(run=run, step=GOOD_CKPT, path="/x", created=time.time(), bytes=1,
                                                         manifest_sha256="0", world_size=1).to_json())
    r.hset(k.incidents, f"{run}-{GOOD_INCIDENT}", Incident(id=f"{run}-{GOOD_INCIDENT}", run=run, state="incident",
                                                           rule="loss_spike", onset_step=5, detect_step=5).to_json())
    r.hset(k.applied, "k1", "d1")
    r.set(k.heartbeat, json.dumps({"step": 10, "time": time.time(), "sent": time.time(), "pid": 1}))
    r.set(k.skiplist, "[[5, 9]]")
    return k


def _commands(run: str, url: str) -> dict[str, list[str]]:
    u = ["--redis-url", url]
    return {
        "status": ["status", run, *u], "status --json": ["status", run, "--json", *u], "status (all) --json": ["status", "--json", *u],
        "checkpoints": ["checkpoints", run, *u], "checkpoints --json": ["checkpoints", run, "--json", *u],
        "incidents": ["incidents", run, *u], "incidents --json": ["incidents", run, "--json", *u],
        "incidents (all) --json": ["incidents", "--json", *u],
        "skip-list": ["skip-list", run, "show", *u], "skip-list --json": ["skip-list", run, "show", "--json", *u],
        "rollback --dry-run": ["rollback", run, "--to-step", "10", "--dry-run", "--json", *u],
        "pages --json": ["pages", run, "--json", *u],
        "approve": ["approve", f"{run}-{GOOD_INCIDENT}", *u],  # exit 2: the incident waits for no approval
        "approve hostile": ["approve", "hostile", *u],  # the hostile entry itself, by its field name: one line
    }


READERS = {
    "heartbeat": ("status", "status --json", "status (all) --json", "rollback --dry-run"),
    "skiplist": ("skip-list", "skip-list --json"),
    "checkpoints": ("status --json", "status (all) --json", "checkpoints", "checkpoints --json", "rollback --dry-run"),
    "incidents": ("status --json", "status (all) --json", "incidents", "incidents --json", "incidents (all) --json", "approve",
                  "approve hostile"),
    "applied": ("incidents", "incidents --json"),
    "info": ("status", "status --json", "status (all) --json", "checkpoints --json", "incidents --json", "skip-list --json",
             "rollback --dry-run", "pages --json", "approve"),
}
# (key, where the hostile value goes in a hash)
HASH_FIELD = {"checkpoints": "999", "incidents": "hostile", "applied": "hostile", "info": "run_dir"}


def _problems(results: dict, where: str, *, ok: tuple[str, ...] = ()) -> list[str]:
    """No traceback; exit 0, or exit 2 with exactly one ``error:`` line (commands in ``ok``: exit 0)."""
    out = []
    for name, res in results.items():
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            ours = [f for f in traceback.extract_tb(res.exception.__traceback__) if "/sentinel/" in f.filename]
            at = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
            out.append(f"{where} | {name}: {type(res.exception).__name__}{at}")
            continue
        if "Traceback" in res.output:
            out.append(f"{where} | {name}: traceback in the output")
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        if res.exit_code == 0 or (name not in ok and res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ")):
            continue
        out.append(f"{where} | {name}: exit {res.exit_code}, stderr {res.stderr[-200:]!r}")
    return out


def _good_shown(key: str, run: str, results: dict, where: str) -> list[str]:
    """The good entries next to the hostile one are still what the commands show."""
    def js(name):
        res = results.get(name)
        return json.loads(res.stdout) if res is not None and res.exit_code == 0 else None

    bad = []
    if key == "checkpoints":
        cps = js("checkpoints --json")
        steps = [c["step"] for c in cps["checkpoints"]] if cps else []
        if GOOD_CKPT not in steps:
            bad.append(f"{where} | checkpoints --json lost checkpoint {GOOD_CKPT}: {steps}")
    if key in ("incidents", "applied"):
        inc = js("incidents --json")
        ids = [i["id"] for i in inc["runs"][0]["incidents"]] if inc else []
        if f"{run}-{GOOD_INCIDENT}" not in ids:
            bad.append(f"{where} | incidents --json lost the good incident: {ids[:5]}")
    if key in ("heartbeat", "checkpoints", "incidents", "info"):
        st = js("status --json")
        if not st or st["runs"][0]["step"] != 10:
            bad.append(f"{where} | status --json no longer shows step 10")
        elif key == "incidents" and f"{run}-{GOOD_INCIDENT}" not in st["runs"][0]["open_incident_ids"]:
            bad.append(f"{where} | status --json lost the good open incident")
    return bad


# the views that list a hash's records say what they skipped: --json counts, stderr warns
COUNTED = {"checkpoints": {"checkpoints --json": "checkpoints", "status --json": "runs"},
           "incidents": {"incidents --json": "runs", "status --json": "runs"}}
WARNED = {"checkpoints": "checkpoints", "incidents": "incidents"}


def _counted(key: str, results: dict, where: str, n: int) -> list[str]:
    bad = []
    for cmd, shape in COUNTED[key].items():
        out = json.loads(results[cmd].stdout)
        row = out["runs"][0] if shape == "runs" else out
        first = str(row.get("first_rejected_bus_entry"))
        if row.get("rejected_bus_entries") != n or not first.startswith(f"{key} hash, field ") or len(first) > 80:
            bad.append(f"{where} | {cmd}: skipped entries not counted: {row.get('rejected_bus_entries')} {first[:100]!r}")
    human = results[WARNED[key]]
    if f"skipped {n} malformed entr(y/ies) of the control bus; first: {key} hash, field " not in human.stderr:
        bad.append(f"{where} | {WARNED[key]}: no warning of the skipped entries: {human.stderr[-200:]!r}")
    return bad


def _variants(key: str) -> dict[str, bytes]:
    return {**VALUES, **{n: v.replace(b"RUN", b"%RUN%") for n, v in FIELD_VALUES.get(key, {}).items()}}


@pytest.fixture(autouse=True)
def _no_env_bus(monkeypatch):
    monkeypatch.delenv("SENTINEL_REDIS_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "100")


# ------------------------------------------------------------------ the on-call commands
@pytest.mark.parametrize("key", sorted(READERS))
def test_a_hostile_value_in_a_key_never_crashes_a_command(key, embedded_bus, unique_run):
    """Every hostile value of the key, in turn, next to good entries in every other key. Before the
    fix: a deep heartbeat was a RecursionError (runref.heartbeat) in status, rollback and pause; a
    run_dir too long for the OS (deep, ~1 MB, a 400-digit number) an OSError in every command."""
    r = bus.connect(embedded_bus.url)
    problems: list[str] = []
    for n, (name, value) in enumerate(_variants(key).items()):
        r.flushdb()
        run = f"{unique_run}-{n}"
        k = _good_run(r, run)
        value = value.replace(b"%RUN%", run.encode())
        if key in HASH_FIELD:
            bus.raw(r).hset(getattr(k, key), HASH_FIELD[key], value)
        else:
            bus.raw(r).set(getattr(k, key), value)
        cmds = _commands(run, embedded_bus.url)
        results = {c: CliRunner().invoke(main, cmds[c]) for c in READERS[key]}
        where = f"{key}={name}"
        ok = ("status --json", "status (all) --json", "checkpoints --json", "incidents --json") if key != "skiplist" else ()
        problems += _problems(results, where, ok=ok) or _good_shown(key, run, results, where)
        if name in VALUES and key in COUNTED:  # no record at all: skipped, counted and said
            problems += _counted(key, results, where, 1)
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:40])


@pytest.mark.parametrize("key", sorted(HASH_FIELD))
def test_hostile_field_names_of_a_hash_are_skipped(key, embedded_bus, unique_run):
    """Field names are input too: a negative step, 5,000 digits (int() refuses), not UTF-8."""
    r = bus.connect(embedded_bus.url)
    k = _good_run(r, unique_run)
    for field in FIELD_NAMES:
        bus.raw(r).hset(getattr(k, key), field.encode("latin-1"), b'{"x": 1}')
    cmds = _commands(unique_run, embedded_bus.url)
    results = {c: CliRunner().invoke(main, cmds[c]) for c in READERS[key]}
    problems = _problems(results, f"{key} field names", ok=("status --json", "checkpoints --json", "incidents --json"))
    problems = problems or _good_shown(key, unique_run, results, key)
    if key in COUNTED:  # {"x": 1} is no record: each skipped and counted, its name cut short
        problems += _counted(key, results, f"{key} field names", len(FIELD_NAMES))
    assert not problems, problems


WRONG_TYPE_READERS = {**READERS, "runs": ("status (all) --json", "incidents (all) --json")}


@pytest.mark.parametrize("key", sorted(WRONG_TYPE_READERS))
def test_a_key_of_the_wrong_redis_type_is_one_line_or_skipped(key, embedded_bus, unique_run):
    """WRONGTYPE: a hash where a string goes and the reverse. What a view can do without (the info
    hash, the heartbeat, the checkpoints / incidents / applied hashes) no longer stops it: skipped,
    and for the hashes counted; the rest is one ``error:`` line that says what is wrong."""
    r = bus.connect(embedded_bus.url)
    k = _good_run(r, unique_run)
    name = Keys.RUNS if key == "runs" else getattr(k, key)
    r.delete(name)
    if key in ("heartbeat", "skiplist"):
        r.hset(name, "a", "b")
    else:
        r.set(name, "a string")
    cmds = _commands(unique_run, embedded_bus.url)
    results = {c: CliRunner().invoke(main, cmds[c]) for c in WRONG_TYPE_READERS[key]}
    ok = {"heartbeat": ("status --json",), "info": ("status --json",),
          "checkpoints": ("status --json", "checkpoints", "checkpoints --json"),
          "incidents": ("status --json", "incidents", "incidents --json", "incidents (all) --json"),
          "applied": ("incidents", "incidents --json")}.get(key, ())
    problems = _problems(results, f"{key}=WRONGTYPE", ok=ok)
    for c, res in results.items():
        if res.exit_code == 2 and "approve" not in c and not ("WRONGTYPE" in res.stderr or "wrong Redis type" in res.stderr):
            problems.append(f"{key}=WRONGTYPE | {c}: the error does not say what is wrong: {res.stderr[-200:]!r}")
    if not problems and key in ("checkpoints", "incidents", "applied"):
        for c in ok:
            if c.endswith("--json"):
                out = json.loads(results[c].stdout)
                row = out if c == "checkpoints --json" else out["runs"][0]
                if row["rejected_bus_entries"] != 1 or row["first_rejected_bus_entry"] != f"{key} key, of the wrong Redis type":
                    problems.append(f"{key}=WRONGTYPE | {c}: not counted: {row.get('first_rejected_bus_entry')!r}")
    assert not problems, "\n".join(problems)


def test_hostile_members_of_the_run_registry_are_left_out(embedded_bus, unique_run):
    r = bus.connect(embedded_bus.url)
    _good_run(r, unique_run)
    bus.raw(r).sadd(Keys.RUNS, b"\xff\xfe", b"a b", b"x:y", b"{x}", b"")
    bus.raw(r).sadd(Keys.RUNS, b"[" * 10_000, b"x" * 100_000, b"esc\x1b[31m")  # overlong, control characters: left out too
    bus.raw(r).sadd(Keys.RUNS, b"[" * 200, b"x" * 256)  # odd but valid run ids: listed, with no data
    cmds = _commands(unique_run, embedded_bus.url)
    results = {c: CliRunner().invoke(main, cmds[c]) for c in ("status (all) --json", "incidents (all) --json")}
    # an approval searched for in every run (no --run): a run (sorted first) whose incidents key is a string is looked past
    bus.raw(r).sadd(Keys.RUNS, b"a-wrongtype-run")
    r.set(Keys("a-wrongtype-run").incidents, "a string")
    results["approve"] = CliRunner().invoke(main, cmds["approve"])
    results["status (all)"] = CliRunner().invoke(main, ["status", "--redis-url", embedded_bus.url])
    assert not _problems(results, "runs", ok=tuple(c for c in results if c != "approve")), _problems(results, "runs")
    assert "nothing to approve" in results["approve"].stderr, results["approve"].stderr  # found, past the broken run
    runs = [x["run"] for x in json.loads(results["status (all) --json"].stdout)["runs"]]
    assert unique_run in runs and len(runs) == 3, [x[:20] for x in runs]  # the two valid ids of no run, and ours


# ------------------------------------------------------------------ the daemon
DAEMON_VALUES = ("not-json", "list", "deep", "deep-object", "1e999", "huge-int", "binary", "long")
DAEMON_KEYS = ("heartbeat", "checkpoints", "info", "incidents", "applied", "leader", "runs")


def _plant(r, k: Keys, key: str, value: bytes | None) -> None:
    """Put ``value`` into ``key``; None: a key of the wrong Redis type."""
    name = Keys.RUNS if key == "runs" else getattr(k, key)
    if value is None:
        if key == "runs":  # the registry must stay a set for the daemon to be given its run: hostile members instead
            bus.raw(r).sadd(name, b"\xff", b"a b", b"x" * 100_000)
            return
        r.delete(name)
        r.hset(name, "a", "b") if key in ("heartbeat", "leader") else r.set(name, "a string")
    elif key in ("checkpoints", "incidents", "applied", "info"):
        field = {"checkpoints": "999", "info": "run_dir"}.get(key, "hostile")
        bus.raw(r).hset(name, field, value)
        if key == "checkpoints":
            bus.raw(r).hset(name, "9" * 5000, value)  # and a field name int() refuses
    elif key == "runs":
        bus.raw(r).sadd(name, value[:100_000])
    else:  # a string with no TTL: the leader key would be held forever
        bus.raw(r).set(name, value)


@pytest.mark.parametrize("key", DAEMON_KEYS)
def test_the_daemon_judges_steps_past_a_hostile_key(key, redis_url, unique_run):
    """The daemon keeps iterating and still sends its rollback. Before the fix: a WRONGTYPE
    heartbeat, checkpoints, info, incidents or applied key raised out of every ``iterate`` (the
    daemon logged a bus error and retried forever: the run was never judged again), a too-long
    run_dir was an OSError, and a leader key without a TTL held the lease forever."""
    r = bus.connect(redis_url)  # both servers: the lease script's TYPE / PTTL must hold on each
    failures = []
    for n, name in enumerate((*DAEMON_VALUES, "WRONGTYPE")):
        if key == "checkpoints" and name == "WRONGTYPE":
            continue  # no checkpoint, no rollback: its own test below
        run = f"{unique_run}-{n}"
        k = Keys(run)
        bus.register_run(r, run, {"run_dir": "/nonexistent"})
        d = make_daemon(r, run)
        incident_run(r, run)
        _plant(r, k, key, None if name == "WRONGTYPE" else VALUES[name])
        try:
            pump(d, until=lambda: r.xlen(k.directives) > 0, timeout=15)
        except Exception as e:  # noqa: BLE001 - collect every case, then fail once
            failures.append(f"{key}={name}: {type(e).__name__}: {str(e)[:200]}")
            continue
        if sample(d, "sentinel_steps_processed_total", run=run) != NAN_STEP:
            failures.append(f"{key}={name}: judged {sample(d, 'sentinel_steps_processed_total', run=run)} steps")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("key,script", [("checkpoints", "ours"), ("heartbeat", "ours"), ("checkpoints", "fails")])
def test_a_side_key_of_the_wrong_type_costs_only_its_own_run(key, script, embedded_bus, unique_run, monkeypatch):
    """One daemon, two runs. Every polled run's checkpoints hash and heartbeat are read in one
    script (``sentinel/prefetch.py``). One run's key of another type answers its own WRONGTYPE
    (counted for that run, its steps still judged), and the run beside it still has its checkpoints
    and is rolled back on a NaN. A script the server refuses: the same, read run by run."""
    from sentinel import prefetch
    from tests.helpers.daemon import directives

    if script == "fails":
        monkeypatch.setattr(prefetch, "_SIDE_READS", "return redis.call('NO-SUCH-COMMAND')")
    r = bus.connect(embedded_bus.url)
    run, other = unique_run, unique_run + "-b"
    d = make_daemon(r, run)
    d.fixed_runs.append(other)  # both runs in one daemon: one side-read script for both
    incident_run(r, run)
    incident_run(r, other)
    bad = getattr(Keys(run), key)
    r.delete(bad)
    r.hset(bad, "x", "a hash") if key == "heartbeat" else r.set(bad, "a string")
    pump(d, until=lambda: all(sample(d, "sentinel_steps_processed_total", run=x) == NAN_STEP for x in (run, other)), min_iter=3)
    assert sample(d, "sentinel_rule_fired_total", run=run, rule="nonfinite") == 1  # judged: the NaN step was seen
    assert sample(d, "sentinel_records_rejected_total", run=run, stream=key, reason="wrong_type") >= 1
    assert sample(d, "sentinel_records_rejected_total", run=other, stream=key, reason="wrong_type") == 0
    assert d.watchers[other].checkpoints_seen, "the sibling's checkpoints were read"
    assert [x.kind for x in directives(r, other)][:1] == ["rollback"]


# ------------------------------------------------------------------ the trainer's bus client
@pytest.mark.parametrize("hostile", ["field-names", "WRONGTYPE"])
def test_the_trainers_retention_read_never_holds_back_step_records(hostile, embedded_bus, unique_run):
    """The trainer reads the checkpoints hash back to forget checkpoints retention deleted. Before
    the fix a field of 5,000 digits (int() refuses) or a key of another type raised there on every
    I/O round, before the step records were sent: telemetry stopped for good."""
    from sentinel.client.bus import BusClient
    from tests.helpers.bus import SECRET, step_record, steps_in_stream

    r = bus.connect(embedded_bus.url)
    k = Keys(unique_run)
    if hostile == "WRONGTYPE":
        r.set(k.checkpoints, "a string")
    else:
        bus.raw(r).hset(k.checkpoints, mapping={b"9" * 5000: b"x", b"\xff\xfe": b"x", b"-5": b"x", b"20": b"x", b"5": b"x"})
    c = BusClient(embedded_bus.url, unique_run, SECRET)
    try:
        c.retain_checkpoints([10])
        for s in range(1, 6):
            c.publish_step(step_record(unique_run, s))
        assert c.flush(15), "the step records never left the trainer"
    finally:
        c.close(timeout=0.5)
    assert steps_in_stream(r, unique_run) == [1, 2, 3, 4, 5]
    if hostile != "WRONGTYPE":  # retention did its job on the good fields and left the rest alone
        assert set(bus.raw(r).hkeys(k.checkpoints)) == {b"9" * 5000, b"\xff\xfe", b"-5", b"20"}


@pytest.mark.parametrize("key", ["directives", "events", "acks", "approvals", "steps-at-start", "steps-mid-run"])
def test_a_stream_key_of_the_wrong_type_does_not_stop_the_daemon(key, embedded_bus, unique_run):
    """A string where a stream goes. Before the fix every ``iterate`` raised WRONGTYPE: the run was
    never judged again (steps: one XREADGROUP reads every watched run, so it would stop them all).
    The streams the daemon writes, and the steps stream (no step can be in a string), are replaced;
    acks and approvals are read as empty. Each is counted."""
    r = bus.connect(embedded_bus.url)
    run, k = unique_run, Keys(unique_run)
    name = getattr(k, key.split("-")[0])
    if key == "steps-at-start":
        r.set(name, "a string")
    d = make_daemon(r, run)
    pump(d, until=lambda: d.watchers.get(run) is not None and d.watchers[run].leader, min_iter=2)
    if key == "steps-mid-run":
        r.delete(name)
        r.set(name, "a string")
        pump(d, until=lambda: r.type(name) == "stream", min_iter=2)
    elif not key.startswith("steps"):
        r.set(name, "a string")
    incident_run(r, run)
    pump(d, until=lambda: r.xlen(k.directives) > 0)
    assert sample(d, "sentinel_steps_processed_total", run=run) == NAN_STEP
    stream = key.split("-")[0]
    assert sample(d, "sentinel_records_rejected_total", run=run, stream=stream, reason="wrong_type") >= 1


# ------------------------------------------------------------------ the CLI's views and discovery


def test_one_runs_key_of_the_wrong_type_costs_that_run_not_the_listing(embedded_bus):
    """A steps, acks, events or heartbeat key of the wrong Redis type (anyone with bus access can
    LPUSH) took status and pages down for every run (WRONGTYPE, exit 2). Now the run shows what
    can be read, the skip is counted, and an unreadable heartbeat is no proof of life."""
    r = bus.connect(embedded_bus.url)
    good, bad = "good-run", "wt-run"
    r.sadd(Keys.RUNS, good, bad)
    for key in ("steps", "acks", "events", "heartbeat"):
        r.lpush(getattr(Keys(bad), key), "x")
    out = CliRunner().invoke(main, ["status", "--redis-url", embedded_bus.url, "--json"])
    assert out.exit_code == 0, out.output[-1500:]
    rows = {row["run"]: row for row in json.loads(out.stdout)["runs"]}
    assert set(rows) == {good, bad}
    assert rows[bad]["state"] == "stale" and rows[bad]["rejected_bus_entries"] == 2, rows[bad]  # steps, acks
    out = CliRunner().invoke(main, ["pages", "--redis-url", embedded_bus.url, "--json"])
    assert out.exit_code == 0, out.output[-1500:]
    runs = {p["run"]: p for p in json.loads(out.stdout)["runs"]}
    assert runs[bad]["rejected_bus_entries"] == 1 and runs[good]["pages"] == []


def test_a_hostile_run_id_on_the_registry_is_left_out(embedded_bus):
    """A run id with terminal escapes (or 5000 characters) registered by anyone with bus access
    reached the daemon's log lines raw; ``Keys`` now refuses control characters and overlong ids,
    so discovery leaves them out."""
    r = bus.connect(embedded_bus.url)
    r.sadd(Keys.RUNS, "ok-run", "evil\x1b[31mred", "x" * 5000)
    assert bus.list_runs(r) == ["ok-run"]
    for bad in ("evil\x1b[31mred", "x" * 5000, "tab\there"):
        with pytest.raises(ValueError):
            Keys(bad)
