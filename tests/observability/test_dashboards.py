"""Dashboards as code (dashboards/build.py): the committed JSON is the builder's output, and every
panel query works against a real Prometheus that scraped a real run and a real sentinel.

Fast checks: committed JSON == builder output (and ``--check`` says so), sorted keys, a ``refId`` on
every query (unique per panel), the ``run`` (and ``rank``) multi-select variables, every query scoped
to ``$run``, a unit and thresholds on every panel, panels that tile the grid, the top line of stats,
links between the dashboards and to every alert's runbook, no internal references in user-facing text.

Slow end-to-end check (``test_every_panel_query_returns_data``): Debian ``prometheus`` on 127.0.0.1
scrapes (1 s) a 2-rank ``torchrun`` training run through the scrape config of docs/metrics.md
(``honor_labels``, file SD on ``RUN_DIR/metrics_targets.json``) and a ``sentinel run`` daemon on the
run's embedded bus. The run trains on the mixture drill's 3-source dataset (so the slice row has
three slices) and carries the sentinel demo's drill (an ``lr`` x100 fault on one sample of step 150,
plus a NaN on one sample of step 200), so the sentinel really detects a spike, rolls back and skips
the data: rollback, action and latency panels have data too; a ``reweight`` drill at step 210 is the
mixture change the data-change annotation must show. Every panel target, with ``$run`` and
``$__rate_interval`` substituted, must parse and return at least one series at one moment of the
live run, except the few listed in ``EMPTY_OK`` with the reason a healthy CPU run leaves them empty
(then the query must still parse). Annotations are range queries in Grafana, so each must mark at
least one moment of the run (checked over the run's window).

A missing prometheus fails under CI (CI=true) and skips elsewhere; so does a missing SDK.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.helpers.prometheus import Prometheus
from tests.helpers.services import find_binary, free_port, skip_or_fail, wait_port
from tests.helpers.trainer import kill_all

ROOT = Path(__file__).resolve().parents[2]
DASH_DIR = ROOT / "dashboards"
NAMES = ("training.json", "sentinel.json")

STEPS = 300
DRILL_STEP = 150  # a checkpoint at 100 is >= 20 steps (the drill rollback margin) before the onset
RATE_INTERVAL = "10s"  # Grafana's $__rate_interval for a 1 s scrape at high resolution: >= 4 scrapes
# Targets a healthy CPU run legitimately leaves empty: (substring of the expr) -> why.
EMPTY_OK = {
    "training_cuda_memory_": "CUDA-only series (docs/metrics.md): not exported on a CPU run",
}
REWEIGHT_STEP = 210  # after the lr/nan drills (their sample ids assume the dataset's own weights)


@pytest.fixture(scope="module")
def build():
    try:
        from dashboards import build as b
    except ImportError as e:  # the SDK is the `dashboards` extra
        skip_or_fail(f"grafana-foundation-sdk not installed: {e}")
    return b


def _load(name: str) -> dict:
    return json.loads((DASH_DIR / name).read_text())


def _panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return [p for p in out if p.get("type") != "row"]


def _queries(d: dict) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and annotation of a dashboard JSON."""
    qs = [(f"{p['title']} / {t['refId']}", t["expr"]) for p in _panels(d) for t in p["targets"]]
    qs += [(f"annotation {a['name']}", a["expr"]) for a in d["annotations"]["list"] if "expr" in a]
    return qs


# ------------------------------------------------------------------ fast: JSON is the builder's output
@pytest.mark.parametrize("name", NAMES)
def test_committed_json_equals_builder_output(build, name):
    committed = (DASH_DIR / name).read_text()
    assert committed == build.render(name), f"dashboards/{name} is stale: run `python -m dashboards.build`"
    # sorted keys at every level, so regenerated JSON diffs cleanly
    assert json.dumps(json.loads(committed), sort_keys=True, indent=2) + "\n" == committed


def test_check_flag_detects_stale_json(build, tmp_path):
    assert build.main(["--out", str(tmp_path)]) == 0
    assert build.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "training.json").write_text("{}\n")
    assert build.main(["--check", "--out", str(tmp_path)]) == 1
    p = subprocess.run([sys.executable, "-m", "dashboards.build", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_training_dashboard_follows_the_inspection_order_with_a_timeline():
    """The 60-second inspection order is optimization, then systems, then slice eval, then decide;
    every change of training conditions is an annotation titled with its event."""
    d = _load("training.json")
    rows = [p["title"] for p in d["panels"] if p.get("type") == "row"]
    assert [r.split(".")[0] for r in rows] == ["1", "2", "3", "4"], rows
    assert "Optimization" in rows[0] and "Systems" in rows[1] and "Slice eval" in rows[2], rows
    # the slice row holds exactly the slice panels, between the systems row and the restores row
    y = {r["title"]: r["gridPos"]["y"] for r in d["panels"] if r.get("type") == "row"}
    in_slice_row = sorted(p["title"] for p in _panels(d) if y[rows[2]] < p["gridPos"]["y"] < y[rows[3]])
    assert in_slice_row == sorted(["Validation loss per slice", "Validation loss above its 2-hour best, per slice",
                                   "Validation perplexity per slice", "Probe-set loss per slice", "Train loss per source",
                                   "Mixture weights"]), in_slice_row  # fmt: skip
    timeline = [a for a in d["annotations"]["list"] if "training_timeline_events_total" in a.get("expr", "")]
    events = set()
    for a in timeline:
        assert a["titleFormat"] == "{{event}}" and a["tagKeys"] == "event", a
        events |= set(re.search(r'event=~"([^"]+)"', a["expr"]).group(1).split("|"))
    assert events == {"warmup_end", "decay_start", "mixture_change", "seq_len_change", "resume", "rollback"}
    assert len({a["iconColor"] for a in timeline}) == len(timeline)  # one colour per kind of change


def test_timeline_annotations_mark_each_event_with_promtool(tmp_path):
    """Every timeline annotation's exact query, run by promtool on counters that step 0 -> 1 (each event
    kind, seq_len_change included, at its own moment): it marks the moment of its own events, with the
    event label (the annotation title), and nothing a minute later nor for another annotation's events."""
    promtool = find_binary("promtool")
    timeline = [a for a in _load("training.json")["annotations"]["list"] if "training_timeline_events_total" in a.get("expr", "")]
    kinds = [e for a in timeline for e in re.search(r'event=~"([^"]+)"', a["expr"]).group(1).split("|")]
    assert "seq_len_change" in kinds
    # event i's counter is 0 until 3 (i + 1) minutes, then 1 (15 s samples)
    series = [{"series": f'training_timeline_events_total{{run="r", event="{e}"}}',
               "values": f"0x{12 * i + 11} 1x{12 * (len(kinds) - i) + 12}"} for i, e in enumerate(kinds)]
    tests = []
    for a in timeline:
        expr = _concrete(a["expr"], "r")
        for i, e in enumerate(kinds):
            mine = e in re.search(r'event=~"([^"]+)"', a["expr"]).group(1).split("|")
            tests.append({"expr": expr, "eval_time": f"{180 * (i + 1)}s",
                          "exp_samples": [{"labels": f'{{run="r", event="{e}"}}', "value": 1}] if mine else []})
            tests.append({"expr": expr, "eval_time": f"{180 * (i + 1) + 75}s", "exp_samples": []})
    spec = tmp_path / "annotations_test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "15s", "tests": [
        {"interval": "15s", "input_series": series, "promql_expr_test": tests}]}))
    p = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.mark.parametrize("name", NAMES)
def test_every_query_has_ref_id_and_run_scope(name):
    d = _load(name)
    (run_var,) = [v for v in d["templating"]["list"] if v["name"] == "run"]
    assert run_var["query"] == "label_values(training_step, run)"
    panels = _panels(d)
    assert panels
    for p in panels:
        refs = [t.get("refId") for t in p["targets"]]
        assert refs and all(refs) and len(set(refs)) == len(refs), f"{p['title']}: refIds {refs}"
        assert p["datasource"]["uid"] == "${datasource}"
    for where, expr in _queries(d):
        # every series is per run; the daemon-wide bus error counter is the one without a run label
        assert 'run=~"$run"' in expr or "sentinel_bus_errors_total" in expr, f"{where}: not scoped to $run: {expr}"
        assert 'run="$run"' not in expr, f"{where}: `run` is a multi-select, match it with =~"
    assert any(a["name"] == "Sentinel actions" for a in d["annotations"]["list"])


def test_training_dashboard_covers_the_operator_table():
    exprs = " ".join(e for _, e in _queries(_load("training.json")))
    for needed in ("training_loss", "exp(training_validation_loss", "training_grad_norm",
                   "training_grad_clipped_steps_total", "training_tokens_per_second", "training_mfu_ratio",
                   "training_step_duration_seconds_bucket", 'phase="data_wait"', "training_effective_token_ratio",
                   "training_checkpoint_age_seconds", "training_skipped_steps_total",
                   "training_resumes_total", "training_rollbacks_total", "process_resident_memory_bytes",
                   "time() - training_heartbeat_timestamp_seconds", "training_telemetry_dropped_total",
                   'max by (run) (training_rank_loss{run=~"$run", rank=~"$rank"}) - min by (run) (training_rank_loss{run=~"$run", rank=~"$rank"})',
                   # row 3, slice eval (issue 11)
                   "training_validation_slice_loss", "exp(training_validation_slice_loss", "training_probe_loss",
                   "training_slice_loss", "training_mixture_weight_ratio"):  # fmt: skip
        assert needed in exprs, needed
    sexprs = " ".join(e for _, e in _queries(_load("sentinel.json")))
    for needed in ("sentinel_steps_processed_total", "sentinel_rule_fired_total", "sentinel_actions_total",
                   "sentinel_incidents_open", "sentinel_detection_latency_seconds_bucket", "sentinel_leader",
                   "sentinel_bus_errors_total", "sentinel_records_rejected_total", "sentinel_records_trimmed_unread_total",
                   "sentinel_stream_lag_records", "sentinel_bus_restarts_total"):  # fmt: skip
        assert needed in sexprs, needed


@pytest.mark.parametrize("name", NAMES)
def test_every_panel_has_a_unit_and_thresholds(name):
    for p in _panels(_load(name)):
        defaults = p["fieldConfig"]["defaults"]
        assert defaults.get("unit"), f"{p['title']}: no unit"
        steps = defaults.get("thresholds", {}).get("steps")
        assert steps and steps[0]["value"] is None, f"{p['title']}: no thresholds (a base step at least)"
        levels = [s["value"] for s in steps[1:]]
        assert levels == sorted(levels), f"{p['title']}: threshold levels out of order"


@pytest.mark.parametrize("name", NAMES)
def test_panels_tile_the_grid_without_holes(name):
    """Every section (the panels above the first row, then each row's) fills a 24-wide rectangle
    exactly once: no hole, no overlap; each row starts right below the previous section."""
    d = _load(name)
    sections: list[list[dict]] = [[]]
    tops = [0]
    for p in d["panels"]:
        if p.get("type") == "row":
            g = p["gridPos"]
            assert (g["x"], g["w"], g["h"]) == (0, 24, 1), p["title"]
            sections.append([])
            tops.append(g["y"] + 1)
        else:
            sections[-1].append(p)
    bottom = 0
    for top, panels in zip(tops, sections):
        if top != tops[0]:
            assert top == bottom + 1, f"a row at y={top - 1}, the section above ends at {bottom}"
        if not panels:
            bottom = top - 1 if top else 0
            continue
        cells: dict[tuple[int, int], str] = {}
        for p in panels:
            g = p["gridPos"]
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{p['title']} overlaps {cells.get((x, y))}"
                    cells[(x, y)] = p["title"]
        bottom = max(y for _, y in cells) + 1
        holes = [(x, y) for y in range(top, bottom) for x in range(24) if (x, y) not in cells]
        assert not holes, f"{name}: holes at {holes[:5]}... in the section from y={top}"


def test_variables_run_multi_select_with_all_and_rank():
    for name in NAMES:
        by_name = {v["name"]: v for v in _load(name)["templating"]["list"]}
        assert by_name["run"]["multi"] is True and by_name["run"]["includeAll"] is True
    rank = {v["name"]: v for v in _load("training.json")["templating"]["list"]}["rank"]
    assert rank["multi"] is True and rank["includeAll"] is True and rank["allValue"] == ".*"
    assert 'run=~"$run"' in rank["query"]
    # every per-rank series is filtered by it
    for where, expr in _queries(_load("training.json")):
        for per_rank in ("training_rank_loss", "training_step_phase_seconds", "training_heartbeat_timestamp_seconds",
                         "training_effective_token_ratio", "process_resident_memory_bytes"):  # fmt: skip
            if per_rank + "{" in expr:
                assert f'{per_rank}{{run=~"$run", rank=~"$rank"' in expr, where


def test_training_dashboard_opens_with_the_six_stats():
    stats = [p for p in _load("training.json")["panels"] if p["gridPos"]["y"] == 0]
    assert [(p["type"], p["title"]) for p in stats] == [("stat", t) for t in (
        "Step", "Loss", "Tokens/s", "MFU", "Open incidents", "Checkpoint age")]


def test_dashboards_link_each_other_and_every_alert_runbook():
    from alerts.build import runbook_url

    training, daemon = _load("training.json"), _load("sentinel.json")
    for d, other in ((training, daemon), (daemon, training)):
        (link,) = [lk for lk in d["links"] if lk["url"] == f"/d/{other['uid']}"]
        assert link["keepTime"] and link["includeVars"]
    urls = {lk["url"] for d in (training, daemon) for lk in d["links"]}
    urls |= {lk["url"] for d in (training, daemon) for p in _panels(d) for lk in p.get("links", [])}
    alerts = [r["alert"] for f in sorted((ROOT / "alerts").glob("*.yaml"))
              for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"] if "alert" in r]
    assert len(alerts) >= 20
    missing = [a for a in alerts if runbook_url(a) not in urls]
    assert not missing, f"alerts without a runbook link on a dashboard: {missing}"
    for url in urls:
        if "/docs/runbooks/" in url and url.endswith(".md"):
            assert (ROOT / "docs" / "runbooks" / url.rsplit("/", 1)[1]).is_file(), url


INTERNAL_REF = re.compile(r"§|\bseed\s+0\d\d\b|\bthe seed's\b", re.I)


def test_no_internal_references_in_what_users_read():
    files = [*DASH_DIR.glob("*.json"), *(ROOT / "alerts").glob("*.yaml"), *(ROOT / "alerts" / "src").glob("*.yaml"),
             *(ROOT / "docs" / "runbooks").glob("*.md"), ROOT / "docs" / "metrics.md", DASH_DIR / "build.py"]
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1) if INTERNAL_REF.search(line)]
    assert not found, "\n".join(found)


# ------------------------------------------------------------------ slow: real Prometheus, real run
class RunAndSentinelPrometheus(Prometheus):
    """The docs' scrape config for the trainer, plus a job for the sentinel's own endpoint."""

    def __init__(self, binary: str, workdir: Path, targets_file: Path, sentinel_port: int) -> None:
        self.sentinel_port = sentinel_port
        super().__init__(binary, workdir, targets_file)

    def documented_config(self, targets_file: Path) -> dict:  # type: ignore[override]
        cfg = Prometheus.documented_config(targets_file)
        cfg["scrape_configs"].append({
            "job_name": "sentinel", "scrape_interval": "1s", "scrape_timeout": "1s", "honor_labels": True,
            "static_configs": [{"targets": [f"127.0.0.1:{self.sentinel_port}"]}],
        })  # fmt: skip
        return cfg


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for k in ("SENTINEL_REDIS_URL", "SENTINEL_SECRET"):
        env.pop(k, None)
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """The process and every descendant (torchrun's workers have their own sessions)."""
    if proc.poll() is None:
        kill_all(proc)


NAN_STEP = 200  # a one-step NaN the guard must skip (the "skipped steps" panels); after the first scrapes, as
# changes()/increase() only see a counter move that happened between two scrapes


def _drill_faults(data: Path, seed: int) -> list[str]:
    """The demo's lr drill, plus a NaN on one sample of an early step. The lr drill's damage may stay
    under the guard's conservative threshold (the sentinel's rollback handles it), so the NaN is what
    guarantees a guard skip. Then a mixture change (pydoc's weight halved) for the timeline."""
    from sentinel.drill import batch_ids_at
    from trainer.config import PRESETS

    preset = PRESETS["tiny"]
    gb = preset["data"]["micro_batch_size"] * preset["data"].get("grad_accum", 1) * 2
    at = lambda step: batch_ids_at(data, seq_len=preset["model"]["seq_len"], seed=seed,  # noqa: E731
                                   global_batch=gb, step=step)
    return ["--inject-fault", f"lr@{min(at(DRILL_STEP))}:100", "--inject-fault", f"nan@{min(at(NAN_STEP))}",
            "--inject-fault", f"reweight@pydoc:0.5:{REWEIGHT_STEP}"]


def _concrete(expr: str, run: str) -> str:
    # `rank` set to All (its all value .*), `run` to the run of the test
    return expr.replace("$run", run).replace("$rank", ".*").replace("$__rate_interval", RATE_INTERVAL)


@pytest.mark.slow
@pytest.mark.timeout(180)
def _step_or_none(entry):
    """A step stream entry's ``StepRecord``, or None (a marker, or an entry that is no record)."""
    from sentinel import bus
    from sentinel.protocol import SchemaError, StepRecord

    try:
        rec = bus.decode(entry)
    except SchemaError:
        return None
    return rec if isinstance(rec, StepRecord) else None


def test_every_panel_query_returns_data(tmp_path):
    from sentinel.drill import DEMO_RULES, ensure_mixture_prepared
    from sentinel.embedded import PID_FILE, bus_dir, ensure_embedded, stop_embedded

    binary = find_binary("prometheus")
    data = ensure_mixture_prepared(tmp_path / "mixture-data")
    run_dir = tmp_path / f"dash-{uuid.uuid4().hex[:8]}"  # run id = dir name: unique per test
    run_dir.mkdir()
    run = run_dir.name
    url = ensure_embedded(run_dir)
    # The trainer starts paused (a signed `pause` waits on its directive stream) and is resumed once
    # Prometheus has scraped both ranks: every counter is then seen at 0 before the drills move it,
    # however fast the run is (changes()/increase() need a sample before the change).
    from sentinel import bus
    from sentinel.protocol import Directive, Keys

    r, secret, keys = bus.connect(url), bus.load_secret(run_dir), Keys(run)
    bus.publish(r, keys.directives, Directive(run=run, kind="pause", reason="test: wait for scrapes").signed(secret))
    rules = tmp_path / "rules.yaml"
    rules.write_text(DEMO_RULES)
    (tmp_path / "prom").mkdir()
    s_port = free_port()
    prom = RunAndSentinelPrometheus(binary, tmp_path / "prom", run_dir / "metrics_targets.json", s_port)
    sentinel = trainer = None
    try:
        prom.wait_ready()
        sentinel = subprocess.Popen(
            [sys.executable, "-m", "sentinel", "run", str(run_dir), "--rules", str(rules), "--metrics-port", str(s_port),
             "--lease-ms", "3000"],
            cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, stdout=open(tmp_path / "sentinel.log", "wb"),
            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        wait_port(s_port, timeout=30, proc=sentinel)
        train_log = tmp_path / "train.log"
        started = time.time()
        trainer = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "trainer",
             "--preset", "tiny", "--run-dir", str(run_dir), "--max-steps", str(STEPS), "--eval-every", "20",
             "--ckpt-every", "50", "--keep-last", "30", "--seed", "1337", "--peak-flops", "1e12",
             *_drill_faults(data, 1337), "--data", str(data), "--redis-url", "embedded",
             "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--device", "cpu"],
            cwd=ROOT, env=_env(), stdin=subprocess.DEVNULL, stdout=open(train_log, "wb"), stderr=subprocess.STDOUT,
            start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert trainer.poll() is None, f"trainer exited early ({trainer.returncode}): {train_log.read_text()[-3000:]}"
            ups = prom.query(f'sum_over_time(up{{run="{run}"}}[5m])')
            if len(ups) == 2 and all(float(u["value"][1]) >= 2 for u in ups):
                break
            time.sleep(0.3)
        else:
            raise AssertionError("Prometheus never scraped both (paused) ranks")
        bus.publish(r, keys.directives, Directive(run=run, kind="resume", reason="test: scraped").signed(secret))
        r.xadd(keys.steps, {"d": b"\xff not a record"})  # a malformed entry: the bus-input panel's refused series
        # Evaluate at a moment while everything is live: after the run ends its series go stale.
        at = None
        deadline = time.monotonic() + 120
        held = False
        while at is None and time.monotonic() < deadline:
            assert trainer.poll() is None, f"trainer exited early ({trainer.returncode}): {train_log.read_text()[-3000:]}"
            if not held:  # rolled back and near the end: pause it, so that its series stay live however slow the
                # scrapes are on a busy machine (the run ending first made the readiness query never true)
                newest = [_step_or_none(e) for e in r.xrevrange(keys.steps, count=20)]  # the malformed one: None
                if any(x is not None and x.timeline >= 1 and x.step >= STEPS - 60 for x in newest):
                    bus.publish(r, keys.directives, Directive(run=run, kind="pause", reason="test: hold near the end")
                                .signed(secret))
                    held = True
            # evaluated at an explicit time, and every panel later at that same time: a later "now - 1 s"
            # could fall before the scrape that made the condition true (found on an idle machine)
            t_q = time.time()
            res = prom.query(f'training_step{{run="{run}"}} >= {STEPS - 60} and on (run) '
                             f'training_rollbacks_total{{run="{run}"}} > 0 and on (run) '
                             f'training_timeline_events_total{{run="{run}", event="mixture_change"}} > 0', t_q)  # fmt: skip
            if res:
                at = t_q
            time.sleep(0.5)
        assert at is not None, f"no rollback then step {STEPS - 60} in time:\n{train_log.read_text()[-3000:]}\n" + (
            (tmp_path / "sentinel.log").read_text()[-3000:])
        # (the run itself may go on: every query is evaluated at `at`, the end of the run is not needed)

        empty, justified = [], []
        window = f"{int(time.time() - started) + 5}s"  # the whole run so far
        for name in NAMES:
            for where, expr in _queries(_load(name)):
                q = _concrete(expr, run)
                assert "$" not in q, f"{name} {where}: unsubstituted variable in {q}"
                t_eval = at
                if where.startswith("annotation "):  # Grafana runs it over the visible range
                    q = f"max_over_time(({q})[{window}:1s])"
                    # a subquery evaluates at whole seconds at or before `at`: the scrape that made the
                    # readiness query true (a change in its last second) would fall after the last one
                    t_eval = math.ceil(at)
                series = prom.query(q, t_eval)  # asserts status == success: the query parses and evaluates
                if series:
                    continue
                why = next((w for k, w in EMPTY_OK.items() if k in expr), None)
                (justified if why else empty).append(f"{name} {where}: {q}")
        assert not empty, "panel queries with no data:\n" + "\n".join(empty)
        # the justified ones: CUDA memory is really absent
        assert prom.query(f'{{__name__=~"training_cuda_memory_.*", run="{run}"}}', at) == []
        assert len(justified) == 2, justified
        # the slice row shows every source of the mixture, and the timeline has each kind of change
        slices = {s["metric"]["slice"] for s in prom.query(f'training_validation_slice_loss{{run="{run}"}} > 0', at)}
        assert slices == {"shakespeare", "pydoc", "stdlib"}, slices
        events = {s["metric"]["event"] for s in prom.query(
            f'max_over_time(training_timeline_events_total{{run="{run}"}}[{window}]) > 0', at)}
        assert {"warmup_end", "decay_start", "mixture_change", "rollback"} <= events, events
        # the variable's query: label_values(training_step, run) lists this run
        body = json.loads(urllib.request.urlopen(f"{prom.url}/api/v1/label/run/values?match[]=training_step").read())
        assert run in body["data"], body
        # and the rank variable's, for this run: both ranks
        match = urllib.parse.quote(f'training_heartbeat_timestamp_seconds{{run=~"{run}"}}')
        body = json.loads(urllib.request.urlopen(f"{prom.url}/api/v1/label/rank/values?match[]={match}").read())
        assert body["data"] == ["0", "1"], body
        assert trainer.poll() in (None, 0), train_log.read_text()[-3000:]
    finally:
        for p in (trainer, sentinel):
            if p is not None:
                _kill_group(p)
        prom.stop()
        try:
            stop_embedded(run_dir)
        finally:
            with contextlib.suppress(ValueError, OSError):
                os.kill(int((bus_dir(run_dir) / PID_FILE).read_text()), signal.SIGKILL)
