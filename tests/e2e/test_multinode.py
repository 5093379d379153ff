"""A real two-node launch on one machine: two ``torchrun`` agents as two nodes (``--nnodes 2
--nproc-per-node 1``, c10d rendezvous on 127.0.0.1), the run's embedded bus, ``sentinel run`` and a
real Prometheus (file-SD from the run's ``metrics_targets.json``, the shipped training rules with
TrainingRankDown's ``for:`` cut to 2 s) beside them.

Node 1 is lost mid-run: first frozen (SIGSTOP on its agent and worker: what the other node sees of
a node that lost power or its network, no connection reset), then SIGKILLed. Then:
* while it is frozen, Prometheus fires TrainingRankDown for rank 1 of the run (rank 0 waits in the
  collective, its endpoint up), and the sentinel pages (``heartbeat_stale``: the run's heartbeat
  stopped; ``stale_seconds`` is 3 s here);
* once it is killed, the survivor gets a connection reset and exits: every rank is down, the run
  looks finished to Prometheus and TrainingRankDown resolves (a wholly dead run is the page's job);
* both nodes are started again with the same command: they rendezvous, resume from the newest
  checkpoint, and every step they redo is bitwise the step the first attempt logged (loss, grad
  norm, parameter digest, batch fingerprint, sample ids, ...).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.helpers.e2e import Procs, clean_env
from tests.helpers.prometheus import Prom, fast_rules, wait_until
from tests.helpers.services import find_binary, free_port, start_logged, stop_process, wait_http_ready
from tests.helpers.trainer import EXACT_FIELDS, TORCHRUN, descendants, kill_all, last_step, trajectory

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
CKPT_EVERY = 20
KILL_AFTER = 70  # steps on disk before node 1 dies: past a few checkpoints, with steps after the newest
EXTRA_AFTER_RESUME = 20  # the resumed run trains this far past the kill, then is stopped
MAX_STEPS = 100_000  # open-ended, the same in both attempts: the LR schedule depends on it
RULES = """
version: 1
rules:
  heartbeat_stale:
    stale_seconds: 3
    cooldown_seconds: 600
"""


@pytest.fixture
def run_dir(tmp_path, procs) -> Path:
    """The run's directory; at teardown its processes die first, then its embedded bus is stopped."""
    from sentinel.embedded import stop_embedded

    path = tmp_path / "gpt-mn"
    yield path
    procs.kill_all()
    stop_embedded(path)


def _node_cmd(rdzv_port: int, rdzv_id: str, run_dir: Path, data_dir: Path, max_steps: int) -> list[str]:
    """One node's command line (the same on every node, as on a cluster)."""
    return [TORCHRUN, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", rdzv_id,
            "--max-restarts", "0", "-m", "trainer", "--preset", "tiny", "--run-dir", str(run_dir), "--data", str(data_dir),
            "--max-steps", str(max_steps), "--ckpt-every", str(CKPT_EVERY), "--keep-last", "50",
            "--metrics-port", "0", "--redis-url", "embedded"]


def _launch(procs: Procs, run_dir: Path, data_dir: Path, max_steps: int, tag: str) -> list:
    port, rdzv_id = free_port(), f"mn-{uuid.uuid4().hex[:8]}"
    cmd = _node_cmd(port, rdzv_id, run_dir, data_dir, max_steps)
    return [procs.start(cmd, run_dir.parent / f"node{node}-{tag}.log", clean_env()) for node in (0, 1)]


def _resumed_from(run_dir: Path) -> int:
    """from_step of the last resume marker in steps.jsonl."""
    found = None
    for line in (run_dir / "steps.jsonl").read_text().splitlines():
        if '"from_step"' in line:
            found = int(json.loads(line)["from_step"])
    assert found is not None, "no resume marker in steps.jsonl"
    return found


def _wait(what: str, cond, timeout: float, logs: list[Path], interval: float = 0.25):
    return wait_until(what, cond, timeout, lambda: "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs if p.exists()), interval)


def test_a_killed_node_pages_fires_training_rank_down_and_the_restart_resumes_bitwise(tmp_path, data_dir, procs, run_dir):
    prometheus = find_binary("prometheus")
    logs = [tmp_path / "node0-a.log", tmp_path / "node1-a.log", tmp_path / "sentinel.log", tmp_path / "prometheus.log"]
    agents = _launch(procs, run_dir, data_dir, MAX_STEPS, "a")
    _wait("the bus and the first steps", lambda: (run_dir / "bus" / "url").is_file() and last_step(run_dir / "steps.jsonl") > 0,
          180, logs)

    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    procs.start([sys.executable, "-m", "sentinel", "run", str(run_dir), "--rules", str(rules), "--metrics-port", "0"],
                tmp_path / "sentinel.log", clean_env(COLUMNS="200"))
    port = free_port()
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": fast_rules(tmp_path, {"TrainingRankDown"}),
        "scrape_configs": [{"job_name": "sentinel-trainer", "honor_labels": True, "scrape_timeout": "1s",
                            "file_sd_configs": [{"files": [str(run_dir / "metrics_targets.json")], "refresh_interval": "1s"}]}],
    }))  # fmt: skip
    prom_proc = start_logged([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], logs[3])
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/-/ready", prom_proc, logs[3])
        prom = Prom(f"http://127.0.0.1:{port}")
        _wait("both ranks scraped up", lambda: sorted(
            r["metric"].get("rank") for r in prom.get("/api/v1/query", query='up{job="sentinel-trainer"} == 1')["result"]) == ["0", "1"],
            60, logs)
        assert "TrainingRankDown" not in prom.alerts()
        # mid-way between two checkpoints, so the restart has steps to redo
        _wait(f"step {KILL_AFTER}, half a checkpoint interval on", lambda: (s := last_step(run_dir / "steps.jsonl")) >= KILL_AFTER
              and CKPT_EVERY // 2 <= s % CKPT_EVERY < CKPT_EVERY - 2, 180, logs, interval=0.01)

        # node 1 is lost: frozen first (SIGSTOP, agent and worker), as a node that lost power or its
        # network looks to the others: no reset, no answer. Rank 0 waits in the collective, its
        # endpoint still up.
        node1 = [*descendants(agents[1].pid), agents[1].pid]
        for pid in node1:
            os.kill(pid, signal.SIGSTOP)
        fired = _wait("TrainingRankDown firing for rank 1", lambda: [
            a for a in prom.alerts().get("TrainingRankDown", []) if a["state"] == "firing"], 60, logs)
        assert [(a["labels"]["rank"], a["labels"]["run"]) for a in fired] == [("1", run_dir.name)], fired
        page = _wait("the sentinel's heartbeat_stale page", lambda: [
            p for p in (json.loads(ln) for ln in (run_dir / "pages.jsonl").read_text().splitlines() if ln.strip())
            if p.get("rule") == "heartbeat_stale"] if (run_dir / "pages.jsonl").exists() else None, 60, logs)
        assert page[0]["severity"] == "critical" and page[0]["run"] == run_dir.name, page
        # then killed (SIGKILL): the survivor gets a connection reset and exits. With every rank down the
        # run looks finished to Prometheus, and TrainingRankDown resolves (that case is the page's).
        kill_all(agents[1], node1)
        killed_at = last_step(run_dir / "steps.jsonl")
        _wait("node 0 exits once its peer is gone", lambda: agents[0].poll() is not None, 120, logs)
        prom.wait("TrainingRankDown resolved with every rank down", lambda: "TrainingRankDown" not in prom.alerts())
    finally:
        stop_process(prom_proc)
    if agents[0].poll() is None:  # the survivor, if the test failed before it exited
        kill_all(agents[0], descendants(agents[0].pid))
    first = trajectory(run_dir)
    assert max(first) >= killed_at - 1

    # the same command on both nodes again: rendezvous, resume from the newest checkpoint, bitwise.
    # Same --max-steps (the LR schedule depends on it); `sentinel stop` (checkpoint, then exit) ends it.
    again = _launch(procs, run_dir, data_dir, MAX_STEPS, "b")
    logs[:2] = [tmp_path / "node0-b.log", tmp_path / "node1-b.log"]
    _wait(f"the resumed run past step {killed_at + EXTRA_AFTER_RESUME}",
          lambda: last_step(run_dir / "steps.jsonl") >= killed_at + EXTRA_AFTER_RESUME, 240, logs)
    stop = subprocess.run([sys.executable, "-m", "sentinel", "stop", str(run_dir), "--reason", "test done"],
                          capture_output=True, text=True, env=clean_env(), timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    for a in again:
        assert a.wait(timeout=120) == 0, logs[0].read_text()[-3000:]
    resumed_from = _resumed_from(run_dir)
    after = trajectory(run_dir)
    redone = [s for s in first if resumed_from < s <= max(first)]
    assert len(redone) >= CKPT_EVERY // 2 - 2 and max(after) >= killed_at + EXTRA_AFTER_RESUME, (resumed_from, max(first), max(after))
    diffs = {s: sorted(f for f in EXACT_FIELDS if first[s][f] != after[s][f]) for s in redone}
    assert not any(diffs.values()), {s: d for s, d in diffs.items() if d}
