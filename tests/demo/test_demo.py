"""`sentinel demo`, the main job, run as a user runs it: real 2-rank trainer, embedded bus, sentinel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_demo_detects_rolls_back_and_recovers(tmp_path):
    run_dir = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "sentinel", "demo", "--run-dir", str(run_dir), "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["returncode"] == 0 and out["steps"] == 200
    (rb,) = out["rollbacks"]
    fault = out["fault_sample_ids"][0]
    assert rb["to_step"] <= 100 - 20  # from before the drill, by the demo's margin
    assert any(lo <= fault < hi for lo, hi in rb["skip_ranges"])  # the data that caused it is skipped
    assert [i["state"] for i in out["incidents"]] == ["healthy"]  # recovery verified
    # what the demo says was skipped adds up to the skip list (the later skip-samples directives too)
    skipped = sum(h - lo for lo, h in rb["skip_ranges"]) + sum(x["samples"] for x in out["later_skips"])
    on_list = sum(h - lo for lo, h in json.loads((run_dir / "skiplist.json").read_text()))
    assert skipped == on_list, (skipped, on_list, out["later_skips"])
    assert "Traceback" not in p.stderr
    # the picture of it all (sentinel report): written into the run dir, its path in the output
    assert out["report"] == str(run_dir / "reports" / "run.png")
    assert Path(out["report"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_bad_input_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "sentinel", "demo", "--run-dir", str(tmp_path / "d"), "--steps", "50",
                        "--drill-step", "60"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "--drill-step" in p.stderr
