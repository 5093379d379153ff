"""Hostile flags to the operator CLI: bus URLs, secret files, run names and empty values.

Each case was a traceback or a password on the terminal: a bus URL whose password holds ``/ ? #``
or whose scheme or colon is mistyped, an unknown URL option, a ``--secret-file`` that is a FIFO, a
device or 1 MiB, a run name longer than the filesystem allows, an empty value read as ``.`` or as
unset. Each now gets one line, exit 2, and never prints the password.
"""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from sentinel import bus
from sentinel.cli import main
from tests.helpers.cli import cli, one_line_error

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


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_secret_file_that_is_no_small_regular_file_is_one_line(tmp_path, monkeypatch, kind):
    monkeypatch.delenv("SENTINEL_SECRET", raising=False)
    p = tmp_path / "secret"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "device":
        os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero, private: before, read until OOM
    else:
        p.write_text("x" * (1 << 20))
    p.chmod(0o600)
    res = cli("run", "somerun", "--secret-file", str(p), "--redis-url", "redis://127.0.0.1:1")
    one_line_error(res, "secret file")
    assert "chmod" not in res.stderr
    assert ("FIFO" in res.stderr) if kind == "fifo" else ("device" in res.stderr) if kind == "device" else ("KiB" in res.stderr)


def test_a_url_never_prints_a_password_its_colon_was_forgotten_for():
    for url, hidden in (("redis://S3cr3tPW@127.0.0.1:1", "S3cr3tPW"), ("S3cr3tPW", "S3cr3tPW")):
        res = cli("status", "--redis-url", url)
        assert res.exit_code == 2 and hidden not in res.output + res.stderr, res.stderr
    res = cli("status", "--redis-url", "redis://:pw@127.0.0.1:99999/0")
    one_line_error(res, "Port out of range")


@pytest.mark.parametrize("args", [
    ["backtest", ""],
    ["backtest", "--rules", "", "x.jsonl"],
    ["incidents", "--id", "", "runs/x"],
    ["report", "runs/x", "--incident", ""],
    ["report", "runs/x", "--out", ""],
    ["status", ""],
    ["replay-batch", "", "--step", "3"],
    ["approve", ""],
    ["rules", "check", ""],
])
def test_an_empty_value_is_refused_not_read_as_dot_or_unset(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.log").write_text("step:1 train_loss:3.0\nstep:2 train_loss:2.9\n")  # what `backtest ""` judged
    res = cli(*args)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "an empty value names nothing" in lines[0], (res.exit_code, res.output)
    assert lines[0].startswith("error: ") and res.stdout == ""
