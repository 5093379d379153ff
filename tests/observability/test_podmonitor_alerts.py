"""SentinelDown and TrainingRankDown on Kubernetes: the shipped PodMonitors, as prometheus-operator
turns them into scrape configs, feed the shipped alert rules in a real Prometheus.

The operator names a PodMonitor's targets ``job="<namespace>/<name>"`` and the alerts select
``job="sentinel"`` / ``job="sentinel-trainer"``, so the PodMonitors relabel ``job`` last. This test
follows the operator's documented generation for a PodMonitor endpoint (prometheus-operator
``pkg/prometheus/promcfg.go``, ``generatePodMonitorConfig``): job name ``podMonitor/NS/NAME/I``,
the ``__tmp_prometheus_job_name`` rule, the running-pod filter, one keep rule per selector label,
the port keep rule, ``namespace`` / ``container`` / ``pod``, ``job`` = ``NS/NAME``, ``endpoint``,
then the PodMonitor's own relabelings, then the shard rules (``$(SHARD)`` = 0, as the config
reloader substitutes it). What stands in for Kubernetes: ``kubernetes_sd_configs`` (role pod) becomes
a ``file_sd_configs`` file holding the targets pod discovery would give (the ``__meta_kubernetes_*``
labels, built from the kustomize-rendered pod templates: labels, container ports, the Job's
completion index), with each address pointing at a real HTTP /metrics endpoint on 127.0.0.1; scrape
intervals are 1 s and the two alerts' ``for:`` is 2 s. A decoy pod (redis) and the trainer's
``rdzv`` port are in the discovery file too, and must be dropped by the selectors.

Timeline, one Prometheus: all up (neither alert), one trainer rank's endpoint stops
(TrainingRankDown for that rank only), every rank and the sentinel stop: a finished run (no
TrainingRankDown) and SentinelDown.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tests.helpers.deploy import K8S, kustomize, one_object
from tests.helpers.prometheus import ALERTS, Prom, fast_rules
from tests.helpers.services import find_binary, free_port, start_logged, stop_process, wait_http_ready


# ------------------------------------------------------------------ the operator's generation
def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _user_relabel(r: dict) -> dict:
    """A PodMonitor relabeling as the operator writes it (generateRelabelConfig)."""
    keys = (("sourceLabels", "source_labels"), ("separator", "separator"), ("targetLabel", "target_label"),
            ("regex", "regex"), ("modulus", "modulus"), ("replacement", "replacement"), ("action", "action"))
    out = {snake: r[camel] for camel, snake in keys if r.get(camel) not in (None, "", [])}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def operator_scrape_configs(pm: dict, shard: str = "0") -> list[dict]:
    """The scrape_configs prometheus-operator generates for PodMonitor ``pm`` (one per endpoint)."""
    ns, name, spec = pm["metadata"]["namespace"], pm["metadata"]["name"], pm["spec"]
    assert not spec["selector"].get("matchExpressions") and "namespaceSelector" not in spec, \
        "extend operator_scrape_configs for matchExpressions / namespaceSelector"
    out = []
    for i, ep in enumerate(spec["podMetricsEndpoints"]):
        cfg = {"job_name": f"podMonitor/{ns}/{name}/{i}", "honor_labels": bool(ep.get("honorLabels", False)),
               "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [ns]}}]}
        for camel, snake in (("interval", "scrape_interval"), ("scrapeTimeout", "scrape_timeout"),
                             ("path", "metrics_path"), ("scheme", "scheme")):
            if ep.get(camel):
                cfg[snake] = ep[camel]
        rl = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
        if ep.get("filterRunning", True):
            rl.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"})
        for k in sorted(spec["selector"].get("matchLabels", {})):
            rl.append({"action": "keep", "regex": f"({spec['selector']['matchLabels'][k]});true",
                       "source_labels": [f"__meta_kubernetes_pod_label_{_sanitize(k)}",
                                         f"__meta_kubernetes_pod_labelpresent_{_sanitize(k)}"]})
        if ep.get("port"):
            rl.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": ep["port"]})
        rl += [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
               {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
               {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
        for lbl in spec.get("podTargetLabels", []):
            rl.append({"source_labels": [f"__meta_kubernetes_pod_label_{_sanitize(lbl)}"], "target_label": _sanitize(lbl),
                       "regex": "(.+)", "replacement": "${1}"})
        rl.append({"target_label": "job", "replacement": f"{ns}/{name}"})
        if spec.get("jobLabel"):
            rl.append({"source_labels": [f"__meta_kubernetes_pod_label_{_sanitize(spec['jobLabel'])}"],
                       "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
        if ep.get("port"):
            rl.append({"target_label": "endpoint", "replacement": ep["port"]})
        rl += [_user_relabel(r) for r in ep.get("relabelings", [])]
        rl += [{"source_labels": ["__address__"], "target_label": "__tmp_hash", "modulus": 1, "action": "hashmod"},
               {"source_labels": ["__tmp_hash"], "regex": shard, "action": "keep"}]  # $(SHARD), substituted
        cfg["relabel_configs"] = rl
        if ep.get("metricRelabelings"):
            cfg["metric_relabel_configs"] = [_user_relabel(r) for r in ep["metricRelabelings"]]
        out.append(cfg)
    return out


def pod_targets(pod_name: str, template: dict, container: str, addresses: dict[str, str],
                annotations: dict[str, str] | None = None) -> list[dict]:
    """What Kubernetes pod discovery gives for one Running pod: a target per declared container port
    (file-SD target groups; ``addresses`` maps a port name to the 127.0.0.1 address standing in)."""
    meta = template["metadata"]
    c = next(c for c in template["spec"]["containers"] if c["name"] == container)
    labels = {"__meta_kubernetes_namespace": "sentinel", "__meta_kubernetes_pod_name": pod_name,
              "__meta_kubernetes_pod_phase": "Running", "__meta_kubernetes_pod_ready": "true",
              "__meta_kubernetes_pod_container_name": container}
    for k, v in meta.get("labels", {}).items():
        labels[f"__meta_kubernetes_pod_label_{_sanitize(k)}"] = v
        labels[f"__meta_kubernetes_pod_labelpresent_{_sanitize(k)}"] = "true"
    for k, v in {**meta.get("annotations", {}), **(annotations or {})}.items():
        labels[f"__meta_kubernetes_pod_annotation_{_sanitize(k)}"] = v
    return [{"targets": [addresses.get(p["name"], f"127.0.0.1:{free_port()}")],
             "labels": {**labels, "__meta_kubernetes_pod_container_port_name": p["name"],
                        "__meta_kubernetes_pod_container_port_number": str(p["containerPort"])}}
            for p in c.get("ports", [])]


# ------------------------------------------------------------------ real endpoints and Prometheus
class Endpoint:
    """A real /metrics endpoint on 127.0.0.1 (prometheus-client's HTTP server) that can be stopped."""

    def __init__(self, metric: str, **labels: str) -> None:
        reg = CollectorRegistry()
        Gauge(metric, "test series", list(labels), registry=reg).labels(**labels).set(1)
        self.port = free_port()
        self.server, _ = start_http_server(self.port, "127.0.0.1", registry=reg)
        self.address = f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def k8s_objs() -> list[dict]:
    return kustomize(K8S)


def test_the_operator_config_of_the_shipped_podmonitors_names_the_jobs_the_alerts_select(k8s_objs):
    jobs = {}
    for pm in (o for o in k8s_objs if o["kind"] == "PodMonitor"):
        for cfg in operator_scrape_configs(pm):
            writes = [r for r in cfg["relabel_configs"] if r.get("target_label") == "job"]
            assert writes[0]["replacement"] == f"sentinel/{pm['metadata']['name']}"  # the operator's default
            jobs[pm["metadata"]["name"]] = writes[-1]["replacement"]  # the last write wins
    assert jobs == {"sentinel-trainer": "sentinel-trainer", "sentinel-daemon": "sentinel"}
    exprs = {r["alert"]: r["expr"] for f in ALERTS.glob("*.yaml")
             for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"] if "alert" in r}
    assert 'up{job="sentinel"}' in exprs["SentinelDown"]
    assert 'up{job="sentinel-trainer"}' in exprs["TrainingRankDown"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sentinel_down_and_training_rank_down_fire_when_and_only_when_they_should(k8s_objs, tmp_path):
    prometheus = find_binary("prometheus")
    job_tpl = one_object(k8s_objs, "Job", "sentinel-train")["spec"]["template"]
    dep_tpl = one_object(k8s_objs, "Deployment", "sentinel")["spec"]["template"]
    redis_tpl = one_object(k8s_objs, "StatefulSet", "redis")["spec"]["template"]
    run = job_tpl["metadata"]["labels"]["sentinel.dev/run"]
    daemon = Endpoint("sentinel_leader", run=run)
    ranks = [Endpoint("training_step", run=run), Endpoint("training_step", run=run, rank="1")]
    sd = tmp_path / "pods.json"
    sd.write_text(json.dumps([
        *pod_targets("sentinel-train-0-x7k2p", job_tpl, "trainer", {"metrics-0": ranks[0].address, "metrics-1": ranks[1].address},
                     {"batch.kubernetes.io/job-completion-index": "0"}),
        *pod_targets("sentinel-6d9c7b-abcde", dep_tpl, "sentinel", {"metrics": daemon.address}),
        *pod_targets("redis-0", redis_tpl, redis_tpl["spec"]["containers"][0]["name"], {}),  # a decoy: never selected
    ]))
    scrape_configs = []
    for pm in (o for o in k8s_objs if o["kind"] == "PodMonitor"):
        for cfg in operator_scrape_configs(pm):
            del cfg["kubernetes_sd_configs"]
            cfg.update(file_sd_configs=[{"files": [str(sd)], "refresh_interval": "1s"}],
                       scrape_interval="1s", scrape_timeout="1s")
            scrape_configs.append(cfg)
    port = free_port()
    cfg_file = tmp_path / "prometheus.yml"
    cfg_file.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                                        "rule_files": fast_rules(tmp_path), "scrape_configs": scrape_configs}))
    log = tmp_path / "prometheus.log"
    proc = start_logged([prometheus, f"--config.file={cfg_file}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                   f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], log)
    live = [daemon, *ranks]
    try:
        wait_http_ready(f"http://127.0.0.1:{port}/-/ready", proc, log)
        prom = Prom(f"http://127.0.0.1:{port}")

        # 1. everything up: three targets (no decoy, no rdzv port), with the jobs the alerts select
        def all_up():
            res = prom.get("/api/v1/query", query="up")["result"]
            return res if len(res) == 3 and all(r["value"][1] == "1" for r in res) else None

        up = {(r["metric"]["job"], r["metric"].get("local_rank")): r["metric"] for r in prom.wait("3 targets up", all_up)}
        assert set(up) == {("sentinel", None), ("sentinel-trainer", "0"), ("sentinel-trainer", "1")}, up
        assert all(m["namespace"] == "sentinel" and not any(k.startswith("__") and k != "__name__" for k in m) for m in up.values()), up
        assert up[("sentinel-trainer", "1")]["run"] == run and up[("sentinel-trainer", "1")]["node_rank"] == "0"
        # SentinelDown's absent() holds before Prometheus' first scrape (a for: of 2 s, unlike the shipped
        # 3m, lets it fire then); once the targets are up, one evaluation clears it, and then neither
        # alert may even be pending for four `for:` spans
        prom.wait("no alert once every target is up", lambda: prom.alerts() == {})
        deadline = time.monotonic() + 4 * 2
        while time.monotonic() < deadline:
            assert prom.alerts() == {}, f"an alert with every target up: {prom.alerts()}\n{log.read_text()[-1500:]}"
            time.sleep(0.5)

        # 2. one rank's endpoint dies while rank 0 lives: TrainingRankDown for that rank, nothing else
        ranks[1].stop()
        live.remove(ranks[1])
        firing = prom.wait("TrainingRankDown firing", lambda: [
            a for a in prom.alerts().get("TrainingRankDown", []) if a["state"] == "firing"])
        assert len(firing) == 1 and firing[0]["labels"]["local_rank"] == "1" and firing[0]["labels"]["run"] == run, firing
        assert "SentinelDown" not in prom.alerts()

        # 3. every rank stops (the run finished) and the sentinel dies: SentinelDown, no TrainingRankDown
        for ep in (ranks[0], daemon):
            ep.stop()
            live.remove(ep)
        down = prom.wait("SentinelDown firing", lambda: [
            a for a in prom.alerts().get("SentinelDown", []) if a["state"] == "firing"])
        assert down[0]["labels"]["job"] == "sentinel" and down[0]["labels"]["pod"] == "sentinel-6d9c7b-abcde", down
        prom.wait("TrainingRankDown resolved once no rank is up", lambda: "TrainingRankDown" not in prom.alerts())
    finally:
        for ep in live:
            ep.stop()
        stop_process(proc)
