"""A real Prometheus for the tests: started in the foreground on 127.0.0.1, queried over its HTTP API."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

from tests.helpers.bus import poll
from tests.helpers.metrics import DOCS
from tests.helpers.services import free_port

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
FAST_FOR = "2s"
UNDER_TEST = {"SentinelDown", "TrainingRankDown"}


class Prom:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: str) -> dict:
        q = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{q}", timeout=5) as r:
            return json.load(r)["data"]

    def alerts(self) -> dict[str, list[dict]]:
        """alertname -> active (pending or firing) alerts, for the two alerts under test."""
        out: dict[str, list[dict]] = {}
        for a in self.get("/api/v1/alerts")["alerts"]:
            if a["labels"]["alertname"] in UNDER_TEST:
                out.setdefault(a["labels"]["alertname"], []).append(a)
        return out

    def wait(self, what: str, cond, timeout: float = 30):
        return wait_until(what, cond, timeout, lambda: f"alerts now {self.alerts()}")


def wait_until(what: str, cond, timeout: float, detail=lambda: "", interval: float = 0.25):
    """``cond()``'s first truthy value, polled every ``interval`` s; else AssertionError(what, detail())."""
    got = poll(cond, timeout, interval)
    if not got:
        raise AssertionError(f"not within {timeout:.0f} s: {what}\n{detail()}")
    return got


def fast_rules(tmp: Path, alerts: set[str] = UNDER_TEST) -> list[str]:
    """The shipped rule files, with the ``for:`` of ``alerts`` cut to FAST_FOR."""
    out = []
    for f in sorted(ALERTS.glob("*.yaml")):
        doc = yaml.safe_load(f.read_text())
        for g in doc["groups"]:
            for r in g["rules"]:
                if r.get("alert") in alerts:
                    r["for"] = FAST_FOR
        (tmp / f.name).write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(str(tmp / f.name))
    return out


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


class Prometheus:
    """Debian prometheus in the foreground, owned by the test: ``stop()`` kills it."""

    def __init__(self, binary: str, workdir: Path, targets_file: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        self.config = workdir / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(self.documented_config(targets_file), sort_keys=False))
        self._log_f = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            cwd=workdir, stdin=subprocess.DEVNULL, stdout=self._log_f, stderr=subprocess.STDOUT,
        )  # fmt: skip

    @staticmethod
    def documented_config(targets_file: Path) -> dict:
        """docs/metrics.md's prometheus.yml with test timings and this run's targets file."""
        block = re.search(r"```yaml\n(# prometheus.yml\n.*?)```", DOCS.read_text(), re.S).group(1)
        cfg = yaml.safe_load(block)
        cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
        (job,) = cfg["scrape_configs"]
        assert job["honor_labels"] is True and "metric_relabel_configs" not in job, "docs config changed shape"
        job.update(scrape_interval="1s", scrape_timeout="1s")
        job["file_sd_configs"] = [{"files": [str(targets_file)], "refresh_interval": "1s"}]
        return cfg

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(OSError):
                if http_get(f"{self.url}/-/ready", timeout=1) is not None:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout}s: {self.log_tail()}")

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        body = json.loads(http_get(f"{self.url}/api/v1/query?{urllib.parse.urlencode(params)}"))
        assert body["status"] == "success", body
        return body["data"]["result"]

    def log_tail(self, n: int = 10) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-n:])
        return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_f.close()
