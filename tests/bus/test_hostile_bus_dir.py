"""Hostile, stale or malformed files in RUN_DIR/bus/, the embedded bus's own directory.

Before: a stale ``server.pid`` naming any process with "redis" in its command line (the trainer's
own ``--redis-url embedded``, a bystander, another run's bus) was taken for the run's bus:
``stop_embedded`` sent it SIGTERM; a ``bus/password`` replaced while the bus ran made the next
start take the live bus for a foreign one and start a second server on the same data (split brain,
writes lost from the AOF); an empty or dangling-link password file gave a bus with no password; a
FIFO at ``bus/url`` or ``bus/server.pid`` hung every start for good; a malformed ``bus/url`` was a
traceback in every client; a restart that raised anything but BusError ended ``sentinel run``;
``_make_private`` chmodded files outside ``bus/`` through links.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from sentinel import bus
from sentinel.embedded import bus_dir, ensure_embedded, restart_if_dead, stop_embedded

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    yield d
    try:
        stop_embedded(d)
    except bus.BusError:
        pass


def _servers_on(d) -> list[int]:
    """Pids of valkey/redis servers whose working directory is ``d/bus``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.path.samefile(f"/proc/{pid}/cwd", bus_dir(d)):
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                if b"valkey" in cmd or b"redis" in cmd:
                    out.append(int(pid))
        except OSError:
            continue
    return out


def test_a_stale_pid_file_naming_a_bystander_never_gets_it_signalled(run_dir):
    ensure_embedded(run_dir)
    stop_embedded(run_dir)
    # a process whose command line says "redis" (as the trainer's own --redis-url embedded does)
    victim = subprocess.Popen(["bash", "-c", "exec -a 'python -m trainer --redis-url embedded' sleep 60"])
    try:
        time.sleep(0.2)
        (bus_dir(run_dir) / "server.pid").write_text(f"{victim.pid}\n")
        t0 = time.monotonic()
        assert stop_embedded(run_dir) is False
        assert victim.poll() is None, "the bystander was signalled"
        ensure_embedded(run_dir)
        assert time.monotonic() - t0 < 10 and victim.poll() is None
    finally:
        victim.kill()


def test_a_password_replaced_while_the_bus_runs_never_gets_a_second_server_on_the_same_data(run_dir):
    ensure_embedded(run_dir)
    (bus_dir(run_dir) / "password").write_text("another-password\n")
    with pytest.raises(bus.BusError, match="refuses the password in .*kill"):
        ensure_embedded(run_dir)
    assert len(_servers_on(run_dir)) == 1


@pytest.mark.parametrize("how", ["empty", "dangling-link"])
def test_a_password_file_that_holds_none_never_gives_a_bus_without_a_password(run_dir, tmp_path, how):
    ensure_embedded(run_dir)
    stop_embedded(run_dir)
    pw = bus_dir(run_dir) / "password"
    pw.unlink()
    if how == "empty":
        pw.write_text("")
        url = ensure_embedded(run_dir)
        assert len(pw.read_text().strip()) == 64, "a new password was made"
        port = url.rsplit(":", 1)[1].split("/")[0]
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=int(port)).ping()
    else:
        pw.symlink_to(tmp_path / "nowhere")
        with pytest.raises(bus.BusError, match="is a symbolic link"):
            ensure_embedded(run_dir)


@pytest.mark.parametrize("name", ["url", "server.pid"])
def test_a_fifo_in_the_bus_dir_never_hangs_a_start_a_restart_or_a_stop(run_dir, name):
    ensure_embedded(run_dir)
    stop_embedded(run_dir)
    f = bus_dir(run_dir) / name
    f.unlink(missing_ok=True)
    os.mkfifo(f)
    code = ("import sys\nfrom sentinel.embedded import ensure_embedded, restart_if_dead, stop_embedded\n"
            "from sentinel.bus import BusError\nfor fn in (ensure_embedded, restart_if_dead, stop_embedded):\n"
            "    try:\n        fn(sys.argv[1])\n    except BusError as e:\n        print('error:', e)\n")
    p = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-1500:]
    if name == "url":
        assert "is unreadable (not a regular file" in p.stdout


@pytest.mark.parametrize("text", ["redis://127.0.0.1:99999/0\n", "redis://127.0.0.1:abc/0\n", "\xff\xfe\n",
                                  "redis://[::1/0\n"])
def test_a_malformed_bus_url_is_written_again_by_a_start_and_one_line_for_a_client(run_dir, text):
    ensure_embedded(run_dir)
    stop_embedded(run_dir)
    url_file = bus_dir(run_dir) / "url"
    url_file.write_bytes(text.encode("utf-8", "surrogateescape") if text != "\xff\xfe\n" else b"\xff\xfe\n")
    with pytest.raises(bus.BusError):  # a client of the run dir: one line, not a ValueError traceback
        bus.connect(bus.resolve_url(run_dir))
    url = ensure_embedded(run_dir)
    assert bus.connect(url).ping()
    url2, restarted = restart_if_dead(run_dir)
    assert restarted is False and url2 == url


def test_a_restart_that_raises_anything_is_logged_and_the_fleet_goes_on(run_dir, monkeypatch):
    from sentinel import embedded
    from sentinel.daemon import Daemon, Options
    from sentinel.fleet import Fleet, Member
    from sentinel.metrics import SentinelMetrics
    from sentinel.rules import default_rules

    url = ensure_embedded(run_dir)
    m = SentinelMetrics()
    d = Daemon(bus.connect(url), Options(rules=default_rules(), secret=b"s" * 32), runs=["run"], metrics=m, log=lambda s: None)
    logs: list[str] = []
    fleet = Fleet([Member(d, url, run_dir)], m, logs.append)

    def full_disk(_run_dir, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(embedded, "restart_if_dead", full_disk)
    fleet._supervise(fleet.members[0])
    assert any("could not restart the embedded bus" in line and "No space left" in line for line in logs), logs


def test_make_private_never_changes_a_file_outside_the_bus_dir(run_dir, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    outside.chmod(0o644)
    ensure_embedded(run_dir)
    (bus_dir(run_dir) / "link-out").symlink_to(outside)
    stop_embedded(run_dir)
    ensure_embedded(run_dir)
    assert outside.stat().st_mode & 0o777 == 0o644


def test_a_starting_server_is_not_taken_for_dead_while_its_title_changes(tmp_path):
    """CI once failed on "embedded bus did not start": the fresh pid file named a live server that
    was rewriting its process title, and a read in between (no program name) was taken for death.
    Only a pid file whose process is gone means "died"; a live one is waited on, and so is a pid file
    still empty (the server created it and has not written its pid yet: read as "gone", that failed
    starts under a loaded suite)."""
    from sentinel import embedded

    d = tmp_path / "bus"
    d.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # no server's name
    try:
        (d / embedded.PID_FILE).write_text(f"{alive.pid}\n")
        started = time.time()
        assert embedded._wait_ready("redis://127.0.0.1:1/0", d, 0.5, started) == "timeout"
    finally:
        alive.kill()
        alive.wait()
    (d / embedded.PID_FILE).write_text("")  # created, not yet written
    assert embedded._wait_ready("redis://127.0.0.1:1/0", d, 0.5, time.time()) == "timeout"
    (d / embedded.PID_FILE).write_text(f"{alive.pid}\n")  # now gone (reaped)
    assert embedded._wait_ready("redis://127.0.0.1:1/0", d, 5.0, time.time()) == "died"


def test_a_password_file_with_a_line_break_is_refused_without_showing_it(run_dir):
    """Before: the server's config line broke and its error, which the start raised, quoted the
    password's first line. Now one line names the file and what is wrong with it, never the password."""
    d = bus_dir(run_dir)
    d.mkdir(mode=0o700)
    (d / "password").write_text("hunter2-first-line\nhunter2-second-line\n")
    (d / "password").chmod(0o600)
    with pytest.raises(bus.BusError) as e:
        ensure_embedded(run_dir)
    said = str(e.value)
    assert "hunter2" not in said and "line break" in said and str(d / "password") in said, said
    assert not _servers_on(run_dir)


def test_the_server_s_own_error_text_never_carries_the_password(run_dir):
    from sentinel import embedded

    d = bus_dir(run_dir)
    ensure_embedded(run_dir)
    pw = embedded.read_password(d)
    assert pw and embedded._hide_password(f"line 4 >>> 'requirepass \"{pw}' Bad directive", d) == \
        "line 4 >>> 'requirepass \"***' Bad directive"


def test_an_aof_cut_short_is_loaded_with_one_warning(run_dir, caplog):
    """Before: a bus whose AOF was cut mid-write (a crash, a full disk) loaded what it held and said so
    only in its own log. Now its start warns once, naming the file and the offset."""
    import logging

    url = ensure_embedded(run_dir)
    r = bus.connect(url)
    for _ in range(100):
        r.xadd("s", {"json": "x" * 100})
    r.close()
    stop_embedded(run_dir)
    incr = next((bus_dir(run_dir) / "appendonlydir").glob("*.incr.aof"))
    os.truncate(incr, incr.stat().st_size - 37)  # the last entry, half written
    with caplog.at_level(logging.WARNING, logger="sentinel.embedded"):
        r = bus.connect(ensure_embedded(run_dir))
    assert r.xlen("s") == 99
    said = [rec.getMessage() for rec in caplog.records if rec.name == "sentinel.embedded"]
    assert len(said) == 1 and "cut short" in said[0] and incr.name in said[0], said
    caplog.clear()
    stop_embedded(run_dir)
    with caplog.at_level(logging.WARNING, logger="sentinel.embedded"):
        ensure_embedded(run_dir)  # the server repaired it: the next start is quiet
    assert not [rec for rec in caplog.records if rec.name == "sentinel.embedded"]


def _squat(port: int):
    """A stranger that takes a dead bus's port and keeps every byte sent to it."""
    import socket
    import threading

    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(64)
    s.settimeout(0.1)
    got: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                c, _ = s.accept()
            except OSError:
                continue
            c.settimeout(0.5)
            try:
                got.append(c.recv(4096))
            except OSError:
                pass
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    def close():
        stop.set()
        t.join(5)
        s.close()
        return b"".join(got)

    return close


def test_a_stranger_on_a_dead_bus_s_port_never_gets_its_password(run_dir):
    """Before: once the bus died, any local process that took its port got the bus password in the
    AUTH of every client that reconnected (the trainer, the daemon, the CLI). Now a connection to an
    embedded bus checks who listens before it sends a byte, and the supervisor restarts the bus on
    another port."""
    import logging

    from sentinel import embedded
    from sentinel.client.bus import BusClient
    from sentinel.protocol import Keys, StepRecord

    d = bus_dir(run_dir)
    url = ensure_embedded(run_dir)
    password = embedded.read_password(d).encode()
    old = bus.connect(url)
    port = embedded._url_port(url)
    stop_embedded(run_dir)
    close = _squat(port)
    client = None
    try:
        with pytest.raises(redis.ConnectionError, match="not its server"):
            old.ping()  # a client that was connected reconnects
        with pytest.raises(bus.BusError):  # a command of the CLI (the stranger's answer to PING may say it first)
            bus.connect(bus.resolve_url(run_dir))
        client = BusClient(url, "squat", b"s" * 32, logger=logging.getLogger("test.squat"), io_timeout_s=0.5,
                           reconnect=lambda: ensure_embedded(run_dir))  # the trainer, still on the old URL
        for s in range(1, 6):  # the trainer's client goes on, and its supervisor restarts the bus
            client.publish_step(StepRecord(run="squat", step=s, timeline=0, loss=2.0, loss_max_rank=2.0, grad_norm=1.0,
                                           lr=1e-3, tokens=s, batch_fingerprint="f", time=time.time()))
        new_url, _ = restart_if_dead(run_dir)  # the daemon's supervisor, or the trainer's got there first
        assert embedded._url_port(new_url) != port
        new = bus.connect(new_url)
        deadline = time.monotonic() + 60
        while new.xlen(Keys("squat").steps) < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert new.xlen(Keys("squat").steps) == 5  # every record reached the bus on its new port
    finally:
        if client is not None:
            client.close()
        received = close()
    assert received, "the stranger saw no connection at all: the test tested nothing"
    assert password not in received and b"AUTH" not in received.upper(), received[:200]


def test_the_bus_is_known_as_its_own_without_its_pid_file(run_dir):
    """The owner check finds the server that holds the port when the pid file is gone: taking a live
    bus of ours for a stranger would start a second server on the same data."""
    d = bus_dir(run_dir)
    url = ensure_embedded(run_dir)
    pid = _servers_on(run_dir)
    assert len(pid) == 1
    (d / "server.pid").rename(d / "server.pid.away")
    try:
        assert ensure_embedded(run_dir) == url
        assert _servers_on(run_dir) == pid
    finally:
        (d / "server.pid.away").rename(d / "server.pid")
