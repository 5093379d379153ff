"""Alerting rules (alerts/), their promtool unit tests, their runbooks, and a real alert pipeline.

* The generated rule files are current (``python -m alerts.build --check``) and every alert has a
  severity, a summary and description, a ``for:`` (Watchdog aside), and the ``runbook_url`` of the
  one pattern ``<RUNBOOK_BASE>/docs/runbooks/<AlertName>.md``.
* ``promtool check rules`` is clean and ``promtool test rules`` passes for alerts/tests/*-test.yaml;
  every alert has a "fires when" case and a "does not fire when" case (``exp_alerts: []``), and
  every firing expectation asserts the runbook_url.
* Every alert has docs/runbooks/<AlertName>.md with Meaning / Impact / Diagnosis / Mitigation, and
  every runbook belongs to an alert.
* Slow: Debian prometheus (``--rules.alert.resend-delay=1s``, the real alerts/sentinel.yaml with
  its Watchdog, plus a fast-firing rule on a real scraped series) sends to Debian
  ``prometheus-alertmanager`` (free ports, tmp storage, no cluster), which routes to a webhook
  receiver served by this test. The Watchdog notification must arrive, with its runbook_url.

A missing promtool/prometheus/alertmanager fails under CI (CI=true) and skips elsewhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers.services import (
    Webhook,
    find_binary,
    free_port,
    start_logged,
    stop_process,
    wait_http_ready,
)

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
RULE_FILES = sorted(p for p in ALERTS.glob("*.yaml"))
TEST_FILES = sorted((ALERTS / "tests").glob("*-test.yaml"))
RUNBOOKS = ROOT / "docs" / "runbooks"
HEADINGS = ["Meaning", "Impact", "Diagnosis", "Mitigation"]
SEVERITIES = {"critical", "warning", "info", "none"}


def _alerts() -> dict[str, dict]:
    out = {}
    for f in RULE_FILES:
        for g in yaml.safe_load(f.read_text())["groups"]:
            for r in g["rules"]:
                if "alert" in r:
                    assert r["alert"] not in out, f"duplicate alert {r['alert']}"
                    out[r["alert"]] = r
    return out


def _cases() -> list[tuple[str, dict]]:
    """(test name, alert_rule_test entry) over every promtool test file."""
    out = []
    for f in TEST_FILES:
        for t in yaml.safe_load(f.read_text())["tests"]:
            out += [(t["name"], a) for a in t.get("alert_rule_test", [])]
    return out


# ------------------------------------------------------------------ static checks
def test_rule_files_are_generated_and_current():
    from alerts import build

    assert {p.name for p in RULE_FILES} == {p.name for p in build.sources()} == {"training.yaml", "sentinel.yaml"}
    assert build.main(["--check"]) == 0, "alerts/*.yaml are stale: run `python -m alerts.build`"


def test_every_alert_is_labelled_annotated_and_linked_to_its_runbook():
    from alerts import build

    alerts = _alerts()
    assert {"Watchdog", "TrainingLossSpike", "TrainingStalled", "TrainingCheckpointTooOld", "TrainingThroughputLow",
            "TrainingNonFiniteSkips", "TrainingRankStraggler", "TrainingTelemetryDropping",
            "TrainingDirectivesRejected", "SentinelDown", "SentinelNoLeader", "SentinelEscalation",
            "SentinelBusErrors"} <= set(alerts)  # fmt: skip
    for name, r in alerts.items():
        assert re.fullmatch(r"[A-Z][A-Za-z0-9]+", name), name
        assert r["labels"]["severity"] in SEVERITIES, name
        ann = r["annotations"]
        assert ann.get("summary") and ann.get("description"), name
        assert ann["runbook_url"] == f"{build.RUNBOOK_BASE}/docs/runbooks/{name}.md", name
        if name != "Watchdog":  # Watchdog fires at once by design
            assert "for" in r, f"{name}: no for: duration"
    assert alerts["Watchdog"]["expr"].strip() == "vector(1)"


def test_builder_refuses_a_hand_written_runbook_url():
    from alerts import build

    doc = {"groups": [{"name": "g", "rules": [{"alert": "X", "expr": "1", "annotations": {"runbook_url": "u"}}]}]}
    with pytest.raises(ValueError, match="runbook_url"):
        build.add_runbook_links(doc)


def test_every_alert_has_a_runbook_with_the_four_sections():
    alerts = set(_alerts())
    books = {p.stem for p in RUNBOOKS.glob("*.md")}
    assert alerts - books == set(), f"alerts without a runbook: {sorted(alerts - books)}"
    assert books - alerts == set(), f"runbooks without an alert: {sorted(books - alerts)}"
    for name in alerts:
        text = (RUNBOOKS / f"{name}.md").read_text()
        assert text.startswith(f"# {name}\n"), name
        found = re.findall(r"^## (.+)$", text, re.M)
        assert found == HEADINGS, f"{name}: sections {found}, want {HEADINGS}"
        for body in re.split(r"^## .+$", text, flags=re.M)[1:]:
            assert len(body.strip()) > 40, f"{name}: an empty section"
    # the on-call's hands appear where they are needed
    text = " ".join(p.read_text() for p in RUNBOOKS.glob("*.md"))
    for cmd in ("sentinel status RUN", "sentinel incidents RUN", "sentinel replay-batch RUN --step N",
                "sentinel rollback RUN --before-step N --skip A:B", "sentinel verify-resume RUN --from-step C",
                "sentinel checkpoints RUN", "Align the timeline", "Replay the batch", "Incidental or structural"):
        assert cmd in text, cmd


def test_every_alert_has_firing_and_quiet_promtool_cases():
    fires, quiet = set(), set()
    for name, case in _cases():
        exp = case.get("exp_alerts")
        assert exp is not None, name
        if exp:
            assert name.startswith(f"{case['alertname']} fires when"), name
            fires.add(case["alertname"])
            for a in exp:
                assert a["exp_annotations"]["runbook_url"].endswith(f"/docs/runbooks/{case['alertname']}.md"), name
        else:
            assert name.startswith(f"{case['alertname']} does not fire when"), name
            quiet.add(case["alertname"])
    alerts = set(_alerts())
    assert alerts - fires == set(), f"no 'fires when' case: {sorted(alerts - fires)}"
    assert alerts - {"Watchdog"} - quiet == set(), f"no 'does not fire when' case: {sorted(alerts - quiet)}"


def test_promtool_check_rules_is_clean():
    promtool = find_binary("promtool")
    p = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "WARNING" not in (p.stdout + p.stderr).upper(), p.stdout + p.stderr


@pytest.mark.parametrize("test_file", TEST_FILES, ids=lambda p: p.name)
def test_promtool_test_rules(test_file):
    promtool = find_binary("promtool")
    p = subprocess.run([promtool, "test", "rules", test_file.name], cwd=test_file.parent,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0 and "SUCCESS" in p.stdout, p.stdout + p.stderr


# ------------------------------------------------------------------ slow: a real alert pipeline


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_watchdog_reaches_alertmanager_receiver(tmp_path):
    prometheus = find_binary("prometheus")
    alertmanager = find_binary("prometheus-alertmanager")
    hook = Webhook()
    am_port, prom_port = free_port(), free_port()
    am_cfg = tmp_path / "alertmanager.yml"
    am_cfg.write_text(yaml.safe_dump({
        "route": {"receiver": "webhook", "group_by": ["alertname"], "group_wait": "1s", "group_interval": "1s",
                  "repeat_interval": "1h"},
        "receivers": [{"name": "webhook", "webhook_configs": [{"url": hook.url, "send_resolved": False}]}],
    }))  # fmt: skip
    fast = tmp_path / "fast.yaml"  # fires on a real series: Prometheus' scrape of itself
    fast.write_text(yaml.safe_dump({"groups": [{"name": "e2e", "rules": [{
        "alert": "PipelineE2EFastFiring", "expr": 'up{job="prometheus"} == 1', "for": "0s",
        "labels": {"severity": "none"}, "annotations": {"summary": "test rule"}}]}]}))  # fmt: skip
    prom_cfg = tmp_path / "prometheus.yml"
    prom_cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS / "sentinel.yaml"), str(fast)],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{prom_port}"]}]}],
    }))  # fmt: skip
    procs = []
    try:
        am_log = tmp_path / "alertmanager.log"
        procs.append(am := start_logged([alertmanager, f"--config.file={am_cfg}", f"--storage.path={tmp_path / 'am'}",
                                   f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address=",
                                   "--log.level=warn"], am_log))  # fmt: skip
        wait_http_ready(f"http://127.0.0.1:{am_port}/-/ready", am, am_log)
        prom_log = tmp_path / "prometheus.log"
        procs.append(prom := start_logged([prometheus, f"--config.file={prom_cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}", "--rules.alert.resend-delay=1s",
                                     "--log.level=warn"], prom_log))  # fmt: skip
        wait_http_ready(f"http://127.0.0.1:{prom_port}/-/ready", prom, prom_log)

        deadline = time.monotonic() + 60
        names: set[str] = set()
        while time.monotonic() < deadline and not {"Watchdog", "PipelineE2EFastFiring"} <= names:
            names = {a["labels"]["alertname"] for a in hook.alerts() if a.get("status") == "firing"}
            time.sleep(0.2)
        assert {"Watchdog", "PipelineE2EFastFiring"} <= names, (
            f"got {sorted(names)} within 60 s\nprometheus: {prom_log.read_text()[-1500:]}\n"
            f"alertmanager: {am_log.read_text()[-1500:]}")
        (wd,) = [a for a in hook.alerts() if a["labels"]["alertname"] == "Watchdog"][:1]
        assert wd["labels"]["severity"] == "none"
        assert wd["annotations"]["runbook_url"].endswith("/docs/runbooks/Watchdog.md")
    finally:
        for p in reversed(procs):
            stop_process(p)
        hook.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
