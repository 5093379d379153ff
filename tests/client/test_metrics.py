"""TrainerMetrics: docs and code agree, promtool is happy, values are right, the endpoint serves."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from sentinel.client.metrics import MetricsRegistry, TrainerMetrics, _version, gpu_uuid_label
from sentinel.client.targets import TARGETS_FILE, rank_port, write_targets
from tests.helpers.metrics import DOCS, cuda_only, documented

RUN = "test-run"
PHASES = {"data_wait": 0.01, "forward_backward": 0.2, "optimizer": 0.03, "telemetry": 0.001, "control": 0.0005}


HOST = {"host": "node-7", "pod": "trainer-0-abcde", "gpu_uuid": "GPU-5d3c1f0e-aaaa-bbbb-cccc-0123456789ab"}


def make(rank: int = 0, **kw) -> TrainerMetrics:
    return TrainerMetrics(
        run=RUN, rank=rank, world_size=2, model="gpt2-124m", parallelism="ddp", device="cpu", dtype="bf16",
        **{**HOST, **kw},
    )


def glob(m: TrainerMetrics, name: str, **labels) -> float | None:
    """A global series' value: exported with rank="" (Prometheus stores it without rank)."""
    return m.registry.get_sample_value(name, {"run": RUN, "rank": "", **labels})


def step(m: TrainerMetrics, i: int = 1, **over) -> None:
    args = dict(
        step=i, loss=2.5, rank_loss=2.6, grad_norm=1.25, lr=3e-4, tokens_total=4096 * i, step_seconds=0.25,
        phases=PHASES, step_tokens=4096, grad_clipped=False, skipped_reason=None, skipped_samples=0,
        loaded_tokens=2048, useful_tokens=1536, mfu=0.41,
    )
    args.update(over)
    m.on_step(**args)


def populated(rank: int = 0) -> TrainerMetrics:
    m = make(rank)
    step(m)
    m.on_checkpoint(ok=True, seconds=3.0, size_bytes=123_456_789, timestamp=time.time())
    m.on_validation(2.0)
    m.set_slices(["shakespeare", "pydoc"])
    m.on_slice_losses({"shakespeare": 2.4, "pydoc": 2.7})
    m.on_slice_validation({"shakespeare": 2.1, "pydoc": 2.9}, {"shakespeare": 2.0, "pydoc": 3.0})
    m.set_mixture_weights({"shakespeare": 0.6, "pydoc": 0.4})
    return m


def series_name(family) -> str:
    """The name Prometheus sees for a family (client_python strips `_total` / `_info` internally)."""
    return {"counter": family.name + "_total", "info": family.name + "_info"}.get(family.type, family.name)


def exported(m: TrainerMetrics) -> dict[str, tuple[str, set[str]]]:
    """{metric name: (label names as Prometheus stores them)} of the training_* families: `le` and
    empty labels (a global series' rank="") left out."""
    out = {}
    for fam in m.registry.collect():
        if not fam.name.startswith("training"):
            continue
        labels = {k for s in fam.samples for k, v in s.labels.items() if v} - {"le", "quantile"}
        out[series_name(fam)] = ("gauge" if fam.type == "info" else fam.type, labels)
    return out


# --------------------------------------------------------------------------------------------
# (a) docs and code agree
# --------------------------------------------------------------------------------------------


def test_docs_and_rank0_exposition_agree_both_ways():
    docs = documented()
    have = exported(populated(rank=0))
    expected = {n for n, row in docs.items() if not cuda_only(row)}  # this test runs on CPU
    assert set(have) == expected, (
        f"in code, not in docs: {sorted(set(have) - expected)}; in docs, not in code: {sorted(expected - set(have))}"
    )
    for name, (typ, labels) in have.items():
        assert typ == docs[name]["type"], name
        assert labels == docs[name]["labels"], name


def test_docs_exported_by_column_matches_nonzero_rank():
    docs = documented()
    have = exported(populated(rank=1))
    per_rank = {n for n, row in docs.items() if row["who"].startswith("every rank") and not cuda_only(row)}
    assert set(have) == per_rank
    for name, row in docs.items():
        assert row["who"].startswith(("rank 0", "every rank")), name
        assert ("rank" in row["labels"]) == row["who"].startswith("every rank"), name


def test_global_series_export_an_empty_rank_and_need_no_relabel_rule():
    """Rank 0's global series carry rank="" (honor_labels then keeps the target's rank off them):
    exactly the rows documented as "rank 0", and no scrape config in docs or deploy relabels."""
    docs = documented()
    m = populated(rank=0)
    for fam in m.registry.collect():
        for s in fam.samples:
            if not s.name.startswith("training_"):
                continue
            name = max((n for n in docs if s.name == n or s.name.startswith(n + "_")), key=len)
            want = "" if docs[name]["who"].startswith("rank 0") else "0"
            assert s.labels["rank"] == want, (s.name, s.labels)
    root = DOCS.parents[1]
    for path in [DOCS, root / "deploy" / "compose" / "prometheus.yml"]:
        assert "metric_relabel_configs" not in path.read_text(), path


def test_no_created_series_and_process_metrics_on_the_own_registry():
    for m in (populated(0), populated(1)):
        body = m.exposition().decode()
        assert "_created" not in body
        assert m.registry.get_sample_value("process_resident_memory_bytes") > 1e6
        assert m.registry.get_sample_value("process_start_time_seconds") > 0
        assert "training_process_resident_memory_bytes" not in body
    # the per-registry switch leaves every other registry of the process alone
    from prometheus_client import Counter, generate_latest

    other = CollectorRegistry()
    Counter("host_app_requests", "an integration's host process metric", registry=other).inc()
    assert b"host_app_requests_created" in generate_latest(other)
    # a ?name[]= scrape asks for a restricted registry: still no _created
    reg = MetricsRegistry()
    Counter("x_events", "x", registry=reg).inc()
    restricted = generate_latest(reg.restricted_registry(["x_events_total", "x_events_created"])).decode()
    assert "x_events_total 1.0" in restricted and "_created" not in restricted


@pytest.mark.parametrize("given, label", [("5d3c1f0e-aaaa", "GPU-5d3c1f0e-aaaa"), ("GPU-1", "GPU-1"),
                                          ("MIG-2", "MIG-2"), (None, ""), ("", ""), ("  ", "")])
def test_gpu_uuid_label_as_dcgm_prints_it(given, label):
    assert gpu_uuid_label(given) == label


def test_info_defaults_host_and_pod_from_the_environment(monkeypatch):
    import socket

    def info(**env) -> dict:
        for k in ("POD_NAME", "HOSTNAME", "KUBERNETES_SERVICE_HOST"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        m = TrainerMetrics(run=RUN, rank=3, world_size=4, model="m", parallelism="ddp", device="cpu", dtype="fp32")
        (sample,) = [s for fam in m.registry.collect() if fam.name == "training" for s in fam.samples]
        return sample.labels

    got = info(POD_NAME="job-1-0-xyz", HOSTNAME="other")
    assert (got["host"], got["pod"], got["gpu_uuid"], got["rank"]) == (socket.gethostname(), "job-1-0-xyz", "", "3")
    assert info(HOSTNAME="job-1-0-abc", KUBERNETES_SERVICE_HOST="10.0.0.1")["pod"] == "job-1-0-abc"
    assert info(HOSTNAME="laptop")["pod"] == ""  # outside Kubernetes a host name is no pod


# --------------------------------------------------------------------------------------------
# (b) promtool
# --------------------------------------------------------------------------------------------


def promtool() -> str:
    path = shutil.which("promtool") or ("/usr/bin/promtool" if os.path.exists("/usr/bin/promtool") else None)
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required in CI")
        pytest.skip("promtool not installed")
    return path


@pytest.mark.parametrize("rank", [0, 1])
def test_promtool_check_metrics_is_clean(rank):
    m = populated(rank)
    step(m, 2, skipped_reason="loss_spike", skipped_samples=3, grad_clipped=True)
    m.on_directive("skip-samples", applied=True)
    proc = subprocess.run(
        [promtool(), "check", "metrics"], input=m.exposition(), capture_output=True, timeout=30
    )
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), (
        proc.stdout.decode() + proc.stderr.decode()
    )


def test_docs_prometheus_yml_is_valid(tmp_path):
    block = re.search(r"```yaml\n(# prometheus.yml\n.*?)```", DOCS.read_text(), re.S).group(1)
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(block)
    proc = subprocess.run([promtool(), "check", "config", str(cfg)], capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()


# --------------------------------------------------------------------------------------------
# (c) values and labels
# --------------------------------------------------------------------------------------------


def test_on_step_sets_values():
    m = make(0, tokens_per_second_window=2)
    g = lambda name, **labels: m.registry.get_sample_value(name, {"run": RUN, "rank": "", **labels})  # noqa: E731
    step(m, 1)
    step(m, 2, step_seconds=0.75, grad_clipped=True)
    assert g("training_step") == 2
    assert g("training_loss") == 2.5
    assert g("training_rank_loss", rank="0") == 2.6
    assert g("training_grad_norm") == 1.25
    assert g("training_learning_rate") == 3e-4
    assert g("training_trained_tokens") == 8192
    assert g("training_tokens_total") == 8192
    assert g("training_tokens_per_second") == pytest.approx(8192 / 1.0)
    assert g("training_mfu_ratio") == 0.41
    assert g("training_grad_clipped_steps_total") == 1
    assert g("training_effective_token_ratio", rank="0") == pytest.approx(0.75)
    assert g("training_step_duration_seconds_count", rank="0") == 2
    assert g("training_step_duration_seconds_bucket", rank="0", le="0.25") == 1
    assert g("training_step_phase_seconds_sum", rank="0", phase="forward_backward") == pytest.approx(0.4)
    assert g("training_step_phase_seconds_count", rank="0", phase="data_wait") == 2
    # window of 2: the first step falls out
    step(m, 3, step_seconds=0.25, step_tokens=1000, loaded_tokens=1000, useful_tokens=1000)
    assert g("training_tokens_per_second") == pytest.approx((4096 + 1000) / 1.0)
    assert g("training_effective_token_ratio", rank="0") == pytest.approx((1536 + 1000) / 3048)
    # a skipped step counts its reason and samples, trains no tokens
    step(m, 4, skipped_reason="nonfinite", skipped_samples=5, loss=math.nan)
    assert g("training_skipped_steps_total", reason="nonfinite") == 1
    assert g("training_skipped_steps_total", reason="loss_spike") == 0
    assert g("training_skipped_samples_total", rank="0") == 5
    assert g("training_tokens_total") == 8192 + 1000
    assert math.isnan(g("training_loss"))
    # None leaves the last value
    step(m, 5, loss=None, grad_norm=None, lr=None, tokens_total=None)
    assert g("training_step") == 5 and g("training_grad_norm") == 1.25


def test_validation_loss_only_perplexity_is_derived_in_promql():
    m = make(0)
    m.on_validation(1e6)
    assert glob(m, "training_validation_loss") == 1e6
    assert b"perplexity" not in m.exposition()


def test_mfu_absent_when_unknown():
    m = make(0)
    step(m, mfu=None)
    assert glob(m, "training_mfu_ratio") is None
    assert b"training_mfu_ratio" not in m.exposition()


def test_checkpoint_age_grows_and_failures_count():
    m = make(0)
    g = lambda name: glob(m, name)  # noqa: E731
    m.on_checkpoint(ok=True, seconds=4.0, size_bytes=1000, timestamp=time.time() - 100)
    a1 = g("training_checkpoint_age_seconds")
    time.sleep(0.02)
    a2 = g("training_checkpoint_age_seconds")
    assert 100 <= a1 < a2 < 110
    m.on_checkpoint(ok=False, seconds=1.0, size_bytes=0, timestamp=time.time())
    assert g("training_checkpoint_failures_total") == 1
    assert g("training_checkpoint_size_bytes") == 1000  # describes the last successful save
    assert g("training_checkpoint_save_duration_seconds_count") == 1
    assert g("training_checkpoint_age_seconds") >= a2


def test_counters_events_and_info():
    m = make(0)
    g = lambda name, **labels: glob(m, name, **labels)  # noqa: E731
    m.on_resume(), m.on_rollback(), m.on_rollback()
    m.on_directive("rollback", applied=True)
    m.on_directive("rollback", applied=False)
    assert (g("training_resumes_total"), g("training_rollbacks_total")) == (1, 2)
    assert g("training_directives_applied_total", kind="rollback") == 1
    assert g("training_directives_applied_total", kind="stop") == 0
    assert g("training_directives_rejected_total", reason="malformed") == 1
    m.set_directives_rejected({"unsigned": 2, "not_utf8": 1})
    m.set_directives_rejected({"unsigned": 3, "not_utf8": 1})
    assert g("training_directives_rejected_total", reason="unsigned") == 3
    assert g("training_directives_rejected_total", reason="not_utf8") == 1
    m.set_telemetry_dropped(3)
    m.set_telemetry_dropped(3)
    m.set_telemetry_dropped(7)
    m.set_telemetry_dropped(2)  # the bus client was recreated: its count restarted
    assert g("training_telemetry_dropped_total", rank="0") == 9
    info = {"model": "gpt2-124m", "world_size": "2", "parallelism": "ddp", "device": "cpu", "dtype": "bf16", **HOST}
    assert g("training_info", rank="0", **info, version=_version()) == 1
    before = g("training_heartbeat_timestamp_seconds", rank="0")
    time.sleep(0.01)
    m.heartbeat()
    assert g("training_heartbeat_timestamp_seconds", rank="0") > before


@pytest.mark.parametrize("rank", [0, 1])
def test_run_label_everywhere_rank_label_only_on_per_rank(rank):
    m = populated(rank)
    families = [fam for fam in m.registry.collect() if fam.name.startswith("training")]
    for fam in families:
        for s in fam.samples:
            assert s.labels.get("run") == RUN, s
            assert s.labels["rank"] in ("", str(rank)), s
    global_names = {"training_loss", "training_step", "training_tokens_total"}
    names = {s.name for fam in families for s in fam.samples if not s.labels["rank"]}
    if rank == 0:
        assert global_names <= names
    else:
        assert not names  # a non-zero rank exports per-rank series only


def test_global_calls_are_noops_off_rank0():
    m = make(1)
    step(m, loss=None, grad_norm=None, lr=None, tokens_total=None, mfu=None)
    m.on_validation(1.0), m.on_checkpoint(ok=True, seconds=1, size_bytes=1, timestamp=1.0)
    m.on_resume(), m.on_rollback(), m.on_directive("stop", True)
    assert m.registry.get_sample_value("training_rank_loss", {"run": RUN, "rank": "1"}) == 2.6
    assert glob(m, "training_loss") is None


# --------------------------------------------------------------------------------------------
# (d) the endpoint, and the targets file
# --------------------------------------------------------------------------------------------


def test_serve_on_port_zero_returns_real_port():
    m = populated(0)
    port = m.serve("127.0.0.1", 0)
    try:
        assert 0 < port < 65536 and m.port == port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            body = resp.read()
        assert resp.status == 200
        assert b'training_loss{rank="",run="test-run"} 2.5' in body
        assert b"training_checkpoint_age_seconds" in body
        with pytest.raises(RuntimeError):
            m.serve("127.0.0.1", 0)
    finally:
        m.close()


def test_write_targets_file_sd_format(tmp_path):
    path = write_targets(tmp_path, RUN, [("127.0.0.1", 9102, 1), ("127.0.0.1", 9101, 0), ("::1", 9103, 2)])
    assert path == tmp_path / TARGETS_FILE
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:9101"], "labels": {"run": RUN, "rank": "0"}},
        {"targets": ["127.0.0.1:9102"], "labels": {"run": RUN, "rank": "1"}},
        {"targets": ["[::1]:9103"], "labels": {"run": RUN, "rank": "2"}},
    ]
    write_targets(tmp_path, RUN, [("127.0.0.1", 9201, 0)])  # replaced, not appended; no temp left behind
    assert json.loads(path.read_text())[0]["targets"] == ["127.0.0.1:9201"]
    assert [p.name for p in tmp_path.iterdir()] == [TARGETS_FILE]
    with pytest.raises(ValueError):
        write_targets(tmp_path, RUN, [("h", 1, 0), ("h", 2, 0)])
    assert rank_port(9100, 3) == 9103 and rank_port(0, 3) == 0
