"""Data mixtures and slices (issue 11): the protocol's slice fields and timeline markers, the slice
metrics, mixture preparation, the mixture sampler, per-source losses and exact resume."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client import CollectorRegistry

from sentinel.backtest import backtest, load_trace
from sentinel.policy import RunPolicy
from sentinel.protocol import (
    MarkerRecord,
    SchemaError,
    StepRecord,
    TimelineRecord,
    authoritative_steps,
    parse_step_line,
)
from sentinel.rules import default_rules
from trainer.telemetry.metrics import TIMELINE_EVENTS, TrainerMetrics


def _step(s: int, **kw) -> StepRecord:
    return StepRecord(run="r", step=s, loss=3.0, loss_max_rank=3.0, grad_norm=1.0, lr=1e-3, tokens=s,
                      batch_fingerprint="f", time=float(s), sample_ids=[s], **kw)


# --------------------------------------------------------------------------------------------
# protocol
# --------------------------------------------------------------------------------------------


def test_step_record_slice_fields_round_trip_and_reject_bad_names():
    rec = _step(3, source_loss={"shakespeare": 2.5, "pydoc": 3.25}, val_slice_loss={"pydoc": 3.0},
                probe_loss={"pydoc": 3.5})
    back = parse_step_line(rec.to_json())
    assert back.source_loss == {"shakespeare": 2.5, "pydoc": 3.25}
    assert back.val_slice_loss == {"pydoc": 3.0} and back.probe_loss == {"pydoc": 3.5}
    assert "source_loss" not in _step(1).to_json()  # optional: absent when unknown
    base = json.loads(_step(1).to_json())
    for bad in ({"Bad Name": 1.0}, {"x" * 33: 1.0}, {f"s{i}": 1.0 for i in range(17)}):
        with pytest.raises(SchemaError):
            parse_step_line(json.dumps({**base, "source_loss": bad}))


def test_marker_record_parses_and_supersedes_nothing():
    m = MarkerRecord(run="r", step=2, timeline=0, marker="mixture_change", detail="pydoc 0.3 -> 0.6", time=2.5)
    back = parse_step_line(m.to_json())
    assert isinstance(back, MarkerRecord) and back.marker == "mixture_change" and back.step == 2
    with pytest.raises(SchemaError):
        parse_step_line(json.dumps({**json.loads(m.to_json()), "marker": "lunch_break"}))
    recs = [_step(1), _step(2), m, _step(3)]
    assert list(authoritative_steps(recs)) == [1, 2, 3]


def test_readers_tolerate_markers(tmp_path):
    rng = random.Random(1)
    recs: list = [TimelineRecord(kind="start", run="r", from_step=0, timeline=0, time=0.0)]
    for s in range(1, 301):
        recs.append(StepRecord(run="r", step=s, loss=3.0 * (1 + rng.gauss(0, 0.01)), loss_max_rank=3.1, grad_norm=1.0,
                               lr=1e-3, tokens=s, batch_fingerprint="f", time=float(s), sample_ids=[s]))
        if s in (10, 150):
            recs.append(MarkerRecord(run="r", step=s, marker="warmup_end" if s == 10 else "mixture_change", time=s + 0.5))
    recs.append(StepRecord(run="r", step=301, loss=6.0, loss_max_rank=6.0, grad_norm=1.0, lr=1e-3, tokens=301,
                           batch_fingerprint="f", time=301.0, sample_ids=[301]))
    p = tmp_path / "steps.jsonl"
    p.write_text("\n".join(r.to_json() for r in recs) + "\n")
    res = backtest(load_trace(p), default_rules())
    assert res.flagged == [301]  # markers are neither steps nor restarts
    pol = RunPolicy("r", default_rules())
    pol.restore_samples(recs)
    assert len(pol._samples) == 301
    from sentinel import rundir

    assert rundir.summarize(rundir.tail_records(tmp_path, 50)).step == 301


# --------------------------------------------------------------------------------------------
# slice metrics
# --------------------------------------------------------------------------------------------


def _metrics(rank: int = 0) -> TrainerMetrics:
    return TrainerMetrics(run="r", rank=rank, world_size=1, model="tiny", parallelism="single", device="cpu",
                          dtype="fp32", registry=CollectorRegistry())


def _sample(m: TrainerMetrics, name: str, **labels) -> float | None:
    return m.registry.get_sample_value(name, {"run": "r", **labels})


def test_slice_metrics_bounded_and_set():
    m = _metrics()
    with pytest.raises(ValueError):
        m.set_slices([f"s{i}" for i in range(17)])
    with pytest.raises(ValueError):
        m.set_slices(["Python Docs"])
    m.set_slices(["shakespeare", "pydoc", "stdlib"])
    m.on_slice_losses({"shakespeare": 2.0, "pydoc": 3.0, "intruder": 9.0})
    m.on_slice_validation({"pydoc": 1.0}, {"stdlib": 4.0})
    m.set_mixture_weights({"shakespeare": 0.5, "pydoc": 0.3, "stdlib": 0.2})
    assert _sample(m, "training_slice_loss", slice="pydoc") == 3.0
    assert _sample(m, "training_slice_loss", slice="intruder") is None  # undeclared: dropped
    assert _sample(m, "training_validation_slice_loss", slice="pydoc") == 1.0
    assert _sample(m, "training_validation_slice_perplexity", slice="pydoc") == pytest.approx(2.718281828)
    assert _sample(m, "training_probe_loss", slice="stdlib") == 4.0
    assert _sample(m, "training_mixture_weight_ratio", slice="stdlib") == 0.2
    for e in TIMELINE_EVENTS:
        assert _sample(m, "training_timeline_events_total", event=e) == 0.0
    m.on_timeline_event("warmup_end")
    m.on_timeline_event("not_an_event")
    m.on_resume()
    m.on_rollback()
    assert _sample(m, "training_timeline_events_total", event="warmup_end") == 1.0
    assert _sample(m, "training_timeline_events_total", event="resume") == 1.0
    assert _sample(m, "training_timeline_events_total", event="rollback") == 1.0
    assert _sample(m, "training_timeline_events_total", event="not_an_event") is None


def test_slice_metrics_are_rank0_only():
    m = _metrics(rank=1)
    m.set_slices(["pydoc"])
    m.on_slice_losses({"pydoc": 3.0})
    m.on_timeline_event("warmup_end")
    text = m.exposition().decode()
    assert "training_slice_loss" not in text and "training_timeline_events" not in text
