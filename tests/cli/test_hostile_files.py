"""Hostile files handed to the operator CLI never hang it, never give a traceback, never cost data.

An audit found inputs that made ``sentinel`` hang or crash: a 396-byte YAML alias bomb as a rules
file, ``/dev/zero`` / ``/dev/urandom`` / a FIFO as a rules file, a trace or a state file, a symlink
loop as a trace, and ``sentinel report --out`` at a ``.txt`` name, a name too long, a name without
suffix, or ``/dev/null``. The contract for each: exit 2 with one line ``error: ...`` (or, for a
large file of garbage, a quick answer with its lines counted as rejected).

A case that could hang runs in a subprocess with a timeout, so that a regression fails the test
instead of stalling the suite.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sentinel.cli import main
from sentinel.protocol import StepRecord
from tests.helpers.cli import one_line_error

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIMEOUT = 60  # seconds; every case here answers in about one


def sentinel(*args, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """``sentinel ARGS`` in a subprocess: a hang is a ``TimeoutExpired`` failure, not a stuck suite."""
    return subprocess.run([sys.executable, "-m", "sentinel", *[str(a) for a in args]], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def alias_bomb(levels: int = 9) -> str:
    """Nine lists of nine aliases, ``levels`` deep: 396 bytes that stand for 9**9 values."""
    lines = ["a0: &a0 [x,x,x,x,x,x,x,x,x]"]
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def write_steps(path: Path, n: int = 30) -> Path:
    """A synthetic ``steps.jsonl`` of ``n`` healthy steps (no training needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for s in range(1, n + 1):
            rec = StepRecord(run="r", step=s, loss=5.0 - 0.01 * s, loss_max_rank=5.0 - 0.01 * s, grad_norm=0.5, lr=1e-3,
                             tokens=64 * s, batch_fingerprint=f"f{s}", sample_ids=[4 * s + i for i in range(4)],
                             time=1000.0 + s)
            f.write(rec.to_json() + "\n")
    return path


@pytest.fixture()
def run_dir(tmp_path) -> Path:
    d = tmp_path / "run"
    write_steps(d / "steps.jsonl")
    return d


@pytest.fixture()
def fifo(tmp_path) -> Path:
    p = tmp_path / "pipe.yaml"
    os.mkfifo(p)
    return p


# ------------------------------------------------------------------ 1. rules files: YAML that never ends


def test_a_yaml_alias_bomb_as_rules_is_one_line_and_quick(tmp_path, run_dir):
    bomb = tmp_path / "billion.yaml"
    bomb.write_text(alias_bomb(9))
    assert len(bomb.read_bytes()) < 500
    one_line_error(sentinel("rules", "check", bomb), "billion.yaml", "alias", "line 2")
    one_line_error(sentinel("backtest", "--rules", bomb, run_dir / "steps.jsonl"), "billion.yaml", "alias")
    # the daemon reads its rules before it looks for a bus
    one_line_error(sentinel("run", run_dir, "--rules", bomb), "billion.yaml", "alias")


def test_aliases_are_refused_even_where_they_would_be_valid(tmp_path):
    """Rules never need anchors: a merge key (``<<: *base``) or a self-reference is refused too."""
    merge = tmp_path / "merge.yaml"
    merge.write_text("base: &b {threshold: 5}\nrules:\n  loss_spike:\n    <<: *b\n")
    one_line_error(cli("rules", "check", merge), "merge.yaml", "line 4", "alias *b")
    selfref = tmp_path / "selfref.yaml"
    selfref.write_text("a: &a [*a]\n")
    one_line_error(cli("rules", "check", selfref), "selfref.yaml", "alias")


def test_a_duplicate_key_in_rules_is_refused_with_its_line(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("version: 1\nrules:\n  loss_spike:\n    threshold: 1\n  loss_spike:\n    threshold: 2\n")
    one_line_error(cli("rules", "check", dup), "dup.yaml", "line 5", "duplicate key 'loss_spike'")
    dup.write_text("rules:\n  loss_spike:\n    threshold: 1\n    threshold: 2\n")
    one_line_error(cli("rules", "check", dup), "line 4", "duplicate key 'threshold'")
    # the same key in two different mappings is fine
    ok = tmp_path / "ok.yaml"
    ok.write_text("rules:\n  loss_spike:\n    window: 64\n  grad_norm_spike:\n    window: 64\n")
    assert cli("rules", "check", ok).exit_code == 0


def test_divergence_k_more_than_n_is_refused(tmp_path):
    from sentinel.rules import RulesError, RuleSet, parse_rules

    kgtn = tmp_path / "kgtn.yaml"
    kgtn.write_text("version: 1\nrules:\n  divergence:\n    k: 20\n    n: 16\n")
    one_line_error(cli("rules", "check", kgtn), "kgtn.yaml", "rules.divergence", "k = 20", "n = 16")
    with pytest.raises(RulesError, match="k = 17 is more than n = 16"):
        parse_rules("rules:\n  divergence:\n    k: 17\n")  # against the default n
    assert RuleSet.model_validate({"rules": {"divergence": {"k": 16, "n": 16}}}).rules.divergence.k == 16


def test_the_shipped_defaults_still_load():
    from sentinel.rules import default_rules

    assert default_rules().rules.divergence.k <= default_rules().rules.divergence.n


# ------------------------------------------------------------------ 2. devices, FIFOs, huge files


@pytest.mark.parametrize("target", ["/dev/zero", "symlink", "fifo"])
def test_a_rules_file_that_is_no_regular_file_is_one_line(tmp_path, run_dir, fifo, target):
    if target == "symlink":
        path = tmp_path / "rules.yaml"
        path.symlink_to("/dev/zero")
    else:
        path = fifo if target == "fifo" else Path(target)
    one_line_error(sentinel("rules", "check", path), str(path), "not a regular file")
    one_line_error(sentinel("backtest", "--rules", path, run_dir / "steps.jsonl"), "not a regular file")


def test_a_rules_file_over_the_size_cap_is_one_line(tmp_path):
    from sentinel.rules.config import MAX_RULES_BYTES

    big = tmp_path / "big.yaml"
    big.write_text("# padding\n" * (MAX_RULES_BYTES // 10 + 10) + "version: 1\n")
    one_line_error(cli("rules", "check", big), "big.yaml", "larger than")


@pytest.mark.parametrize("args", [("/dev/zero",), ("--format", "text", "/dev/urandom"), ("--format", "csv", "/dev/zero"),
                                  ("--format", "tb", "/dev/zero")])
def test_a_device_as_a_trace_is_one_line(args):
    one_line_error(sentinel("backtest", *args), args[-1], "not a regular file")


@pytest.mark.parametrize("kind", ["fifo", "symlink-to-dev-zero", "event-file-fifo"])
def test_a_trace_that_is_a_fifo_or_device_link_is_one_line(tmp_path, kind):
    d = tmp_path / "v"
    d.mkdir()
    trace = d / ("events.out.tfevents.1" if kind == "event-file-fifo" else "steps.jsonl")
    if kind == "symlink-to-dev-zero":
        trace.symlink_to("/dev/zero")
    else:
        os.mkfifo(trace)
    one_line_error(sentinel("backtest", trace), "not a regular file")
    if kind != "event-file-fifo":
        # several traces: the bad one is its own row, the good one is still judged
        good = write_steps(tmp_path / "good.jsonl")
        res = sentinel("backtest", "--json", good, trace)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        rows = json.loads(res.stdout)["traces"]
        assert "error" not in rows[0] and "not a regular file" in rows[1]["error"]


def test_a_big_file_of_random_bytes_is_read_quickly(tmp_path):
    """50 MB of random bytes: every line rejected and counted (JSON lines) or no step found (a
    text log), in seconds, not a hang."""
    garbage = os.urandom(50 << 20)
    jl = tmp_path / "random.jsonl"
    jl.write_bytes(garbage)
    err = one_line_error(sentinel("backtest", jl), "no step records in", "line(s) skipped")
    assert int(err.split("(")[1].split()[0]) > 100_000  # about one newline per 256 random bytes
    log = tmp_path / "random.log"
    log.write_bytes(garbage[: 8 << 20])
    one_line_error(sentinel("backtest", "--format", "text", log), "no line names a step")


def test_an_endless_line_is_capped_and_counted(tmp_path):
    """A "line" without a newline (zeros, a decompressed bomb) is never held whole: it is cut at
    ``MAX_LINE_BYTES`` and rejected, and the lines after it are still read."""
    from sentinel.backtest import MAX_LINE_BYTES, _capped_lines, load_trace

    lines = list(_capped_lines(io.BytesIO(b"x" * 10_000 + b"\nok\n" + b"y" * 5000), limit=1000))
    assert [len(ln) for ln in lines] == [1001, 3, 1001]
    assert list(_capped_lines(io.BytesIO(b"a" * 1000 + b"\n"), limit=1000)) == [b"a" * 1000 + b"\n"]
    zeros = tmp_path / "zeros.jsonl"
    with zeros.open("wb") as f:
        f.write(b"\0" * (MAX_LINE_BYTES + (4 << 20)) + b"\n")
        f.write(b'{"step": 1, "loss": 3.0}\n')
    rejected: list[str] = []
    recs = load_trace(zeros, rejected=rejected)
    assert [r.step for r in recs] == [1]
    assert len(rejected) == 1 and "too long for a step line" in rejected[0] and "zeros.jsonl:1" in rejected[0]


def test_a_skiplist_that_is_no_regular_file_is_one_line(run_dir, tmp_path):
    (run_dir / "skiplist.json").symlink_to("/dev/zero")
    one_line_error(sentinel("skip-list", run_dir), "skiplist.json", "not a regular file")
    one_line_error(sentinel("report", run_dir, "--out", tmp_path / "r.png"), "skiplist.json", "not a regular file")
    (run_dir / "skiplist.json").unlink()
    os.mkfifo(run_dir / "skiplist.json")
    one_line_error(sentinel("skip-list", run_dir), "skiplist.json", "not a regular file")


def test_a_state_file_over_the_size_cap_is_one_line(run_dir, monkeypatch):
    from sentinel.runfiles import base  # the run dir's bounded reads (sentinel.rundir re-exports them)

    monkeypatch.setattr(base, "MAX_STATE_BYTES", 100)
    (run_dir / "skiplist.json").write_text(json.dumps([[i, i + 1] for i in range(0, 200, 2)]))
    one_line_error(cli("skip-list", run_dir), "skiplist.json", "larger than 100 bytes")


def test_a_config_run_id_alias_bomb_does_not_hang_the_readers(run_dir):
    (run_dir / "config.yaml").write_text(alias_bomb(9) + "run_id: *a8\ndata:\n  skip: *a8\n")
    res = sentinel("skip-list", run_dir, "--json")
    assert res.returncode == 0, res.stderr[-2000:]


# ------------------------------------------------------------------ 3. a trace that cannot be opened


def test_a_symlink_loop_or_a_name_too_long_as_a_trace_is_one_line(tmp_path):
    loop = tmp_path / "loop" / "steps.jsonl"
    loop.parent.mkdir()
    loop.symlink_to("steps.jsonl")
    one_line_error(cli("backtest", loop), "steps.jsonl", "cannot read", "symbolic links")
    long = tmp_path / ("a" * 300 + ".jsonl")
    one_line_error(cli("backtest", long), "cannot read", "too long")
    no_perm = tmp_path / "locked.jsonl"
    write_steps(no_perm)
    no_perm.chmod(0)
    try:
        if os.access(no_perm, os.R_OK):  # root reads anything
            return
        one_line_error(cli("backtest", no_perm), "locked.jsonl", "cannot read")
    finally:
        no_perm.chmod(0o644)


def test_a_rules_file_that_cannot_be_opened_is_one_line(tmp_path):
    loop = tmp_path / "rules.yaml"
    loop.symlink_to("rules.yaml")
    one_line_error(cli("rules", "check", loop), "rules.yaml", "symbolic links")
    one_line_error(cli("rules", "check", tmp_path), "Is a directory")
    one_line_error(cli("rules", "check", tmp_path / "missing.yaml"), "missing.yaml")


# ------------------------------------------------------------------ 4. sentinel report --out


def test_report_out_with_another_suffix_or_a_name_too_long_is_one_line(run_dir, tmp_path):
    one_line_error(cli("report", run_dir, "--out", tmp_path / "x.txt"), "x.txt", "name a .png file")
    assert not list(tmp_path.glob("x.txt*"))
    one_line_error(cli("report", run_dir, "--out", tmp_path / ("a" * 300 + ".png")), "cannot write the report", "too long")
    one_line_error(cli("report", run_dir, "--out", run_dir / "steps.jsonl" / "r.png"), "cannot write the report")


def test_report_out_is_written_at_exactly_the_path_printed(run_dir, tmp_path):
    out = tmp_path / "noext"
    res = cli("report", run_dir, "--out", out)
    assert res.exit_code == 0, res.output
    assert f"report: {out}\n" in res.stdout
    assert out.read_bytes()[:8] == PNG_MAGIC and not (tmp_path / "noext.png").exists()
    upper = tmp_path / "R.PNG"
    res = cli("report", run_dir, "--out", upper, "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["path"] == str(upper) and upper.read_bytes()[:8] == PNG_MAGIC
    # a report written again replaces the old one whole, and leaves no temporary file behind
    res = cli("report", run_dir, "--out", upper)
    assert res.exit_code == 0 and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("target", ["/dev/null", "/dev/full", "/dev/sentinel-report-test.png"])
def test_report_out_under_dev_is_refused(run_dir, target):
    """Never a picture in /dev (and never a write to the device itself)."""
    made = [p for p in (target + ".png", "/dev/sentinel-report-test.png") if not os.path.exists(p)]
    try:
        one_line_error(cli("report", run_dir, "--out", target), target)
        assert not any(os.path.exists(p) for p in made)
    finally:  # a regression must not leave its files in /dev: only the .png names this test would make
        for p in made:
            if os.path.isfile(p):
                os.unlink(p)


def test_report_out_at_a_fifo_is_refused_without_waiting(run_dir, tmp_path):
    pipe = tmp_path / "r.png"
    os.mkfifo(pipe)
    one_line_error(sentinel("report", run_dir, "--out", pipe), "r.png", "not a regular file")


# ------------------------------------------------------------------ 5. a reversed range in skiplist.json


def test_a_reversed_skiplist_range_is_one_line_for_every_reader(run_dir, tmp_path):
    (run_dir / "skiplist.json").write_text("[[10, 5]]")
    one_line_error(cli("skip-list", run_dir), "skiplist.json", "lo <= hi")
    one_line_error(cli("skip-list", run_dir, "--json"), "skiplist.json", "lo <= hi")
    one_line_error(cli("report", run_dir, "--out", tmp_path / "r.png"), "skiplist.json", "lo <= hi")


@pytest.mark.slow  # decompresses up to the cap (~5 s)
def test_backtest_refuses_a_decompressed_bomb_and_short_columns(tmp_path):
    bomb = tmp_path / "bomb.jsonl.gz"
    with gzip.open(bomb, "wb") as f:
        for _ in range(64):
            f.write(b"\n" * (1 << 24))  # 1 GiB of newlines in ~1 MiB
    one_line_error(cli("backtest", str(bomb)), "blank lines in a row")
    short = tmp_path / "short.json"
    short.write_text(json.dumps({"step": list(range(300)), "loss": [3.0] * 150}))
    res = cli("backtest", str(short), "--json")
    out = json.loads(res.stdout)
    t = out["traces"][0] if "traces" in out else out
    assert t["actions"] == [] and t["records"] == 150 and t["rejected_lines"] == 150, t
    assert "column 'loss' has only 150 values" in res.stderr
    boolean = tmp_path / "bool.jsonl"
    boolean.write_text("".join(json.dumps({"step": True, "loss": 3.0}) + "\n" for _ in range(50)))
    one_line_error(cli("backtest", str(boolean)), "a boolean is not a step number")
