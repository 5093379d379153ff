"""Validation: perplexity is exp(loss) everywhere it is reported, and it is measured on held-out data.

One real (single-process, CPU, tiny) training run on a small multi-shard dataset prepared here, so
that windows cross shard boundaries and both splits span several shard files. While it trains,
every token read of the dataset is recorded (``_TokenStream.read`` is wrapped, nothing is mocked),
tagged with the split it came from and the phase of the run (building the val set, training,
validating). Checked:

* ``steps.jsonl``: ``val_ppl == exp(val_loss)`` on exactly the ``eval.every`` steps;
* the live ``/metrics`` exposition: ``training_validation_loss`` equals the last step record's
  (perplexity is ``exp()`` of it in PromQL, not a series);
* the val windows come only from the val split (``TokenDataset.val_batches``), the training step
  reads only the train split, and evaluation reads no data at all: it uses the fixed val windows;
  the validation loss equals a recomputation over exactly those windows;
* no val window's (shard, offset) token range overlaps the range of *any* train sample id, and
  the val shards are their own files per meta.json's split information.
"""

from __future__ import annotations

import json
import math
import random
import signal
import urllib.request
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from trainer.config import resolve
from trainer.data import TokenDataset, prepare_dataset
from trainer.data.dataset import _TokenStream
from trainer.dist import DistEnv
from trainer.train import Trainer

STEPS, EVAL_EVERY, EVAL_BATCHES = 30, 10, 3
SHARD_TOKENS = 4_000  # ~190k train tokens -> ~48 train shards; ~10k val tokens -> 3 val shards


def _corpus(root: Path, n_docs: int = 12, lines: int = 400) -> list[Path]:
    rnd = random.Random(1234)
    words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 9))) for _ in range(500)]
    paths = []
    for d in range(n_docs):
        p = root / f"doc{d:02d}.txt"
        p.write_text("".join(" ".join(rnd.choice(words) for _ in range(rnd.randint(3, 10))) + "\n" for _ in range(lines)))
        paths.append(p)
    return paths


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("val-corpus")
    out = root / "data"
    prepare_dataset(out, texts=_corpus(root), shard_tokens=SHARD_TOKENS)
    return out


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    """Train in-process with every dataset read recorded; return the trainer, reads and exposition."""
    run_dir = tmp_path_factory.mktemp("val-run") / "val-run"
    reads: list[tuple[str, object, int, int]] = []  # (phase, stream, start, length)
    phase = ["setup"]
    orig_read, orig_val_batches, orig_evaluate = _TokenStream.read, TokenDataset.val_batches, Trainer._evaluate

    def read(self, start, length):
        reads.append((phase[0], self, int(start), int(length)))
        return orig_read(self, start, length)

    def in_phase(name, fn):
        def wrapper(*a, **kw):
            before, phase[0] = phase[0], name
            try:
                return fn(*a, **kw)
            finally:
                phase[0] = before

        return wrapper

    cfg = resolve(preset="tiny", overrides={
        "max_steps": STEPS, "eval.every": EVAL_EVERY, "eval.batches": EVAL_BATCHES, "checkpoint.every": 0,
        "data.dir": str(data_dir), "device": "cpu", "telemetry.metrics_host": "127.0.0.1", "telemetry.metrics_port": 0,
    })  # fmt: skip
    env = DistEnv(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    sigterm = signal.getsignal(signal.SIGTERM)  # fit() installs its own handler
    mp = pytest.MonkeyPatch()
    trainer = None
    try:
        mp.setattr(_TokenStream, "read", read)
        mp.setattr(TokenDataset, "val_batches", in_phase("val_batches", orig_val_batches))
        mp.setattr(Trainer, "_evaluate", in_phase("evaluate", orig_evaluate))
        trainer = Trainer(cfg, run_dir, env)
        phase[0] = "train"
        trainer.fit()
        phase[0] = "done"
        with urllib.request.urlopen(f"http://127.0.0.1:{trainer.metrics.port}/metrics", timeout=5) as r:
            exposition = r.read().decode()
    finally:
        mp.undo()
        signal.signal(signal.SIGTERM, sigterm)
        if trainer is not None:
            if trainer.metrics:
                trainer.metrics.close()
            if trainer.steplog:
                trainer.steplog.close()
    split_of = {id(s): name for name, s in trainer.ds._streams.items()}
    tagged = [(ph, split_of[id(st)], st, start, length) for ph, st, start, length in reads]
    records = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    return SimpleNamespace(trainer=trainer, reads=tagged, exposition=exposition, run_dir=run_dir,
                           steps=[r for r in records if r.get("kind") == "step"], data_dir=data_dir)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# perplexity = exp(loss)
# ---------------------------------------------------------------------------------------------


def test_step_log_val_ppl_is_exp_val_loss(run):
    assert [r["step"] for r in run.steps] == list(range(1, STEPS + 1))
    evals = [r for r in run.steps if r.get("val_loss") is not None]
    assert [r["step"] for r in evals] == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    for r in run.steps:
        if r.get("val_loss") is None:
            assert r.get("val_ppl") is None, r["step"]
            continue
        assert math.isfinite(r["val_loss"]) and r["val_loss"] > 0
        assert r["val_ppl"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-12), r["step"]


def test_exposition_validation_loss_matches_step_log(run):
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(run.exposition)
        for s in fam.samples
    }
    labels = (("rank", ""), ("run", run.run_dir.name))  # a global series: rank="" (stored without rank)
    loss = values[("training_validation_loss", labels)]
    last = [r for r in run.steps if r.get("val_loss") is not None][-1]
    assert loss == last["val_loss"]  # both come from the same float: exact
    # perplexity is not a series of its own: exp(training_validation_loss) in PromQL
    assert not any("perplexity" in name for name, _ in values)


# ---------------------------------------------------------------------------------------------
# validation data is held out
# ---------------------------------------------------------------------------------------------


def test_val_windows_come_only_from_the_val_split(run):
    val_reads = [r for r in run.reads if r[0] == "val_batches"]
    assert val_reads and all(split == "val" for _, split, *_ in val_reads)
    windows = np.concatenate(run.trainer.val)
    assert len(windows) == len(val_reads) and len(run.trainer.val) <= EVAL_BATCHES
    for row, (_, _, stream, start, length) in zip(windows, val_reads):
        assert length == windows.shape[1]
        assert np.array_equal(row, _read_shards(run.data_dir, stream, start, length))  # the files, not the class


def test_training_reads_only_train_and_evaluation_reads_nothing(run):
    train_reads = [r for r in run.reads if r[0] == "train"]
    assert len(train_reads) >= STEPS * run.trainer.cfg.data.micro_batch_size
    assert all(split == "train" for _, split, *_ in train_reads)
    assert not [r for r in run.reads if r[0] == "evaluate"], "evaluation must use the fixed val windows, not read data"
    seq = run.trainer.cfg.model.seq_len
    used = {i for r in run.steps for i in r["sample_ids"]}
    assert {start for *_, start, _ in train_reads} == {i * seq for i in used}


def test_validation_loss_is_computed_on_exactly_the_val_windows(run):
    t = run.trainer
    t.raw_model.eval()
    total = n = 0.0
    with torch.no_grad():
        for batch in t.val:
            toks = torch.from_numpy(batch)
            _, loss = t.raw_model(toks[:, :-1], toks[:, 1:])
            total += loss.double().item() * len(batch)
            n += len(batch)
    last = [r for r in run.steps if r.get("val_loss") is not None][-1]
    assert last["step"] == STEPS  # evaluated after the final update: the model we have now
    assert total / n == pytest.approx(last["val_loss"], rel=1e-6)


def test_no_val_window_overlaps_any_train_sample(run):
    meta = json.loads((run.data_dir / "meta.json").read_text())
    split_of_shard = {s["name"]: s["split"] for s in meta["shards"]}
    assert sum(v == "train" for v in split_of_shard.values()) > 1 and sum(v == "val" for v in split_of_shard.values()) > 1
    # the splits are separate files, not aliases of one another
    inodes = {name: (run.data_dir / name).stat().st_ino for name in split_of_shard}
    assert len(set(inodes.values())) == len(inodes)

    ds, seq = run.trainer.ds, run.trainer.cfg.model.seq_len
    train, val = ds._streams["train"], ds._streams["val"]
    # every train sample id i covers train-stream tokens [i*seq, i*seq + seq + 1): as shard ranges
    n = ds.num_samples(seq)
    train_ranges = _shard_ranges(train, 0, (n - 1) * seq + seq + 1)  # union of all sample windows (stride seq)
    assert ds.locate(n - 1, seq)[0] in train_ranges
    val_ranges: dict[str, list[tuple[int, int]]] = defaultdict(list)
    val_reads = [r for r in run.reads if r[0] == "val_batches"]
    for _, _, stream, start, length in val_reads:
        assert stream is val
        for name, spans in _shard_ranges(val, start, length).items():
            val_ranges[name] += spans
    assert sum(len(v) for v in val_ranges.values()) >= len(val_reads)
    for name, spans in val_ranges.items():
        assert split_of_shard[name] == "val", name
        for lo, hi in spans:
            for tlo, thi in train_ranges.get(name, []):
                assert hi <= tlo or thi <= lo, f"val window {name}[{lo}:{hi}] overlaps train samples {name}[{tlo}:{thi}]"
    assert all(split_of_shard[name] == "train" for name in train_ranges)


def _shard_ranges(stream: _TokenStream, start: int, length: int) -> dict[str, list[tuple[int, int]]]:
    """Stream tokens [start, start+length) as {shard name: [(lo, hi), ...]} (a window may cross shards)."""
    out: dict[str, list[tuple[int, int]]] = defaultdict(list)
    pos, end = start, start + length
    while pos < end:
        k = int(np.searchsorted(stream.starts, pos, side="right")) - 1
        shard_end = int(stream.starts[k + 1])
        hi = min(end, shard_end)
        out[stream.names[k]].append((pos - int(stream.starts[k]), hi - int(stream.starts[k])))
        pos = hi
    return dict(out)


def _read_shards(data_dir: Path, stream: _TokenStream, start: int, length: int) -> np.ndarray:
    """The same tokens read straight from the shard files named by meta.json (np.fromfile)."""
    meta = json.loads((data_dir / "meta.json").read_text())
    dtype = np.dtype(meta["tokenizer"]["dtype"]).newbyteorder("<")
    parts = [np.fromfile(data_dir / name, dtype=dtype)[lo:hi] for name, spans in _shard_ranges(stream, start, length).items() for lo, hi in spans]
    return np.concatenate(parts).astype(np.int64)
