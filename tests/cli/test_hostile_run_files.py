"""Hostile run-directory files never give a traceback in an offline command.

Every file a run directory holds is written in hostile variants (a wrong type where a number goes,
a huge integer, 1e999 / NaN / Infinity, a JSON list instead of an object, a line nested 50,000
deep, truncated JSON, binary garbage, an empty file), and every offline read command that reads it
runs on the result, human and ``--json``, through click's CliRunner. The contract:

* never a traceback;
* a line-oriented log (steps, incidents, pages, directives, audit): the bad line is skipped and the
  command exits 0 still showing the good lines;
* a single-document file (manifest, config, skip list, ...): exit 0 (the command copes, e.g. a
  manifest read as ``corrupt``), or exit 2 with one line ``error: ...`` naming the file.

One real tiny run (shared with test_report by name) is the template; each case copies it, so no
case trains.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import traceback
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from sentinel.cli import main
from sentinel.protocol import Incident
from tests.helpers.cli import cli, cli_json, one_line_error

DEEP = 50_000
LONG = os.environ.get("SENTINEL_CHAOS_LONG", "").strip() not in ("", "0")  # every hostile variant, not one per kind
HOLE = "__HOSTILE__"  # placeholder a raw value replaces, so the JSON text can be anything at all

# raw JSON (or YAML) text put where a value goes
VALUES = {
    "text": '"x"',
    "list": "[1, 2]",
    "object": "{}",
    "null": "null",
    "bool": "true",
    "negative": "-1",
    "huge": "1" + "0" * 60,
    "vast": "1" + "0" * 400,  # an int no float can hold
    "far": "1e30",  # finite and below float32's max, but no clock reaches it
    "1e999": "1e999",
    "nan": "NaN",
    "inf": "Infinity",
    "-inf": "-Infinity",
    "deep": "[" * DEEP + "]" * DEEP,
}
# a config is read by the report (~0.5 s a picture): fewer values, YAML's spelling of NaN and infinity
YAML_VALUES = {"text": '"x"', "list": "[1, 2]", "null": "null", "bool": "true", "vast": VALUES["vast"], "nan": ".nan",
               "inf": ".inf", "deep": VALUES["deep"]}
GARBAGE = bytes(random.Random(7).randrange(256) for _ in range(300)).replace(b"\n", b"\x00")
# whole-line (or whole-file) replacements
SHAPES = {
    "list": b"[1, 2, 3]",
    "string": b'"just a string"',
    "number": b"42",
    "null": b"null",
    "empty-object": b"{}",
    "deep": b"[" * DEEP + b"]" * DEEP,
    "deep-object": b'{"a": ' * DEEP + b"1" + b"}" * DEEP,
    "binary": GARBAGE,
    "nul-bytes": b"\x00" * 64,
}

CKPT = "checkpoints/step-00000030"
RUN_NAME = "run"


# ------------------------------------------------------------------ the template run
@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """A real 30-step run plus one good line in every log the daemon and the CLI write."""
    from tests.helpers.offline import make_run

    src = make_run(tmp_path_factory, "report", steps=30, every=10)
    d = tmp_path_factory.mktemp("hostile") / RUN_NAME
    shutil.copytree(src, d)
    now = time.time()
    inc = Incident(id=f"{RUN_NAME}-t0-s21", run=RUN_NAME, state="healthy", rule="loss_spike", onset_step=21,
                   detect_step=23, opened_at=now - 100, closed_at=now - 50, rollback_to=20, skip_ranges=[(5, 9)],
                   evidence=[{"step": 21, "loss": 9.5}],
                   actions=[{"kind": "rollback", "time": now - 90, "incident_id": f"{RUN_NAME}-t0-s21", "to_step": 20,
                             "outcome": "applied", "directive_id": "d1", "idempotency_key": "k1"}])
    (d / "incidents.jsonl").write_text(inc.to_json() + "\n")
    (d / "pages.jsonl").write_text(json.dumps({"time": now - 80, "run": RUN_NAME, "severity": "critical",
                                               "summary": "GOOD PAGE", "incident_id": inc.id, "rule": "loss_spike",
                                               "delivered_to": ["log"]}) + "\n")
    (d / "directives.jsonl").write_text(json.dumps({"id": "d1", "kind": "rollback", "status": "applied", "step": 20,
                                                    "timeline": 1, "time": now - 85, "incident_id": inc.id}) + "\n")
    (d / "audit.jsonl").write_text(json.dumps({"time": now - 70, "action": "skip-add", "who": "op", "run": RUN_NAME,
                                               "ranges": [[5, 9]], "reason": "GOOD AUDIT"}) + "\n")
    (d / "skiplist.json").write_text("[[5, 9]]")
    (d / "checkpoints" / "verified.json").write_text(json.dumps(
        {"30": {"verified": "resume_verified", "time": now - 60, "steps": 5}}))
    (d / "pending_rollback.json").write_text(json.dumps(
        {"to_step": 20, "ranges": [[5, 9]], "reason": "GOOD", "id": "p1", "created": now - 10,
         "checkpoint": "step-00000020", "incident_id": inc.id}, indent=1))
    return d


# ------------------------------------------------------------------ hostile variants
def _with_hole(obj, path: tuple) -> str:
    """``obj`` as JSON text with the value at ``path`` replaced by the placeholder."""
    obj = json.loads(json.dumps(obj))
    cur = obj
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = HOLE
    return json.dumps(obj)


def _leaves(obj, prefix: tuple = ()) -> list[tuple]:
    """Paths to every value of a JSON object, down to the items of its items (an incident's actions[0].time)."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for k, v in items:
        out.append(prefix + (k,))
        if len(prefix) < 2 and isinstance(v, (dict, list)) and v:
            out += _leaves(v, prefix + (k,))
    return out


# the field that tells lines apart (an incident's id, a page's summary): each hostile line gets its own,
# so that "the last line per id wins" cannot hide it behind the good one
DISTINCT = {"incidents.jsonl": "id", "pages.jsonl": "summary", "directives.jsonl": "id", "audit.jsonl": "reason"}


def hostile_lines(good: bytes, values: dict[str, str], distinct: str | None = None) -> list[bytes]:
    """Every field of the good line ``good`` set in turn to each hostile value, plus whole-line shapes."""
    obj = json.loads(good)
    out = []
    for n, path in enumerate(_leaves(obj)):
        for m, raw in enumerate(values.values()):
            own = {**obj, distinct: f"hostile-{n}-{m}"} if distinct and path != (distinct,) else obj
            out.append(_with_hole(own, path).replace(json.dumps(HOLE), raw).encode())
    out += list(SHAPES.values())
    out += [good[: len(good) // 2], good[:-1] + b"\xff\xfe"]  # torn; valid JSON prefix, then not UTF-8
    return out


def hostile_documents(good: bytes, *, yaml_doc: bool = False, fields: list[tuple] | None = None) -> dict[str, bytes]:
    """Variants of a whole document: each field (``fields``, default all) set to each hostile value,
    and whole-file shapes."""
    out: dict[str, bytes] = {"empty": b"", "blank": b"\n\n", "truncated": good[: len(good) // 2]}
    out.update({f"shape-{k}": v for k, v in SHAPES.items()})
    obj = yaml.safe_load(good) if yaml_doc else json.loads(good)
    if isinstance(obj, (dict, list)):
        for i, path in enumerate(fields or _leaves(obj)):
            text = _with_hole(obj, path)
            for name, raw in (YAML_VALUES if yaml_doc else VALUES).items():
                if name == "deep" and yaml_doc and i and not LONG:
                    # the YAML parser gives up on the nesting before any field is read (~15 s a field):
                    # one field and the whole-file shape stand for the rest; SENTINEL_CHAOS_LONG=1 runs all
                    continue
                out[f"{'.'.join(map(str, path))}={name}"] = text.replace(json.dumps(HOLE), raw).encode()
    return out


# ------------------------------------------------------------------ the commands
def commands(run: Path, out_png: Path) -> dict[str, list[str]]:
    r = str(run)
    return {
        "status": ["status", r], "status --json": ["status", r, "--json"],
        "incidents": ["incidents", r], "incidents --json": ["incidents", r, "--json"],
        "pages": ["pages", r], "pages --json": ["pages", r, "--json"],
        "checkpoints": ["checkpoints", r], "checkpoints --json": ["checkpoints", r, "--json"],
        "checkpoints --quick": ["checkpoints", r, "--quick", "--json"],
        "skip-list": ["skip-list", r, "show"], "skip-list --json": ["skip-list", r, "show", "--json"],
        "rollback --dry-run": ["rollback", r, "--to-step", "20", "--dry-run", "--json"],
        "report --json": ["report", r, "--out", str(out_png), "--json"],
        "report": ["report", r, "--out", str(out_png)],
        "backtest": ["backtest", str(run / "steps.jsonl")], "backtest --json": ["backtest", str(run / "steps.jsonl"), "--json"],
    }


ALL = ("status", "status --json", "incidents", "incidents --json", "pages", "pages --json", "checkpoints",
       "checkpoints --json", "checkpoints --quick", "skip-list", "skip-list --json", "rollback --dry-run")
# which commands read which file (report renders a PNG: ~1 s, so only where it reads the file)
READERS = {
    "steps.jsonl": ("status", "status --json", "rollback --dry-run", "report --json", "report", "backtest", "backtest --json"),
    "incidents.jsonl": ("incidents", "incidents --json", "status --json", "report --json", "report"),
    "pages.jsonl": ("pages", "pages --json", "status --json"),
    "directives.jsonl": ("incidents", "incidents --json", "status", "status --json", "report --json"),
    "audit.jsonl": ("incidents", "incidents --json"),
    "skiplist.json": ("skip-list", "skip-list --json", "rollback --dry-run", "report --json", "status --json"),
    "config.yaml": ("status --json", "skip-list --json", "report --json"),  # every command reads run_id
    "pending_rollback.json": ("status", "status --json", "checkpoints", "checkpoints --json", "skip-list",
                              "skip-list --json", "rollback --dry-run"),
    "checkpoints/verified.json": ("checkpoints", "checkpoints --json", "checkpoints --quick", "rollback --dry-run"),
    f"{CKPT}/manifest.json": ("checkpoints", "checkpoints --json", "checkpoints --quick", "status", "status --json",
                              "rollback --dry-run", "skip-list --json"),
    f"{CKPT}/train_state.json": ("checkpoints --quick", "skip-list --json", "rollback --dry-run"),
    "run.json": ("status --json", "checkpoints --json", "skip-list --json"),
    "bus/url": ALL,
}
# the fields of a document its readers use, where the document has many more (a config, a train state)
FIELDS = {
    "config.yaml": [("run_id",), ("max_steps",), ("optim",), ("optim", "warmup_steps"), ("optim", "decay_steps"),
                    ("data",), ("data", "skip")],
    f"{CKPT}/train_state.json": [("skiplist",), ("step",), ("timeline",)],
}
LOGS = ("steps.jsonl", "incidents.jsonl", "pages.jsonl", "directives.jsonl", "audit.jsonl")


def run_all(run: Path, names, tmp_path: Path) -> dict[str, object]:
    """Run each command; return {name: Result}; a traceback is turned into a readable failure."""
    cmds = commands(run, tmp_path / "r.png")
    results = {}
    for name in names:
        res = CliRunner().invoke(main, cmds[name])
        results[name] = res
    return results


def check_no_traceback(results: dict, where: str) -> list[str]:
    problems = []
    for name, res in results.items():
        if res.exception is not None and not isinstance(res.exception, SystemExit):
            last = traceback.format_exception_only(res.exception)[-1].strip()
            ours = [f for f in traceback.extract_tb(res.exception.__traceback__) if "/sentinel/" in f.filename]
            at = f" at {Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else ""
            problems.append(f"{where} | {name}: {last[:200]}{at}")
        elif "Traceback" in res.output:
            problems.append(f"{where} | {name}: traceback in the output")
    return problems


def one_line_error_or_ok(res, name_in_error: str) -> str | None:
    if res.exit_code == 0:
        return None
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    if res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and name_in_error in lines[0]:
        return None
    return f"exit {res.exit_code}, stderr {res.stderr[-300:]!r}"


@pytest.fixture(autouse=True)
def _no_env_bus(monkeypatch):
    monkeypatch.delenv("SENTINEL_REDIS_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "100")


def _copy(template: Path, tmp_path: Path) -> Path:
    return shutil.copytree(template, tmp_path / RUN_NAME)


# ------------------------------------------------------------------ line logs: skip, count, go on
def _good_shown(rel: str, results: dict) -> list[str]:
    """The good lines of the log are still what the commands show."""
    bad = []

    def js(name):
        r = results.get(name)
        return json.loads(r.stdout) if r is not None and r.exit_code == 0 else None

    if rel == "steps.jsonl":
        st = js("status --json")
        if not st or st["runs"][0]["step"] != 30:
            bad.append(f"status --json no longer shows step 30: {st and st['runs'][0].get('step')}")
        elif not st["runs"][0].get("rejected_lines") or not str(st["runs"][0].get("first_rejected")).startswith("steps.jsonl (line "):
            bad.append(f"status --json did not count the skipped lines: {st['runs'][0].get('first_rejected')}")
        if "status" in results and "malformed line(s) of the run directory; first: steps.jsonl (line " not in results["status"].stderr:
            bad.append(f"status did not warn about the skipped lines: {results['status'].stderr[-300:]!r}")
        bt = js("backtest --json")
        if not bt or not bt.get("rejected_lines"):
            bad.append(f"backtest --json did not count the rejected lines: {bt and bt.get('rejected_lines')}")
        rp = js("report --json")
        if not rp or rp["steps"] != 30:
            bad.append(f"report --json lost good steps: {rp and rp.get('steps')}")
        elif not rp["rejected_lines"] or not rp["first_rejected"].startswith("steps.jsonl:16: "):
            bad.append(f"report --json did not count the rejected lines: {rp['rejected_lines']} {rp['first_rejected']}")
        human = results.get("report")
        if human is None or "warning: skipped" not in human.stderr:
            bad.append("report did not warn about the skipped lines")
    elif rel == "incidents.jsonl":
        inc = js("incidents --json")
        ids = [i["id"] for i in inc["runs"][0]["incidents"]] if inc else []
        if f"{RUN_NAME}-t0-s21" not in ids:
            bad.append(f"incidents --json lost the good incident: {ids[:5]}")
        bad += _counted("incidents", inc, results)
    elif rel == "pages.jsonl":
        pg = js("pages --json")
        if not pg or "GOOD PAGE" not in [p["summary"] for p in pg["runs"][0]["pages"]]:
            bad.append("pages --json lost the good page")
        bad += _counted("pages", pg, results)
    elif rel == "audit.jsonl":
        inc = js("incidents --json")
        if not inc or "GOOD AUDIT" not in [a.get("reason") for a in inc["runs"][0].get("audit", [])]:
            bad.append("incidents --json lost the good audit line")
    elif rel == "directives.jsonl":
        inc = js("incidents --json")
        if not inc or "d1" not in [d.get("id") for d in inc["runs"][0].get("directives", [])]:
            bad.append("incidents --json lost the good directive")
    for name, res in results.items():
        if res.exit_code != 0:
            bad.append(f"{name}: exit {res.exit_code} on a log with good lines: {res.output[-300:]!r}")
    return bad


def _counted(cmd: str, as_json: dict | None, results: dict) -> list[str]:
    """The skipped lines are counted (--json: rejected_lines, first_rejected naming the file and the
    line) and said on stderr by the human view."""
    log = f"{cmd}.jsonl"
    run = as_json["runs"][0] if as_json else {}
    bad = []
    if not run.get("rejected_lines") or not re.match(rf"{log}:\d+: ", str(run.get("first_rejected"))):
        bad.append(f"{cmd} --json did not count the skipped lines: {run.get('rejected_lines')} {run.get('first_rejected')}")
    human = results.get(cmd)
    if human is None or f"skipped {run.get('rejected_lines')} malformed line(s) of the run directory; first: {log}:" not in human.stderr:
        bad.append(f"{cmd} did not warn about the skipped lines: {human and human.stderr[-300:]!r}")
    return bad


@pytest.mark.parametrize("rel", LOGS + ("audit.jsonl-alone", "directives.jsonl-alone"))
def test_hostile_lines_in_a_log_are_skipped_and_good_lines_shown(rel, template, tmp_path):
    run = _copy(template, tmp_path)
    if rel.endswith("-alone"):  # no incidents: `sentinel incidents` lists the audit and directives logs instead
        rel = rel.removesuffix("-alone")
        (run / "incidents.jsonl").unlink()
    path = run / rel
    good = path.read_bytes().splitlines(keepends=True)
    # the log's first good line as the template of every hostile one; the good lines stay around them
    sample = good[1] if rel == "steps.jsonl" else good[0]
    bad = hostile_lines(sample.rstrip(b"\n"), VALUES, DISTINCT.get(rel))
    if rel == "steps.jsonl":  # hostile lines amid the steps, the last good step stays last
        body = b"".join(good[:15]) + b"".join(b + b"\n" for b in bad) + b"".join(good[15:])
    else:
        body = b"".join(b + b"\n" for b in bad) + b"".join(good)
    path.write_bytes(body)
    results = run_all(run, READERS[rel], tmp_path)
    problems = check_no_traceback(results, rel) or _good_shown(rel, results)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("variant", ["empty", "blank", "binary-only", "torn-only", "deep-only"])
@pytest.mark.parametrize("rel", LOGS)
def test_a_log_with_nothing_readable_is_no_traceback(rel, variant, template, tmp_path):
    run = _copy(template, tmp_path)
    first = (run / rel).read_bytes().splitlines()[0]
    body = {"empty": b"", "blank": b"\n \n", "binary-only": GARBAGE + b"\n", "torn-only": first[: len(first) // 2],
            "deep-only": SHAPES["deep"] + b"\n"}[variant]
    (run / rel).write_bytes(body)
    results = run_all(run, READERS[rel], tmp_path)
    problems = check_no_traceback(results, f"{rel}[{variant}]")
    for name, res in results.items():
        why = one_line_error_or_ok(res, rel)
        if why:
            problems.append(f"{rel}[{variant}] | {name}: {why}")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ whole documents: cope, or one line naming the file
DOCS = ("skiplist.json", "config.yaml", "pending_rollback.json", "checkpoints/verified.json", f"{CKPT}/manifest.json",
        f"{CKPT}/train_state.json", "run.json", "bus/url")


@pytest.mark.parametrize("rel", DOCS)
def test_hostile_documents_give_no_traceback(rel, template, tmp_path):
    run = _copy(template, tmp_path)
    path = run / rel
    if rel == "bus/url":
        path.parent.mkdir(exist_ok=True)
        variants = {"empty": b"", "binary": GARBAGE, "text": b"not a url", "deep": SHAPES["deep"],
                    "no-port": b"redis://127.0.0.1:notaport/0", "nul": b"redis://\x00", "unix": b"unix:///nonexistent"}
    else:
        variants = hostile_documents(path.read_bytes(), yaml_doc=rel.endswith(".yaml"), fields=FIELDS.get(rel))
    problems: list[str] = []
    for name, body in variants.items():
        path.write_bytes(body)
        readers = READERS[rel]
        if rel == "config.yaml" and name.startswith(("run_id=", "data")):  # the report (~0.5 s) reads optim, max_steps
            readers = readers[:-1]
        results = run_all(run, readers, tmp_path)
        tb = check_no_traceback(results, f"{rel}[{name}]")
        problems += tb
        if tb:
            continue
        for cmd, res in results.items():
            why = one_line_error_or_ok(res, Path(rel).name)
            if why:
                problems.append(f"{rel}[{name}] | {cmd}: {why}")
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:60])


def test_hostile_checkpoint_directory_names_and_files(template, tmp_path):
    """Odd entries under checkpoints/: a step dir that is a file, a manifest that is a directory,
    a step number beyond int64, a manifest that is binary."""
    run = _copy(template, tmp_path)
    ck = run / "checkpoints"
    (ck / "step-99999999999999999999999999").mkdir()
    (ck / "step-00000040").write_bytes(GARBAGE)
    (ck / "step-00000050").mkdir()
    (ck / "step-00000050" / "manifest.json").mkdir()
    (ck / "step-00000060").mkdir()
    (ck / "step-00000060" / "manifest.json").write_bytes(GARBAGE)
    results = run_all(run, ALL, tmp_path)
    problems = check_no_traceback(results, "checkpoints/")
    for cmd, res in results.items():
        why = one_line_error_or_ok(res, "checkpoints")
        if why:
            problems.append(f"checkpoints/ | {cmd}: {why}")
    assert not problems, "\n".join(problems)
    cps = json.loads(results["checkpoints --json"].stdout)
    assert 30 in [c["step"] for c in cps["runs"][0]["checkpoints"]] if "runs" in cps else True


# ------------------------------------------------------------------ the offline tools that import torch
@pytest.mark.parametrize("variant", ["deep", "deep-object", "binary", "list", "empty-object", "truncated", "steps=text"])
def test_replay_and_verify_refuse_a_hostile_config_in_one_line(variant, template, tmp_path):
    """replay-batch and verify-resume read config.yaml through the trainer's loader before any
    worker starts: a hostile one is one line naming the file (a 50,000-deep or binary config was a
    RecursionError / UnicodeDecodeError). Step 999 does not exist, so nothing is ever launched."""
    run = _copy(template, tmp_path)
    good = (run / "config.yaml").read_bytes()
    body = {"truncated": good[: len(good) // 3], "steps=text": good.replace(b"max_steps: 30", b"max_steps: x")}.get(
        variant) or SHAPES[variant]
    (run / "config.yaml").write_bytes(body)
    for cmd in (["replay-batch", str(run), "--step", "999"], ["verify-resume", str(run), "--from-step", "999"]):
        res = CliRunner().invoke(main, cmd)
        problems = check_no_traceback({cmd[0]: res}, f"config.yaml[{variant}]")
        assert not problems, problems
        # {} and a cut-short config can still be valid YAML for defaults: then it is step 999 that is missing
        why = one_line_error_or_ok(res, "" if variant in ("empty-object", "truncated") else "config.yaml")
        assert res.exit_code == 2 and why is None, (cmd[0], why, res.output[-300:])


# ------------------------------------------------------------------ the other side: the trainer's start
@pytest.mark.parametrize("variant", ["deep", "binary", "list", "to_step=text", "to_step=null", "ranges=number", "ranges=text"])
def test_trainer_refuses_a_hostile_pending_rollback_in_one_line(variant, template, tmp_path):
    """A pending_rollback.json no `sentinel rollback` wrote stops the trainer's start with one line
    naming it (it was a RecursionError / TypeError traceback), and the plan stays for the operator."""
    from tests.helpers.trainer import assert_one_line_error, run_trainer

    run = _copy(template, tmp_path)
    body = {"to_step=text": b'{"to_step": "x", "ranges": []}', "to_step=null": b'{"to_step": null, "ranges": []}',
            "ranges=number": b'{"to_step": 20, "ranges": [5]}',
            "ranges=text": b'{"to_step": 20, "ranges": [["a", "b"]]}'}.get(variant) or SHAPES[variant]
    (run / "pending_rollback.json").write_bytes(body)
    before = (run / "steps.jsonl").read_bytes()
    assert_one_line_error(run_trainer(run, timeout=120), contains="pending_rollback.json")
    assert (run / "pending_rollback.json").read_bytes() == body and (run / "steps.jsonl").read_bytes() == before


# ------------------------------------------------------------------ the daemon on a hostile run dir
HOSTILE_CONFIGS = {"deep": b"[" * 50_000, "binary": b"\xff\xfe\x00\x01garbage", "list": b"[1, 2]\n", "number": b"42\n"}


@pytest.mark.parametrize("variant", sorted(HOSTILE_CONFIGS))
def test_run_id_of_a_hostile_config_is_the_directory_name(variant, tmp_path):
    from sentinel.rundir import run_id_of

    d = tmp_path / "myrun"
    d.mkdir()
    (d / "config.yaml").write_bytes(HOSTILE_CONFIGS[variant])
    assert run_id_of(d) == "myrun"


def test_the_daemon_watches_a_run_dir_whose_config_is_hostile(embedded_bus):
    """`sentinel run RUN_DIR` read config.yaml for the run id with its own unguarded copy of
    ``rundir.run_id_of``: a config nested 50,000 deep was a RecursionError traceback at start."""
    import signal
    import subprocess
    import sys

    run = embedded_bus.run_dir  # a run dir with a live embedded bus
    (run / "config.yaml").write_bytes(HOSTILE_CONFIGS["deep"])
    env = {**os.environ, "COLUMNS": "200"}
    env.pop("SENTINEL_REDIS_URL", None)
    p = subprocess.Popen([sys.executable, "-m", "sentinel", "run", str(run), "--metrics-port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out = ""
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and p.poll() is None and f"watching run {run.name}" not in out:
            out += p.stdout.readline()
        assert f"watching run {run.name}" in out, out[-2000:]
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=60)
        out += rest
    assert "Traceback" not in out, out[-2000:]
    assert p.returncode == 0, out[-2000:]


# ------------------------------------------------------------------ the views on a copy of the shared 30-step run (base_run)


def test_a_fifo_as_the_runs_bus_url_does_not_wedge_the_views(run_copy):
    # a run whose steps.jsonl changed within the minute has not stopped, so the views say what is wrong
    # with its bus (of a stopped run they say nothing: its bus is down because the run is over); the
    # copy keeps the shared run's mtime, which is minutes old once the session has run a while
    os.utime(run_copy / "steps.jsonl")
    (run_copy / "bus").mkdir(exist_ok=True)
    url = run_copy / "bus" / "url"
    url.unlink(missing_ok=True)
    os.mkfifo(url)
    for view in ("status", "checkpoints", "pages", "incidents", "skip-list"):
        res = cli(view, str(run_copy))
        assert res.exit_code == 0, (view, res.output, res.stderr)
        assert "FIFO" in res.output + res.stderr or view == "skip-list", view


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
    one_line_error(cli("rollback", d, "--to-step", "20", "--yes"), "corrupt")
    doc["step"] = 30
    m.write_text(json.dumps(doc))
    rows = {c["step"]: c for c in cli_json("checkpoints", d)["checkpoints"]}
    assert "not the step of its directory" in rows[20]["problem"]
    one_line_error(cli("rollback", d, "--before-step", "99999999999999999999", "--dry-run"), "past the run's last step")


def test_pages_limit_zero_shows_all_a_report_names_no_none_and_a_fifo_checkpoint_file_is_no_regular_file(run_copy):
    """`pages --limit 0` shows all, as `incidents --limit 0` does (it was an error); `report` no
    longer says "from none"; a checkpoint file that is a FIFO is "no regular file", not "missing"."""
    d = str(run_copy)
    assert cli("pages", d, "--limit", "0").exit_code == 0
    res = cli("report", d, "--out", str(run_copy / "r.png"))
    assert res.exit_code == 0 and "from none" not in res.stdout
    f = run_copy / "checkpoints" / "step-00000020" / "optim.safetensors"
    f.unlink()
    os.mkfifo(f)
    rows = {c["step"]: c for c in cli_json("checkpoints", d)["checkpoints"]}
    assert rows[20]["verified"] == "corrupt" and rows[20]["problem"] == "optim.safetensors is no regular file"
