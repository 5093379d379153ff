"""Inputs an audit of every command found to escape the one-line-error rule, or to leak a secret.

Each case was a traceback, a password on the terminal, a whole listing lost to one bad key, a file
written outside the run dir or terminal escapes from the bus; each now gets one line (or the rest
of the view) and never prints the password.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sentinel import bus
from sentinel.cli import main
from sentinel.protocol import Keys

PASSWORD = "hunter2pw"


def _one_line(r) -> str:
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (r.exit_code, r.output[-1500:])
    assert "Traceback" not in r.output
    return lines[0]


@pytest.mark.parametrize("url", [
    f"redis://:{PASSWORD}/x@127.0.0.1:1/0",  # a / in the password ends the host part for a URL parser
    f"redis://u:{PASSWORD}#x@127.0.0.1:1/0",
    f"redis://u:{PASSWORD}?x@127.0.0.1:1/0",
    f"redis:/:{PASSWORD}@127.0.0.1:1",  # mistyped schemes
    f"redis//:{PASSWORD}@127.0.0.1:1",
    f":{PASSWORD}@127.0.0.1:1",
])
def test_a_broken_bus_url_never_prints_its_password(url, monkeypatch):
    """Before, ``invalid bus URL redis://:hunter2pw/x@...: Port could not be cast to integer value
    as 'hunter2pw'``: the redaction looked for the @ only where a parser put the host, and the
    parser's own words quoted the password. Through the flag and through the environment."""
    r = CliRunner().invoke(main, ["status", "--redis-url", url, "somerun"])
    line = _one_line(r)
    assert (PASSWORD not in r.output and "invalid bus URL" in line) or "unsupported bus URL scheme" in line, line
    monkeypatch.setenv("SENTINEL_REDIS_URL", url)
    r = CliRunner().invoke(main, ["status", "somerun"])
    _one_line(r)
    assert PASSWORD not in r.output
    assert PASSWORD not in bus.redact_url(url) and PASSWORD not in (bus.url_problem(url) or "")


def test_the_trainer_refuses_a_broken_bus_url_without_printing_it(tmp_path):
    """The trainer checks --redis-url with the bus's own rules before it creates the run dir: a bad
    one is one line without the password, and an unknown option is refused (it used to train on,
    unwatched, retrying a TypeError)."""
    import subprocess
    import sys

    from tests.helpers.trainer import REPO, trainer_env

    for url in (f"redis://:{PASSWORD}/x@127.0.0.1:1/0", "redis://127.0.0.1:1/0?foo=1", "unix://"):
        run_dir = tmp_path / "run"
        p = subprocess.run([sys.executable, "-m", "trainer", "--run-dir", str(run_dir), "--max-steps", "1", "--redis-url", url],
                           cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=120)
        err = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode != 0 and err[-1].startswith("error: ") and "invalid bus URL" in err[-1], p.stderr[-1500:]
        assert PASSWORD not in p.stdout + p.stderr and "Traceback" not in p.stderr and not run_dir.exists()


@pytest.mark.parametrize("query", ["foo=1", "ssl_cert_reqs=bogus"])
def test_an_unknown_or_bad_url_option_is_one_line_not_a_traceback(query):
    """redis-py hands every query key to its connection class: an unknown one (a typo) was a
    TypeError traceback at the first command."""
    line = _one_line(CliRunner().invoke(main, ["status", "--redis-url", f"redis://127.0.0.1:1/0?{query}", "r"]))
    assert "invalid bus URL" in line and query.split("=")[0] in line


def test_a_unix_socket_url_keeps_its_path():
    """``unix:///path`` lost its // on the way to redis-py (urlunsplit) and was refused as a bad
    scheme; the error then described the bus as redis://?:?/0."""
    line = _one_line(CliRunner().invoke(main, ["status", "--redis-url", "unix:///tmp/no-such-redis.sock", "r"]))
    assert "unix:///tmp/no-such-redis.sock" in line and "cannot reach Redis" in line, line


@pytest.mark.parametrize("cmd", [["status"], ["checkpoints"], ["incidents"], ["pages"], ["skip-list"], ["report"],
                                 ["replay-batch", "--step", "1"], ["verify-resume", "--from-step", "1"],
                                 ["rollback", "--to-step", "1"], ["pause"], ["run"]])
def test_a_run_name_longer_than_the_filesystem_allows_is_one_line(cmd):
    """Path.is_dir() raises ENAMETOOLONG on Python 3.11 instead of answering False: 13 commands
    printed a traceback."""
    for name in ("a" * 300, "a/" * 3000):
        args = [cmd[0], name, *cmd[1:]]
        line = _one_line(CliRunner().invoke(main, args))
        assert len(line) < 600, (args[0], len(line))


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


def test_an_incident_id_never_takes_a_report_outside_the_run_dir(tmp_path):
    from sentinel.cli.report_cmd import default_path

    for iid in ("../../../../pwned", "..", "/etc/x", "a/b"):
        p = default_path(tmp_path / "run", iid)
        assert p.parent == tmp_path / "run" / "reports" and "/" not in p.name and p.name.startswith("incident-"), p
