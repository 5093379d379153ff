"""The CLI audit of 2026-11-25 (hostile flags, files and URLs): each finding, replayed.

Before: a --secret-file that is a device read until the memory ran out, a FIFO (there, or as the
run's bus/url) waited forever; a 1 MiB gzip of newlines kept `backtest` busy for over 8 minutes;
a table with a short column read its missing cells as NaN losses and ordered a rollback; a
boolean step was step 1; a URL with its colon forgotten printed the password as a user name; a
steps.jsonl that is a directory or a FIFO was "no steps yet", silently; `checkpoints` called a
checkpoint the trainer refuses `checksum_ok` and `rollback` chose it; a malformed pending plan
hid the run from `status`, `checkpoints` and `skip-list`; one torn line stopped `replay-batch`
and `verify-resume` for every step; `verify-resume` blamed the data cursor for a train state that
breaks its schema; `--before-step` beyond the log was taken; the views gave up on a run directory
when an explicit bus was down; rules errors spoke pydantic.
"""

from __future__ import annotations

import gzip
import json
import os
import stat

import pytest

from tests.helpers.cli import base_run, cli, cli_json, run_copy  # noqa: F401  (fixtures)
from tests.helpers.trainer import dataset  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(300)


def _one_error(res, contains: str) -> None:
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and contains in lines[0], \
        (res.exit_code, res.stderr, res.stdout[-500:])
    assert "Traceback" not in res.output


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
    _one_error(res, "secret file")
    assert "chmod" not in res.stderr
    assert ("FIFO" in res.stderr) if kind == "fifo" else ("device" in res.stderr) if kind == "device" else ("KiB" in res.stderr)


def test_a_fifo_as_the_runs_bus_url_does_not_wedge_the_views(run_copy):
    (run_copy / "bus").mkdir(exist_ok=True)
    url = run_copy / "bus" / "url"
    url.unlink(missing_ok=True)
    os.mkfifo(url)
    for view in ("status", "checkpoints", "pages", "incidents", "skip-list"):
        res = cli(view, str(run_copy))
        assert res.exit_code == 0, (view, res.output, res.stderr)
        assert "FIFO" in res.output + res.stderr or view == "skip-list", view


@pytest.mark.slow  # decompresses up to the cap (~5 s)
def test_backtest_refuses_a_decompressed_bomb_and_short_columns(tmp_path):
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb") as f:
        for _ in range(64):
            f.write(b"\n" * (1 << 24))  # 1 GiB of newlines in ~1 MiB
    _one_error(cli("backtest", str(bomb)), "blank lines in a row")
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"step": list(range(300)), "loss": [3.0] * 150}))
    res = cli("backtest", str(short), "--json")
    out = json.loads(res.stdout)
    t = out["traces"][0] if "traces" in out else out
    assert t["actions"] == [] and t["records"] == 150 and t["rejected_lines"] == 150, t
    assert "column 'loss' has only 150 values" in res.stderr
    boolean = tmp_path / "bool.jsonl"
    boolean.write_text("".join(json.dumps({"step": True, "loss": 3.0}) + "\n" for _ in range(50)))
    _one_error(cli("backtest", str(boolean)), "a boolean is not a step number")


def test_a_url_never_prints_a_password_its_colon_was_forgotten_for():
    for url, hidden in (("redis://S3cr3tPW@127.0.0.1:1", "S3cr3tPW"), ("S3cr3tPW", "S3cr3tPW")):
        res = cli("status", "--redis-url", url)
        assert res.exit_code == 2 and hidden not in res.output + res.stderr, res.stderr
    res = cli("status", "--redis-url", "redis://:pw@127.0.0.1:99999/0")
    _one_error(res, "Port out of range")


def test_unreadable_steps_logs_and_bad_side_files_are_said_not_hidden(run_copy):
    d = str(run_copy)
    (run_copy / "steps.jsonl").rename(run_copy / "steps.bak")
    os.mkfifo(run_copy / "steps.jsonl")
    res = cli("status", d)
    assert res.exit_code == 0 and "steps.jsonl is a FIFO" in res.stderr
    (run_copy / "steps.jsonl").unlink()
    (run_copy / "steps.bak").rename(run_copy / "steps.jsonl")
    (run_copy / "pending_rollback.json").write_text('{"to_step": -1, "ranges": []}')
    for view in ("status", "checkpoints", "skip-list"):
        res = cli(view, d)
        assert res.exit_code == 0 and "pending_rollback.json is malformed" in res.stderr, (view, res.stderr)
    (run_copy / "pending_rollback.json").unlink()
    # a manifest the trainer's schema refuses is not checksum_ok here, and no rollback target
    m = run_copy / "checkpoints" / "step-00000020" / "manifest.json"
    doc = json.loads(m.read_text())
    doc["step"] = -5
    m.write_text(json.dumps(doc))
    rows = {c["step"]: c for c in cli_json("checkpoints", d)["checkpoints"]}
    assert rows[20]["verified"] == "corrupt" and "manifest step" in rows[20]["problem"]
    _one_error(cli("rollback", d, "--to-step", "20", "--yes"), "corrupt")
    doc["step"] = 30
    m.write_text(json.dumps(doc))
    rows = {c["step"]: c for c in cli_json("checkpoints", d)["checkpoints"]}
    assert "not the step of its directory" in rows[20]["problem"]
    _one_error(cli("rollback", d, "--before-step", "99999999999999999999", "--dry-run"), "past the run's last step")


@pytest.mark.slow
def test_one_torn_line_does_not_stop_replay_and_verify(run_copy):
    log = run_copy / "steps.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    i = next(k for k, ln in enumerate(lines) if b'"step":25,' in ln)
    lines[i] = lines[i][:60] + b"\n"  # torn in the middle of the file
    log.write_bytes(b"".join(lines))
    res = cli("replay-batch", str(run_copy), "--step", "15", "--json")
    assert res.exit_code == 0 and "skipped 1 unreadable line" in res.stderr, (res.stdout[-500:], res.stderr)
    assert json.loads(res.stdout)["step"] == 15
    res = cli("verify-resume", str(run_copy), "--from-step", "10", "--steps", "2", "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["equivalent"] is True, res.stdout[-800:]


@pytest.mark.slow
def test_a_train_state_that_breaks_its_schema_is_named_as_such(run_copy):
    import hashlib

    ck = run_copy / "checkpoints" / "step-00000020"
    ts = json.loads((ck / "train_state.json").read_text())
    del ts["run"]
    (ck / "train_state.json").write_text(json.dumps(ts))
    m = json.loads((ck / "manifest.json").read_text())
    m["files"]["train_state.json"] = hashlib.sha256((ck / "train_state.json").read_bytes()).hexdigest()
    (ck / "manifest.json").write_text(json.dumps(m))
    res = cli("verify-resume", str(run_copy), "--from-step", "20", "--steps", "2", "--json")
    first = json.loads(res.stdout)["first_divergence"]
    assert res.exit_code == 1 and first["component"] == "train_state", first


@pytest.mark.slow
def test_a_skip_list_that_cannot_be_written_does_not_cost_the_replays_verdict(run_copy, monkeypatch):
    """A read-only run dir (the audit mounted one): before, the replay's verdict and culprits were
    lost behind `error: Read-only file system: .../.skiplist.json.tmp-15192`."""
    import errno

    import sentinel.offline.replay as replay_mod

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system", str(run_copy / ".skiplist.json.tmp-1"))

    import sentinel.cli.replay_cmd as replay_cmd

    real = replay_cmd._in_process

    def with_a_culprit(*a, **k):  # the shared run is healthy: its steps have none (a normal batch)
        res = real(*a, **k)
        res["culprits"] = [{"id": 123, "loss": 9.0, "grad_norm": None, "score": 9.0, "source": None, "shard": 0,
                            "offset": 0, "text": "x"}]
        return res

    monkeypatch.setattr(replay_cmd, "_in_process", with_a_culprit)
    monkeypatch.setattr(replay_mod, "add_to_skiplist", read_only)
    res = cli("replay-batch", str(run_copy), "--step", "15", "--skip-culprits", "--json")
    assert res.exit_code == 2 and "Traceback" not in res.output, (res.stdout[-1500:], res.stderr)
    out = json.loads(res.stdout)
    assert out["culprits"] and out["skip"]["status"] == "failed"
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert lines == ["error: could not add the culprits to the skip list: Read-only file system"], res.stderr


def test_small_wording_fixes_of_the_audit(run_copy):
    """`pages --limit 0` shows all, as `incidents --limit 0` does (it was an error); `report` no
    longer says "from none"; a checkpoint file that is a FIFO is "no regular file", not "missing"."""
    d = str(run_copy)
    assert cli("pages", d, "--limit", "0").exit_code == 0
    res = cli("report", d, "--out", str(run_copy / "r.png"))
    assert res.exit_code == 0 and "from none" not in res.stdout
    f = run_copy / "checkpoints" / "step-00000020" / "optim.pt"
    f.unlink()
    os.mkfifo(f)
    rows = {c["step"]: c for c in cli_json("checkpoints", d)["checkpoints"]}
    assert rows[20]["verified"] == "corrupt" and rows[20]["problem"] == "optim.pt is no regular file"
