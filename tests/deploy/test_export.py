"""`sentinel export DIR`: the dashboards' JSON, the alert rule files, a PrometheusRule and dashboard
ConfigMaps, from the installed packages; `--check` finds a stale or missing file. The installed
wheel's copy is checked by tests/deploy/test_packaging.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.helpers.deploy import check_export
from tests.helpers.services import require_binary

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    from sentinel.cli import main

    out = tmp_path_factory.mktemp("export")
    res = CliRunner().invoke(main, ["export", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_export_writes_dashboards_rules_prometheusrule_and_configmaps(exported):
    check_export(exported)
    assert (exported / "dashboards" / "training.json").read_text() == (ROOT / "dashboards" / "training.json").read_text()
    assert (exported / "alerts" / "sentinel.yaml").read_text() == (ROOT / "alerts" / "sentinel.yaml").read_text()


def test_exported_rules_pass_promtool(exported):
    promtool = require_binary(shutil.which("promtool") or "/usr/bin/promtool")
    p = subprocess.run([promtool, "check", "rules", *map(str, sorted((exported / "alerts").glob("*.yaml")))],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr


def test_export_check_finds_stale_and_missing_files(exported, tmp_path):
    from sentinel.cli import main

    ok = CliRunner().invoke(main, ["export", "--check", str(exported)])
    assert ok.exit_code == 0 and "6 files current" in ok.output, ok.output
    stale = tmp_path / "x"
    shutil.copytree(exported, stale)
    (stale / "manifests" / "prometheusrule.yaml").write_text("old\n")
    (stale / "dashboards" / "sentinel.json").unlink()
    bad = CliRunner().invoke(main, ["export", "--check", str(stale)])
    assert bad.exit_code == 1
    assert "manifests/prometheusrule.yaml" in bad.output and "dashboards/sentinel.json" in bad.output


@pytest.mark.parametrize("args, message", [
    (["export"], "Missing argument 'DIR'"),
    (["export", "--only", "grafana", "d"], "'grafana' is not one of"),
    (["export", "/dev/null/x"], "error: "),
])
def test_export_refuses_bad_input_in_one_line(args, message, tmp_path):
    p = subprocess.run([sys.executable, "-c", "from sentinel.cli import main; main()", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode == 2, p
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
