"""``sentinel run --workers K``: the runs shared by a hash of their id, one metrics endpoint, a
supervisor that restarts a dead worker, passes signals on and gives up on a worker that cannot start.

One real supervisor with two workers on a real redis-server (password-protected) serves most of the
assertions: each run judged by the worker its id hashes to, the merged ``/metrics`` labelled by
worker, no password in any worker's command line, a worker killed and started again with its
leases, a warm stop that releases every lease. A second one, with no run named (each worker
discovers its share), is killed outright: its workers stop themselves.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sentinel import bus
from sentinel.cli.run_cmd import run as run_cmd
from sentinel.client.bus import BusClient
from sentinel.client.metrics import MetricsRegistry
from sentinel.protocol import Keys
from sentinel.shards import in_shard, parse_shard, shard_of
from sentinel.workers_metrics import WorkersCollector, merge
from tests.helpers.bus import SECRET, poll, step_record

PAGE_A = """# HELP sentinel_steps_processed_total Step records processed.
# TYPE sentinel_steps_processed_total counter
sentinel_steps_processed_total{run="a"} 3.0
# HELP sentinel_verdict_latency_seconds v
# TYPE sentinel_verdict_latency_seconds histogram
sentinel_verdict_latency_seconds_bucket{le="0.05"} 2.0
sentinel_verdict_latency_seconds_bucket{le="+Inf"} 3.0
sentinel_verdict_latency_seconds_count 3.0
sentinel_verdict_latency_seconds_sum 0.2
"""
PAGE_B = PAGE_A.replace('run="a"} 3.0', 'run="b"} 5.0').replace("le=\"+Inf\"} 3.0", "le=\"+Inf\"} 4.0")


# ---------------------------------------------------------------------------------------- the share of runs
def test_a_runs_share_is_stable_and_even():
    names = [f"run-{i:04d}" for i in range(300)]
    shares = [shard_of(n, 2) for n in names]
    assert shares == [shard_of(n, 2) for n in reversed(names)][::-1]  # the order runs are named in does not matter
    assert 120 <= shares.count(0) <= 180
    assert all(shard_of(n, 1) == 0 and in_shard(n, (0, 1)) for n in names)
    assert sum(in_shard(n, (i, 3)) for n in names for i in range(3)) == 300  # each run in exactly one share
    # pinned: a change of the hash would move every fleet's runs to other workers on upgrade
    assert [shard_of(f"run-{i:04d}", 2) for i in range(6)] == [1, 1, 1, 1, 0, 0]
    assert [shard_of(f"run-{i:04d}", 3) for i in range(6)] == [1, 2, 0, 2, 2, 1] and shard_of("ünïcode-run", 4) == 0


@pytest.mark.parametrize("text, ok", [("0/2", (0, 2)), ("1/2", (1, 2)), ("63/64", (63, 64)), ("0/1", (0, 1)),
                                      ("2/2", None), ("0/0", None), ("0/65", None), ("-1/2", None), ("1", None),
                                      ("a/b", None), ("", None), ("1/2/3", None), (" 0/2", None)])
def test_a_worker_index_is_read_strictly(text, ok):
    if ok is None:
        with pytest.raises(ValueError):
            parse_shard(text)
    else:
        assert parse_shard(text) == ok


# ---------------------------------------------------------------------------------------- one metrics page
def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


@pytest.mark.parametrize("pages, up", [
    ({"0": PAGE_A, "1": PAGE_B}, {"0": 1.0, "1": 1.0}),
    ({"0": PAGE_A, "1": None}, {"0": 1.0, "1": 0.0}),  # not answering (restarting, stuck)
    ({"0": PAGE_A, "1": "not { an exposition"}, {"0": 1.0, "1": 0.0}),  # garbled: read as down, not half-merged
    ({"0": None, "1": None}, {"0": 0.0, "1": 0.0}),
])
def test_the_supervisor_serves_every_workers_series_labelled_with_its_worker(pages, up):
    registry = MetricsRegistry()
    registry.register(WorkersCollector(lambda: {w: 9000 + int(w) for w in pages}, lambda: {"0": 0, "1": 2},
                                       fetcher=lambda port: pages[str(port - 9000)]))
    fams = _families(generate_latest(registry).decode())
    assert {s.labels["worker"]: s.value for s in fams["sentinel_worker_up"].samples} == up
    assert {s.labels["worker"]: s.value for s in fams["sentinel_worker_restarts"].samples} == {"0": 0.0, "1": 2.0}
    steps = {(s.labels["run"], s.labels["worker"]): s.value for s in fams.get("sentinel_steps_processed", _Empty).samples}
    assert steps == {k: v for k, v in {("a", "0"): 3.0, ("b", "1"): 5.0}.items() if up[k[1]]}
    inf = {s.labels["worker"]: s.value for s in fams.get("sentinel_verdict_latency_seconds", _Empty).samples
           if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"}
    assert inf == {w: v for w, v in {"0": 3.0, "1": 4.0}.items() if up[w]}  # one series a worker: a query sums them


class _Empty:
    samples: tuple = ()


def test_a_family_two_workers_disagree_on_is_not_mixed():
    other = "# TYPE sentinel_steps_processed_total gauge\nsentinel_steps_processed_total{run=\"b\"} 1.0\n"
    fams = {f.name: f for f in merge({"0": PAGE_A, "1": other})}
    assert [s.labels for s in fams["sentinel_steps_processed"].samples] == [{"run": "a", "worker": "0"}]


def test_bad_settings_are_refused_before_any_worker_starts(tmp_path: Path):
    res = CliRunner().invoke(run_cmd, ["r1", "--workers", "2", "--rules", str(tmp_path / "missing.yaml"),
                                       "--redis-url", "redis://127.0.0.1:1/0"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    res = CliRunner().invoke(run_cmd, ["r1", "--workers", "65"])
    assert res.exit_code == 2 and "--workers" in res.output
    res = CliRunner().invoke(run_cmd, ["r1", "--worker", "2/2", "--redis-url", "redis://127.0.0.1:1/0"])
    assert res.exit_code == 2 and "0 <= I < K" in res.output


# ---------------------------------------------------------------------------------------- real supervisors
def _runs_per_share(count: int, each: int) -> list[str]:
    out: dict[int, list[str]] = {i: [] for i in range(count)}
    i = 0
    while min(len(v) for v in out.values()) < each:
        name = f"w-{os.getpid()}-{i}"
        if len(out[shard_of(name, count)]) < each:
            out[shard_of(name, count)].append(name)
        i += 1
    return [n for v in out.values() for n in v]


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        kids.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _scrape(port: int) -> dict:
    return _families(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())


def _by(fams: dict, name: str, *labels: str) -> dict:
    fam = fams.get(name)
    return {tuple(s.labels.get(k) for k in labels): s.value for s in (fam.samples if fam else [])
            if s.name in (name, name + "_total")}


def _publish(r, run: str, steps: range) -> None:
    for step in steps:
        bus.publish(r, Keys(run).steps, step_record(run, step), secret=SECRET)


def _start(argv: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sentinel", "run", *argv], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=env)


def _port(log: Path, proc: subprocess.Popen) -> int:
    m = poll(lambda: re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log.read_text(errors="replace")), 60)
    assert m, f"no metrics line (exit {proc.poll()}):\n{log.read_text()[-3000:]}"
    return int(m.group(1))


def test_two_workers_share_the_runs_and_survive_a_dead_worker(tmp_path: Path, redis_factory):
    password = "pw-" + os.urandom(6).hex()
    server = redis_factory(["--requirepass", password])
    url = server.url.replace("://", f"://:{password}@")
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    runs = _runs_per_share(2, 2)
    r = bus.raw(bus.connect(url))
    log = tmp_path / "sentinel.log"
    env = {**os.environ, "SENTINEL_REDIS_URL": url, "PYTHONUNBUFFERED": "1"}
    sup = _start([*runs, "--workers", "2", "--secret-file", str(secret), "--metrics-port", "0", "--consumer", "wtest"],
                 log, env)
    try:
        port = _port(log, sup)
        assert poll(lambda: all(r.get(Keys(run).leader) == b"wtest" for run in runs), 60), log.read_text()[-3000:]
        workers = poll(lambda: len(_children(sup.pid)) == 2 and _children(sup.pid), 30)
        assert workers
        for pid in workers:  # the password travels in the environment, never in a process list
            assert "--worker" in _cmdline(pid) and password not in _cmdline(pid)
        for run in runs:
            _publish(r, run, range(1, 6))

        def judged():
            fams = _scrape(port)
            return fams if all(_by(fams, "sentinel_steps_processed", "run", "worker").get((run, str(shard_of(run, 2))), 0) >= 5
                               for run in runs) else None
        fams = poll(judged, 60)
        assert fams, log.read_text()[-3000:]
        steps = _by(fams, "sentinel_steps_processed", "run", "worker")
        assert {run for run, _ in steps} == set(runs) and len(steps) == 4  # each run judged by its own worker only
        assert _by(fams, "sentinel_worker_up", "worker") == {("0",): 1.0, ("1",): 1.0}
        assert _by(fams, "sentinel_worker_restarts", "worker") == {("0",): 0.0, ("1",): 0.0}
        assert {s.labels["worker"] for s in fams["sentinel_verdict_latency_seconds"].samples} == {"0", "1"}
        text = log.read_text()
        assert len(re.findall(r"metrics on http://", text)) == 1  # the workers' own addresses are not shown
        assert "worker 0/2 started" in text and "worker 1/2 started" in text and password not in text

        # a worker killed outright: started again, its runs' leases still its consumer's, its runs judged on
        victim = next(pid for pid in workers if "--worker 1/2" in _cmdline(pid))
        os.kill(victim, signal.SIGKILL)
        assert poll(lambda: "worker 1/2 exited (status -9)" in log.read_text(), 30), log.read_text()[-3000:]
        assert poll(lambda: any(p != victim and "--worker 1/2" in _cmdline(p) for p in _children(sup.pid)), 30)
        mine = [run for run in runs if shard_of(run, 2) == 1]
        assert poll(lambda: _by(_scrape(port), "sentinel_worker_up", "worker").get(("1",)) == 1.0, 60)
        for run in mine:
            _publish(r, run, range(6, 9))
        assert poll(lambda: all(_by(_scrape(port), "sentinel_steps_processed", "run", "worker").get((run, "1"), 0) >= 3
                                for run in mine), 60), log.read_text()[-3000:]
        assert _by(_scrape(port), "sentinel_worker_restarts", "worker")[("1",)] == 1.0
        assert all(r.get(Keys(run).leader) == b"wtest" for run in runs)

        # a warm stop: passed on to both workers, every lease released, status 0
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(60) == 0, log.read_text()[-3000:]
        assert all(r.get(Keys(run).leader) is None for run in runs)
        assert log.read_text().splitlines()[-1].endswith("stopped")
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()

    # no run named: each worker discovers its share of the registered runs; the supervisor killed
    # outright, its workers stop themselves
    clients = [BusClient(url, run, SECRET) for run in runs]
    for c in clients:
        c.register({"model": "toy", "started": time.time()})
        c.flush()
    log2 = tmp_path / "sentinel-2.log"
    sup = _start(["--workers", "2", "--secret-file", str(secret), "--metrics-port", "0", "--consumer", "wdisc"], log2, env)
    try:
        port = _port(log2, sup)
        for run in runs:
            _publish(r, run, range(9, 11))
        leaders = poll(lambda: (lambda d: d if len(d) == 4 else None)(
            {run: w for (run, w), v in _by(_scrape(port), "sentinel_leader", "run", "worker").items() if v == 1.0}), 60)
        assert leaders == {run: str(shard_of(run, 2)) for run in runs}, log2.read_text()[-3000:]
        workers = _children(sup.pid)
        assert len(workers) == 2
        sup.kill()
        sup.wait()
        assert poll(lambda: not any(_alive(p) for p in workers), 30), "a worker outlived its supervisor"
    finally:
        for c in clients:
            c.close()
        if sup.poll() is None:
            sup.kill()


def test_a_worker_that_cannot_start_stops_the_supervisor_with_one_line(tmp_path: Path, redis_server):
    res = subprocess.run([sys.executable, "-m", "sentinel", "run", *_runs_per_share(2, 1), "--workers", "2",
                          "--redis-url", redis_server.url, "--secret-file", str(tmp_path / "no-such-secret")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "SENTINEL_SECRET": ""})
    assert res.returncode == 2, res.stderr[-2000:]
    assert "error: worker" in res.stderr and "exited with status 2" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout


# ---------------------------------------------------------------------------------------- the supervisor's rules
_SLEEPER = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(int(sys.argv[1])))\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")


def _supervisor(codes: dict[int, str], **kw):
    from sentinel.workers import Supervisor

    lines: list[str] = []
    argvs = {i: [sys.executable, "-c", code, "0"] for i, code in codes.items()}
    return Supervisor(argvs, len(codes), lines.append, **kw), lines


@pytest.mark.parametrize("code, want, said", [
    ("import sys; sys.exit(2)", 2, "worker 0/1 exited with status 2"),  # its settings: at its first start, given up at once
    ("import sys; sys.exit(1)", 2, "exited 3 times in a row within 5 s of its start (last status 1)"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 2, "(last status -9)"),
])
def test_a_worker_that_keeps_dying_is_given_up_with_one_line(code, want, said):
    sup, lines = _supervisor({0: code}, fast_death_s=5.0, give_up_after=3, first_backoff_s=0.05)
    assert sup.run(tick_s=0.02) == want
    assert said in lines[-1] and lines[-1].startswith("error: ")
    assert sup.workers[0].restarts == (0 if "status 2" in said else 2)
    assert "starting it again in 0.1 s" in "\n".join(lines) or "status 2" in said  # the wait doubles: 0.05, then 0.1


def test_a_stop_is_passed_on_warm_then_cold():
    sup, lines = _supervisor({0: _SLEEPER, 1: _SLEEPER})
    import threading

    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(sup.run(tick_s=0.02)))
    t.start()
    assert poll(lambda: all(w.proc is not None for w in sup.workers) and all(w.proc.poll() is None for w in sup.workers), 10)
    time.sleep(0.3)  # their handlers set
    sup.stop()
    t.join(20)
    assert done == [0] and all(w.restarts == 0 for w in sup.workers)  # a stop is no death: nothing started again
    sup2, _ = _supervisor({0: _SLEEPER})
    t = threading.Thread(target=lambda: done.append(sup2.run(tick_s=0.02)))
    t.start()
    assert poll(lambda: sup2.workers[0].proc is not None, 10)
    time.sleep(0.3)
    sup2.stop()
    sup2.stop()
    t.join(20)
    assert done == [0, 130]  # a second stop: the cold stop's status


def test_a_worker_that_cannot_even_be_started_is_retried_then_given_up(tmp_path: Path):
    from sentinel.workers import Supervisor

    lines: list[str] = []
    sup = Supervisor({0: [str(tmp_path / "no-such-python")]}, 1, lines.append, fast_death_s=5.0, give_up_after=3,
                     first_backoff_s=0.05)
    assert sup.run(tick_s=0.02) == 2
    assert sum("could not start (No such file or directory)" in x for x in lines) == 3
    assert lines[-1] == "error: worker 0/1 exited 3 times in a row within 5 s of its start (last status -1): stopping"
