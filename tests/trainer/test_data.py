"""trainer.data on the real Shakespeare corpus: preparation, reading, sampling, skipping, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trainer.data import (
    DataError,
    Sampler,
    SkipList,
    TokenDataset,
    batch_fingerprint,
    default_data_dir,
    ensure_prepared,
    load_tokenizer,
    prepare_dataset,
)
from trainer.data.dataset import compute_fingerprint
from trainer.data.prepare import shakespeare_files, split_point

PYTHON = sys.executable
SHARD_TOKENS = 1_000_000  # small enough that Shakespeare spans several train shards
SEQ = 256


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "shakespeare-byte"
    prepare_dataset(out, shard_tokens=SHARD_TOKENS)
    return out


@pytest.fixture(scope="module")
def ds(byte_dir) -> TokenDataset:
    return TokenDataset.open(byte_dir, verify=True)


@pytest.fixture(scope="module")
def plays() -> dict[str, str]:
    files = shakespeare_files()
    return {str(p.relative_to(p.parents[1])): p.read_text(encoding="utf-8") for p in files}


def _split_stream(data_dir: Path, split: str, dtype=np.uint16) -> np.ndarray:
    """A split read the nanoGPT way: np.fromfile on each shard, concatenated."""
    meta = json.loads((data_dir / "meta.json").read_text())
    return np.concatenate([np.fromfile(data_dir / s["name"], dtype=dtype) for s in meta["shards"] if s["split"] == split])


def _expected_stream(meta: dict, texts: dict[str, str], encode, eot: int, split: str) -> np.ndarray:
    """The split rebuilt from the documents and their recorded cut points, independently of shards."""
    parts = []
    for doc in meta["documents"]:
        text = texts[doc["name"]]
        piece = text[: doc["split_char"]] if split == "train" else text[doc["split_char"] :]
        if piece:
            parts.append(encode(piece) + [eot])
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


# ---- preparation ------------------------------------------------------------------------------


def test_meta_records_shards_and_hashes(byte_dir, ds):
    meta = ds.meta
    assert meta["version"] == 1
    assert meta["tokenizer"] == {"kind": "byte", "vocab_size": 256, "dtype": "uint16", "eot": 0}
    assert len(meta["source"]["files"]) == 38
    train = [s for s in meta["shards"] if s["split"] == "train"]
    assert len(train) >= 5  # ~5 MB of text at 1M tokens per shard
    for shard in meta["shards"]:
        data = (byte_dir / shard["name"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        assert len(data) == 2 * shard["tokens"]
        assert shard["tokens"] <= SHARD_TOKENS
    for split in ("train", "val"):
        assert meta["tokens"][split] == sum(s["tokens"] for s in meta["shards"] if s["split"] == split)
    assert meta["tokens"]["val"] > 0.03 * meta["tokens"]["train"]
    assert ds.fingerprint == compute_fingerprint(meta["shards"], meta["tokenizer"])
    assert ds.vocab_size == 256 and ds.dtype == np.uint16


def test_fingerprint_is_stable_and_sensitive(byte_dir, ds, tmp_path):
    again = prepare_dataset(tmp_path / "again", shard_tokens=SHARD_TOKENS)
    assert again["dataset_fingerprint"] == ds.fingerprint
    assert again["shards"] == ds.meta["shards"]
    other = prepare_dataset(tmp_path / "other", shard_tokens=SHARD_TOKENS, val_fraction=0.1)
    assert other["dataset_fingerprint"] != ds.fingerprint


def test_corruption_is_detected(byte_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(byte_dir, copy)
    shard = copy / "train-00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1  # same size, still inside the byte vocabulary
    shard.write_bytes(bytes(data))
    TokenDataset.open(copy, verify=False)  # sizes only: cannot notice
    with pytest.raises(DataError, match="corrupt"):
        TokenDataset.open(copy)  # the default open verifies
    with pytest.raises(DataError, match="corrupt"):
        TokenDataset.open(copy, verify=True)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="truncated"):
        TokenDataset.open(copy)
    with pytest.raises(DataError, match="has no meta.json"):
        TokenDataset.open(tmp_path)


def test_same_size_corruption_after_a_verified_open_is_caught(byte_dir, tmp_path):
    """The verification cache is keyed by stat (size, mtime, ctime, inode): a later in-place write,
    even with the mtime put back, changes the ctime and forces a re-hash."""
    from trainer.data.verify import CACHE_NAME

    copy = tmp_path / "copy"
    shutil.copytree(byte_dir, copy)
    good = TokenDataset.open(copy)
    assert (copy / CACHE_NAME).is_file()
    assert good.fingerprint == good.meta["dataset_fingerprint"]  # recomputed from measured hashes
    shard = copy / "train-00000.bin"
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(10)
        old = f.read(1)
        f.seek(10)
        f.write(bytes([old[0] ^ 2]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # hide the write from mtime
    with pytest.raises(DataError, match="corrupt"):
        TokenDataset.open(copy)


def test_token_outside_vocabulary_is_one_line_error(tmp_path):
    """A shard holding ids >= vocab_size (wrong tokenizer, corrupt bytes with a re-signed meta.json)
    is refused at open, naming the shard and the id; an unverified open refuses the batch instead
    of an IndexError deep in the embedding."""
    d = tmp_path / "oov"
    meta = prepare_dataset(d, shard_tokens=SHARD_TOKENS, val_fraction=0.1)
    shard = d / "train-00000.bin"
    toks = np.fromfile(shard, dtype=np.uint16)
    toks[7] = 60000  # in uint16 range, far outside the byte vocabulary
    toks.tofile(shard)
    for s in meta["shards"]:  # re-sign: the checksum alone no longer helps
        s["sha256"] = hashlib.sha256((d / s["name"]).read_bytes()).hexdigest()
    meta["dataset_fingerprint"] = compute_fingerprint(meta["shards"], meta["tokenizer"])
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"token id 60000 at token 7, outside the vocabulary \(vocab_size 25[67]\)"):
        TokenDataset.open(d)
    raw = TokenDataset.open(d, verify=False)
    with pytest.raises(DataError, match="outside the vocabulary"):
        raw.get_many([0, 1], 16)


def test_shards_are_nanogpt_compatible_and_val_is_held_out(byte_dir, ds, plays):
    meta = ds.meta
    encode = lambda s: list(s.encode("utf-8"))  # noqa: E731 - byte level, written independently
    for doc in meta["documents"]:
        text = plays[doc["name"]]
        assert doc["split_char"] == split_point(text, 0.05) < len(text)
        assert text[doc["split_char"] - 1] == "\n"  # val starts on a fresh line
        assert doc["val_tokens"] == len(text[doc["split_char"] :].encode())
    train = _split_stream(byte_dir, "train")
    val = _split_stream(byte_dir, "val")
    np.testing.assert_array_equal(train, _expected_stream(meta, plays, encode, 0, "train"))
    np.testing.assert_array_equal(val, _expected_stream(meta, plays, encode, 0, "val"))

    # every training sample is a window of the train-only stream, located in a train shard
    n = ds.num_samples(SEQ)
    assert n == (len(train) - 1) // SEQ
    ids = np.arange(n)
    samples = ds.get_many(ids, SEQ)
    assert samples.dtype == np.int64 and samples.shape == (n, SEQ + 1)
    starts = ids[:, None] * SEQ + np.arange(SEQ + 1)[None, :]
    np.testing.assert_array_equal(samples, train[starts])
    assert all(ds.locate(i, SEQ)[0].startswith("train-") for i in range(0, n, 97))
    with pytest.raises(DataError, match="out of range"):
        ds.get(n, SEQ)


def test_windows_cross_shard_boundaries(ds):
    first = SHARD_TOKENS // SEQ  # starts in shard 0, ends in shard 1
    assert ds.locate(first, SEQ) == ("train-00000.bin", first * SEQ)
    assert ds.locate(first + 1, SEQ) == ("train-00001.bin", (first + 1) * SEQ - SHARD_TOKENS)
    window = ds.get(first, SEQ)
    np.testing.assert_array_equal(window[-1], ds.get(first + 1, SEQ)[0])


def test_decode_and_val_batches(ds, plays, byte_dir):
    first_doc = ds.meta["documents"][0]["name"]
    assert ds.decode(ds.get(0, 64)) == plays[first_doc][:65]
    assert load_tokenizer(byte_dir).decode(load_tokenizer(byte_dir).encode("héllo\n")) == "héllo\n"

    batches = ds.val_batches(SEQ, batch_size=8, max_batches=3)
    assert [b.shape for b in batches] == [(8, SEQ + 1)] * 3 and batches[0].dtype == np.int64
    again = ds.val_batches(SEQ, batch_size=8, max_batches=3)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))
    val = _split_stream(byte_dir, "val").astype(np.int64)
    n = (len(val) - 1) // SEQ
    aligned = {val[i * SEQ : i * SEQ + SEQ + 1].tobytes() for i in range(n)}
    assert all(row.tobytes() in aligned for row in np.concatenate(batches))
    spread = ds.val_batches(SEQ, batch_size=n, max_batches=1)[0]  # every val window, once
    assert {row.tobytes() for row in spread} == aligned


def test_bpe_tokenizer(tmp_path, plays):
    files = shakespeare_files()[:3]
    meta = prepare_dataset(tmp_path / "bpe", texts=files, tokenizer="bpe", vocab_size=512)
    tok = load_tokenizer(tmp_path / "bpe")
    info = meta["tokenizer"]
    assert info["kind"] == "bpe" and info["vocab_size"] == 512 == tok.vocab_size and info["dtype"] == "uint16"
    assert info["file"] == "tokenizer.json" and tok.eot == 0 == info["eot"]
    text = "Now is the winter of our discontent\nMade glorious summer, héllo!"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode())
    texts = {p.name: p.read_text(encoding="utf-8") for p in files}
    np.testing.assert_array_equal(
        _split_stream(tmp_path / "bpe", "train"), _expected_stream(meta, texts, tok.encode, tok.eot, "train")
    )
    np.testing.assert_array_equal(
        _split_stream(tmp_path / "bpe", "val"), _expected_stream(meta, texts, tok.encode, tok.eot, "val")
    )
    again = prepare_dataset(tmp_path / "bpe2", texts=files, tokenizer="bpe", vocab_size=512)
    assert again["dataset_fingerprint"] == meta["dataset_fingerprint"]
    ds = TokenDataset.open(tmp_path / "bpe", verify=True)
    assert texts[meta["documents"][0]["name"]].startswith(ds.decode(ds.get(0, 64)))


def test_bin_import(ds, byte_dir, tmp_path):
    src = tmp_path / "nanogpt"
    src.mkdir()
    train, val = _split_stream(byte_dir, "train"), _split_stream(byte_dir, "val")
    train.tofile(src / "train.bin")
    val.tofile(src / "val.bin")
    out = tmp_path / "imported"
    bins = [src / "train.bin", src / "val.bin"]
    r = _cli("prepare", "--out", out, "--bin", *bins, "--vocab-size", 256, "--shard-tokens", SHARD_TOKENS)
    assert r.returncode == 0, r.stderr
    imported = TokenDataset.open(out, verify=True)
    assert imported.meta["tokenizer"]["kind"] == "external"
    assert [s["sha256"] for s in imported.meta["shards"]] == [s["sha256"] for s in ds.meta["shards"]]
    assert imported.fingerprint != ds.fingerprint  # same tokens, different tokenizer identity
    np.testing.assert_array_equal(imported.get(5, SEQ), ds.get(5, SEQ))
    assert imported.decode([1, 2]) == "<1><2>"

    # no val-named file: each file's tail becomes val; uint32 input re-encoded as uint16
    train.astype(np.uint32).tofile(src / "corpus.bin")
    meta = prepare_dataset(tmp_path / "tail", bins=[src / "corpus.bin"], vocab_size=256, dtype="uint32")
    assert meta["tokens"] == {"train": len(train) - round(0.05 * len(train)), "val": round(0.05 * len(train))}
    np.testing.assert_array_equal(_split_stream(tmp_path / "tail", "train"), train[: meta["tokens"]["train"]])

    with pytest.raises(DataError, match="not below --vocab-size 100"):
        prepare_dataset(tmp_path / "bad", bins=[src / "train.bin"], vocab_size=100)
    (src / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="whole number"):
        prepare_dataset(tmp_path / "bad", bins=[src / "odd.bin"], vocab_size=256)
    assert not (tmp_path / "bad").exists()  # a failed prepare leaves nothing behind


# ---- sampler and skip list --------------------------------------------------------------------


def test_sampler_is_deterministic_and_resumable():
    a = Sampler(1000, seed=7, dataset_fingerprint="fp")
    first, _ = a.next_ids(300)
    state = json.loads(json.dumps(a.state_dict()))
    assert state == {"epoch": 0, "position": 300, "seed": 7, "num_samples": 1000, "dataset_fingerprint": "fp"}
    rest, _ = a.next_ids(500)
    b = Sampler(1000, seed=0, dataset_fingerprint="fp")  # the checkpoint's seed wins
    b.load_state_dict(state)
    assert b.next_ids(500)[0] == rest
    c = Sampler(1000, seed=7, dataset_fingerprint="fp")
    assert c.next_ids(800)[0] == first + rest
    assert Sampler(1000, seed=8, dataset_fingerprint="fp").next_ids(300)[0] != first


def test_sampler_epoch_wrap():
    s = Sampler(10, seed=3, dataset_fingerprint="fp")
    ids, skipped = s.next_ids(25)
    assert skipped == 0
    assert sorted(ids[:10]) == list(range(10)) and sorted(ids[10:20]) == list(range(10))
    assert ids[:10] != ids[10:20]
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 5
    expect = np.random.Generator(np.random.PCG64([3, 1])).permutation(10).tolist()
    assert ids[10:20] == expect


def test_sampler_honours_skip_list():
    skip = SkipList([(0, 100), (500, 600)])
    s = Sampler(1000, seed=1, dataset_fingerprint="fp")
    ids, skipped = s.next_ids(700, skip)
    assert len(ids) == 700 and not any(skip.contains(i) for i in ids)
    assert skipped == s.state_dict()["position"] - 700

    # growth mid-stream: the next ids the stream would have produced are banned
    upcoming = s.peek_ids(20, skip)
    assert s.peek_ids(20, skip) == upcoming and s.state_dict()["position"] == 700 + skipped
    assert skip.add([(i, i + 1) for i in upcoming[:5]]) is True
    more, more_skipped = s.next_ids(50, skip)
    assert not set(more) & set(upcoming[:5]) and more[:15] == upcoming[5:]
    assert more_skipped >= 5

    # skipping everything is an error, not a hang
    with pytest.raises(DataError, match="every one"):
        Sampler(50, seed=1, dataset_fingerprint="fp").next_ids(1, SkipList([(0, 50)]))


def test_skip_list_merge_save_load(tmp_path):
    skip = SkipList([(10, 20), (5, 12), (30, 30), (20, 25)])
    assert skip.ranges == [(5, 25)] and len(skip) == 20
    assert skip.contains(5) and skip.contains(24) and not skip.contains(25) and not skip.contains(4)
    assert skip.add([(7, 9)]) is False
    assert skip.add([(40, 42)]) is True and skip.ranges == [(5, 25), (40, 42)]
    np.testing.assert_array_equal(skip.contains_many(np.array([4, 5, 24, 25, 41, 42])), [0, 1, 1, 0, 1, 0])
    path = tmp_path / "skiplist.json"
    skip.save(path)
    assert json.loads(path.read_text()) == [[5, 25], [40, 42]]
    assert SkipList.load(path) == skip
    assert len(SkipList.load(tmp_path / "missing.json")) == 0
    path.write_text("{not json")
    with pytest.raises(DataError, match="unreadable"):
        SkipList.load(path)
    for bad in ([(-1, 3)], [(1, 2**63)], [(1, 99999999999999999999999)], [(1.5, 3)], [("a", 3)], [(1, 2, 3)], [None]):
        with pytest.raises(DataError, match="bad skip range"):
            SkipList(bad)
    assert len(SkipList([(2**63 - 2, 2**63 - 1)])) == 1  # int64 max is fine
    path.write_text("[[1, 99999999999999999999999]]")
    with pytest.raises(DataError, match="malformed"):
        SkipList.load(path)


def test_fingerprint_and_size_mismatch_refused():
    s = Sampler(100, seed=0, dataset_fingerprint="aaa")
    with pytest.raises(DataError, match="dataset fingerprint mismatch: checkpoint was trained on aaa, this data is bbb"):
        Sampler(100, seed=0, dataset_fingerprint="bbb").load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="sample count mismatch"):
        Sampler(99, seed=0, dataset_fingerprint="aaa").load_state_dict(s.state_dict())


def test_batch_fingerprint():
    ids = [3, 1, 2**40]
    assert batch_fingerprint(ids) == hashlib.sha256(np.array(ids, dtype="<i8").tobytes()).hexdigest()[:16]
    assert batch_fingerprint(np.array(ids)) == batch_fingerprint(ids) != batch_fingerprint(ids[::-1])


# ---- CLI and default dataset ------------------------------------------------------------------


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "trainer.data", *map(str, args)], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_bad_input_is_one_line(tmp_path, byte_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    out = tmp_path / "out"
    cases = [
        (["prepare", "--out", out, "--text", tmp_path / "nope.txt"], "does not exist"),
        (["prepare", "--out", out, "--text", empty], "is empty"),
        (["prepare", "--out", out, "--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size"),
        (["prepare", "--out", out, "--vocab-size", "300"], "--vocab-size must be 256"),
        (["prepare", "--out", out, "--bin", byte_dir / "val-00000.bin"], "needs --vocab-size"),
        (["prepare", "--out", out, "--bin", byte_dir / "val-00000.bin", "--vocab-size", "0"], "--vocab-size"),
        (["prepare", "--out", out, "--val-fraction", "0.9"], "--val-fraction"),
        (["prepare", "--out", byte_dir], "already exists"),
        (["prepare"], "--out"),
        (["info", tmp_path], "has no meta.json"),
    ]
    for args, needle in cases:
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (args, r.stderr)
    assert not out.exists()


def test_cli_info(byte_dir, ds):
    r = _cli("info", byte_dir, "--verify")
    assert r.returncode == 0, r.stderr
    assert ds.fingerprint in r.stdout and "verified" in r.stdout


def test_ensure_prepared_races_safely(tmp_path, ds, monkeypatch):
    target = tmp_path / "cache" / "shakespeare-byte"
    monkeypatch.setenv("SENTINEL_DATA_DIR", str(target))
    assert default_data_dir() == target
    code = "from trainer.data import ensure_prepared; print(ensure_prepared())"
    env = os.environ.copy()
    procs = [subprocess.Popen([PYTHON, "-c", code], stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and outs == [str(target)] * 2
    assert TokenDataset.open(target, verify=True).meta["tokens"] == ds.meta["tokens"]  # default: one big train shard
    assert os.listdir(target.parent) == ["shakespeare-byte"]  # no temp dirs left behind
    assert ensure_prepared() == target  # already there: returns at once


# ---- the seq_len schedule: shorter sequences are pieces of the model.seq_len windows

def test_seq_len_schedule_pieces_are_the_shorter_windows_exactly(ds):
    """Cut into k pieces, window j at S is exactly the windows j*k .. j*k+k-1 at S/k: every target
    token once, none repeated, none lost, so the data stream does not depend on the schedule."""
    from trainer.seqlen import split_windows

    ids = [0, 7, 123, 5000]
    full = ds.get_many(ids, 64)
    for n in (64, 32, 16, 8):
        k = 64 // n
        pieces = split_windows(full, n)
        assert pieces.shape == (len(ids) * k, n + 1)
        want = ds.get_many([j * k + i for j in ids for i in range(k)], n)
        assert np.array_equal(pieces, want), n
        targets = pieces[:, 1:].reshape(len(ids), -1)
        assert np.array_equal(targets, full[:, 1:])


def test_seq_len_schedule_config_and_lookup():
    from trainer.config import ConfigError, resolve
    from trainer.seqlen import changes_at, pieces_at, seq_len_at

    cfg = resolve(preset="tiny", overrides={"data.seq_len_schedule": [[0, 16], [10, 32], [20, 64]]})
    assert [seq_len_at(cfg, s) for s in (0, 9, 10, 19, 20, 10_000)] == [16, 16, 32, 32, 64, 64]
    assert [pieces_at(cfg, s) for s in (0, 10, 20)] == [4, 2, 1]
    assert [s for s in range(30) if changes_at(cfg, s)] == [10, 20]
    late = resolve(preset="tiny", overrides={"data.seq_len_schedule": [[5, 32]]})
    assert [seq_len_at(late, s) for s in (0, 4, 5)] == [64, 64, 32]  # before the first entry: model.seq_len
    assert seq_len_at(resolve(preset="tiny"), 3) == 64
    for bad, needle in (
        ([[0, 48]], "seq_len 48 (from step 0) must divide model.seq_len 64"),
        ([[0, 8]], "(8) must divide data.micro_batch_size 4"),  # 64/8 pieces do not fill a micro-batch of 4
        ([[0, 128]], "must divide model.seq_len 64"),
        ([[5, 16], [5, 32]], "strictly increasing"),
        ([[0, 0]], "SEQ_LEN values must be >= 1"),
        ([[0]], "data.seq_len_schedule.0"),
        ("abc", "data.seq_len_schedule"),
    ):
        with pytest.raises(ConfigError) as e:
            resolve(preset="tiny", overrides={"data.seq_len_schedule": bad})
        msg = str(e.value)
        assert needle in msg and "\n" not in msg and "Value error" not in msg, msg


def test_seq_len_change_rebaselines_the_guard():
    """A planned change of loss level (a new sequence length) is not a spike: after ``rebaseline``
    the guard accepts the new level instead of skipping up to max_consecutive_skips steps of data;
    non-finite steps are still skipped."""
    import torch

    from trainer.config import GuardConfig
    from trainer.guard import StepGuard

    def warmed() -> StepGuard:
        g = StepGuard(GuardConfig(), torch.device("cpu"))
        for i in range(20):
            g.check(torch.tensor(3.0 + 0.01 * (i % 3)), torch.tensor(1.0))
        return g

    jump = torch.tensor(4.0), torch.tensor(1.0)
    assert float(warmed().check(*jump)[0]) == 0.0  # without: a loss spike, the update is dropped
    g = warmed()
    g.rebaseline()
    assert float(g.check(*jump)[0]) == 1.0
    assert (g.state_dict()["count"], g.state_dict()["streak"]) == (1, 0)
    assert float(g.check(torch.tensor(float("nan")), torch.tensor(1.0))[0]) == 0.0
