"""The contract's one-copy rules: the rollback target, the manifest validator, the skip-removal
reader and the sample-id range helpers (pure functions: tables, no services)."""

from __future__ import annotations

import json
import os

import pytest

from sentinel.contract.checkpoints import ManifestError, check_manifest
from sentinel.contract.ranges import intersect_ranges, merge_ranges, subtract_ranges, valid_ranges
from sentinel.contract.rundir import SKIP_REMOVED, RunFileError, read_skip_removals
from sentinel.contract.targets import rollback_target

CKPTS = (50, 120, 180, 198, 199, 250)

# (checkpoints, onset, margin, suspect_updates, expected target)
TARGETS = [
    (CKPTS, 300, 100, 2, 199),  # newest <= 300 - 100 = 200
    (CKPTS, 200, 0, 2, 198),  # 199 produced step 200's anomalous loss: never a target
    (CKPTS, 201, 0, 2, 199),  # onset - 2 itself is vouched for
    (CKPTS, 200, 100, 2, 50),  # none <= 100: the oldest vouched one (furthest from the onset)
    (CKPTS, 140, 100, 2, 50),
    (CKPTS, 52, 100, 2, 50),  # only 50 <= 52 - 2
    (CKPTS, 51, 100, 2, None),  # 50 = onset - 1: not vouched, nothing older: None (escalate)
    (CKPTS, 30, 0, 2, None),
    ((), 1000, 0, 2, None),
    ((100, 100, 90), 110, 0, 2, 100),  # duplicates are one checkpoint
    (CKPTS, 200, 0, 1, 199),  # a replay of step 200 restores the state it trained from
    (CKPTS, 199, 0, 1, 198),
    (CKPTS, 50, 0, 1, None),  # a checkpoint of the replayed step holds its update
    ((0,), 2, 0, 2, 0),  # a fresh start's step 0 counts
]


@pytest.mark.parametrize("checkpoints,onset,margin,suspect,want", TARGETS)
def test_rollback_target_is_vouched_for_and_prefers_the_margin(checkpoints, onset, margin, suspect, want):
    assert rollback_target(checkpoints, onset, margin=margin, suspect_updates=suspect) == want


def _manifest(ext: str = ".safetensors", **over) -> dict:
    files = {n: "a" * 64 for n in ("train_state.json", f"model{ext}", f"optim{ext}", f"rng-rank0{ext}")}
    return {"format": 1, "step": 20, "files": files, "bytes": 10, "world_size": 1, "created": 1.0, **over}


MANIFESTS = {  # case -> (manifest, words of the one-line error; None: valid)
    "valid": (_manifest(), None),
    "extra-metadata": (_manifest(run="r", timeline=3, tokens=9), None),
    "not-an-object": ([1, 2], "expected a JSON object"),
    "newer-format": (_manifest(format=2), "unsupported checkpoint format 2"),
    "negative-step": (_manifest(step=-5), "manifest step is invalid"),
    "step-as-string": (_manifest(step="20"), "manifest step is invalid"),
    "other-directory": (_manifest(step=30), "manifest names step 30, not the step of its directory"),
    "world-size-zero": (_manifest(world_size=0), "manifest world_size is invalid"),
    "nan-created": (_manifest(created=float("nan")), "manifest created is invalid"),
    "bad-digest": (_manifest(files={**_manifest()["files"], "model.safetensors": "xyz"}), "manifest files is invalid"),
    "path-escape": (_manifest(files={**_manifest()["files"], "../escape": "a" * 64}), "unsafe file name"),
    "rng-unlisted": (_manifest(world_size=2), "rng-rank1.safetensors is not in the manifest"),
    # a checkpoint written before tensor files: torch's .pt names, the same rule
    "torch-format-valid": (_manifest(".pt"), None),
    "torch-format-rng-unlisted": (_manifest(".pt", world_size=2), "rng-rank1.pt is not in the manifest"),
    "torch-format-model-unlisted": (_manifest(".pt", files={n: "a" * 64 for n in ("train_state.json", "optim.pt", "rng-rank0.pt")}),
                                    "model.pt is not in the manifest"),
    "formats-mixed": (_manifest(files={n: "a" * 64 for n in ("train_state.json", "model.pt", "optim.pt", "rng-rank0.safetensors")}),
                      "model.safetensors is not in the manifest"),
    "missing-format": ({k: v for k, v in _manifest().items() if k != "format"}, "manifest format is invalid"),
}


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_one_manifest_validator_for_trainer_and_views(case):
    raw, words = MANIFESTS[case]
    if words is None:
        assert check_manifest(raw, "step-00000020").step == 20
        return
    with pytest.raises(ManifestError) as e:
        check_manifest(raw, "step-00000020")
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("content,words", [
    (None, None), ("[[5, 10], [1, 3], [3, 4]]", None), ('[["a", 1]]', "is malformed"), ("[[10, 5]]", "is malformed"),
    ("{", "is unreadable"), ("[" * 100 + "]" * 100, "is unreadable"), (b"\xff\xfe", "is unreadable"),
])
def test_one_skip_removal_reader(tmp_path, content, words):
    if content is not None:
        p = tmp_path / SKIP_REMOVED
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    if words is None:
        assert read_skip_removals(tmp_path) == ([] if content is None else [(1, 4), (5, 10)])
        return
    with pytest.raises(RunFileError, match=words):
        read_skip_removals(tmp_path)


def test_range_helpers():
    assert merge_ranges([(5, 10), (0, 0), (1, 3), (3, 5)]) == [(1, 10)]
    assert subtract_ranges([(0, 10)], [(2, 4), (8, 20)]) == [(0, 2), (4, 8)]
    assert intersect_ranges([(0, 10), (20, 30)], [(5, 25)]) == [(5, 10), (20, 25)]
    assert valid_ranges(json.loads('[[1, 2], [3, 2], ["a", 5], [true, 4], [4, 9], 7]')) == [(1, 2), (4, 9)]
    assert valid_ranges("nope") == []


def _digests(data: bytes) -> dict[str, str]:
    import hashlib

    import blake3

    return {"blake3": "blake3:" + blake3.blake3(data).hexdigest(), "sha256": hashlib.sha256(data).hexdigest()}


CHECKSUMS = {  # what a manifest records -> whether the file (b"checkpoint bytes") matches it
    "blake3": (lambda d: d["blake3"], True),
    "sha256, written before BLAKE3": (lambda d: d["sha256"], True),
    "blake3 of other bytes": (lambda d: _digests(b"other")["blake3"], False),
    "sha256 of other bytes": (lambda d: _digests(b"other")["sha256"], False),
    "blake3 digest under no prefix": (lambda d: d["blake3"].split(":")[1], False),
    "empty": (lambda d: "", False),
}


@pytest.mark.parametrize("case", sorted(CHECKSUMS))
def test_one_file_checksum_in_both_forms(tmp_path, case):
    """The checksum a manifest records, in the contract once: BLAKE3 (``blake3:<hex>``) for what is
    written now, bare sha256 for manifests written before; the recorded value says which to compute."""
    from sentinel.contract.fsio import Checksum, checksum_matches, file_checksum

    data = b"checkpoint bytes"
    f = tmp_path / "model.pt"
    f.write_bytes(data)
    want = _digests(data)
    h = Checksum()
    h.update(data[:5])
    h.update(memoryview(data)[5:])
    assert file_checksum(f) == h.hexdigest() == want["blake3"]
    assert file_checksum(f, like=want["sha256"]) == want["sha256"]
    recorded, matches = CHECKSUMS[case]
    assert checksum_matches(f, recorded(want)) is matches


ANNOUNCED = {  # what announce() is given: nothing is read, nothing raises, nothing blocks
    "a small file": lambda d: _file(d / "a", b"x" * 4096),
    "an empty file": lambda d: _file(d / "e", b""),
    "a file over the bound (skipped)": lambda d: _file(d / "big", b"\0", size=(4 << 20) + 1),
    "a missing path": lambda d: d / "missing",
    "a directory": lambda d: d,
    "a FIFO (no writer: opening it must not block)": lambda d: (os.mkfifo(d / "fifo"), d / "fifo")[1],
    "a dangling symlink": lambda d: (os.symlink(d / "nowhere", d / "link"), d / "link")[1],
}


def _file(path, data: bytes, size: int | None = None):
    path.write_bytes(data)
    if size is not None:
        os.truncate(path, size)
    return path


@pytest.mark.parametrize("case", sorted(ANNOUNCED))
def test_announcing_files_is_advice_that_never_fails(tmp_path, case):
    """``checksums_match`` announces the small files of a checkpoint before it reads them
    (``POSIX_FADV_WILLNEED``). Whatever a path is, that neither raises nor blocks, and the checksums
    that follow are those of the bytes on disk."""
    from sentinel.contract.fsio import announce, checksums_match, file_checksum

    path = ANNOUNCED[case](tmp_path)
    good = _file(tmp_path / "good", b"checkpoint bytes")
    announce([path, good, path])
    assert checksums_match([(good, file_checksum(good)), (good, "blake3:" + "0" * 64)]) == [True, False]


def test_checksums_of_small_and_large_files_in_either_form(tmp_path):
    """``checksums_match`` maps and hashes the small files on the caller's thread, the large ones on
    its threads: each verdict lands at its own file's place, whatever the form of the recorded value
    or the state of the file; asked to, it keeps the mappings a reader can reuse."""
    import hashlib

    from sentinel.contract.fsio import ANNOUNCE_MAX_BYTES, checksums_match, file_checksum

    small, empty, big = _file(tmp_path / "s", b"s" * 5000), _file(tmp_path / "e", b""), _file(tmp_path / "b", b"", size=ANNOUNCE_MAX_BYTES + 8)
    big2 = _file(tmp_path / "b2", b"x", size=ANNOUNCE_MAX_BYTES + 1)
    bad = "blake3:" + "0" * 64
    cases = [(small, file_checksum(small), True), (big, file_checksum(big), True), (empty, file_checksum(empty), True),
             (small, hashlib.sha256(b"s" * 5000).hexdigest(), True), (big2, bad, False), (small, bad, False),
             (big2, file_checksum(big2), True), (empty, bad, False)]
    assert checksums_match([(p, r) for p, r, _ in cases]) == [want for _, _, want in cases]
    # with ``keep``: a small file whose BLAKE3 checksum matched leaves the mapping it was hashed through,
    # holding its bytes, for its reader; nothing else does (sha256, empty, large, or a mismatch)
    keep: dict = {}
    assert checksums_match([(p, r) for p, r, _ in cases], keep) == [want for _, _, want in cases]
    assert list(keep) == [small] and bytes(keep[small]) == b"s" * 5000
    with pytest.raises(FileNotFoundError):  # as it always did: the verifier checks that every file is there first
        checksums_match([(small, bad), (tmp_path / "gone", bad)])
    assert checksums_match([(big, file_checksum(big))]) == [True]  # one large file: hashed on this thread


def test_meanwhile_sees_each_small_file_before_its_hash_smallest_first(tmp_path):
    """``checksums_match(meanwhile=...)``: the caller's work while the disk reads (a load parses each
    file's header there). It is called once per small file hashed through a mapping, in the order the
    files were announced (the smallest first), each time before that file is hashed and with the very
    mapping that is then hashed and kept; never for an empty file or a sha256 record. Large files are
    seen after the small ones, each through a mapping of its own, while the threads hash them: only
    when there are several (one is hashed on the caller's thread, first). A file it saw may still fail
    its checksum: what it read is not verified."""
    import hashlib

    from sentinel.contract.fsio import ANNOUNCE_MAX_BYTES, checksums_match, file_checksum

    mid, tiny, big = _file(tmp_path / "mid", b"m" * 9000), _file(tmp_path / "tiny", b"t" * 10), _file(tmp_path / "big", b"", size=ANNOUNCE_MAX_BYTES + 8)
    empty, legacy, bad = _file(tmp_path / "empty", b""), _file(tmp_path / "legacy", b"l" * 100), _file(tmp_path / "bad", b"b" * 50)
    seen: list = []
    keep: dict = {}

    def meanwhile(path, mapped):
        seen.append((path, bytes(mapped), path in keep))  # not hashed yet: nothing kept for it so far

    files = [(mid, file_checksum(mid)), (big, file_checksum(big)), (empty, file_checksum(empty)),
             (legacy, hashlib.sha256(b"l" * 100).hexdigest()), (bad, "blake3:" + "0" * 64), (tiny, file_checksum(tiny))]
    assert checksums_match(files, keep, meanwhile) == [True, True, True, True, False, True]
    assert seen == [(tiny, b"t" * 10, False), (bad, b"b" * 50, False), (mid, b"m" * 9000, False)]
    assert list(keep) == [tiny, mid] and bytes(keep[mid]) == b"m" * 9000
    # two large files: both seen, after the small ones, in the order given; neither kept
    big2 = _file(tmp_path / "big2", b"x", size=ANNOUNCE_MAX_BYTES + 16)
    seen.clear()
    keep = {}
    assert checksums_match([(big2, file_checksum(big2)), (tiny, file_checksum(tiny)), (big, "blake3:" + "0" * 64)],
                           keep, meanwhile) == [True, True, False]
    assert [(p, len(b), k) for p, b, k in seen] == [(tiny, 10, False), (big2, ANNOUNCE_MAX_BYTES + 16, False),
                                                     (big, ANNOUNCE_MAX_BYTES + 8, False)]
    assert list(keep) == [tiny]


@pytest.mark.parametrize("how", ["wait_released", "the releasing thread"])
def test_release_later_lets_go_after_the_caller_returns(how):
    """``release_later``: a load's mappings are let go after it, not in it: by ``wait_released`` at once,
    or by the releasing thread within its period (50 ms) when nobody waits."""
    import gc
    import time
    import weakref

    from sentinel.contract.fsio import release_later, wait_released

    class Held:
        pass

    obj = Held()
    gone = weakref.ref(obj)
    gc.disable()  # the reference must drop by the releaser, not by a collection
    try:
        release_later([obj])
        del obj
        if how == "wait_released":
            wait_released()
            assert gone() is None
        else:
            deadline = time.monotonic() + 5
            while gone() is not None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert gone() is None, "the releasing thread never let go"
    finally:
        gc.enable()


def test_a_process_that_exits_while_the_releaser_unmaps_exits_cleanly():
    """A process that exits right after a load (a trainer resumed and then stopped at once): the
    releasing thread may be inside torch's deleter, unmapping, when the interpreter finalises. The exit
    waits for it and lets go of the rest on the main thread (``atexit``); before, the daemon thread was
    ended inside C++ frames and the process aborted ("terminate called without an active exception",
    exit -6). Here a 256 MB mapping (its unmapping outlasts the releaser's 50 ms) is handed over just
    before the exit."""
    from tests.helpers import python_c

    script = (
        "import mmap, time, torch\n"
        "import sentinel.contract.fsio as fsio\n"
        "m = mmap.mmap(-1, 256 << 20)\n"
        "t = torch.frombuffer(m, dtype=torch.uint8)\n"
        "t.fill_(1)\n"
        "fsio.release_later(t)\n"
        "del t, m\n"
        "time.sleep(fsio.RELEASE_EVERY_SECONDS + 0.01)\n"
    )
    p = python_c(script)
    assert p.returncode == 0 and "terminate called" not in p.stderr, p.stderr[-2000:]


def test_remove_dir_leaves_nothing_under_the_name_when_the_delete_dies_and_clear_trash_finishes_it(tmp_path, monkeypatch):
    """The contract's rule for deleting a checkpoint directory (the trainer's retention and re-save, the
    Lightning integration's pruning): renamed out of the step names first, so a kill inside the delete
    leaves a ``.trash-*`` directory that ``clear_trash`` removes at the next start, never a half step."""
    import shutil

    from sentinel.contract import fsio

    step = tmp_path / "step-00000004"
    step.mkdir()
    (step / "manifest.json").write_text("{}")
    (step / "model.safetensors").write_bytes(b"x")

    def dies_midway(path, *args, **kwargs):
        (path / "manifest.json").unlink()
        raise KeyboardInterrupt  # a kill: not an error the delete could swallow

    monkeypatch.setattr(shutil, "rmtree", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        fsio.remove_dir(step)
    monkeypatch.undo()
    assert not step.exists()
    (trash,) = tmp_path.iterdir()
    assert trash.name.startswith(fsio.TRASH_PREFIX + "step-00000004-") and [p.name for p in trash.iterdir()] == ["model.safetensors"]
    fsio.clear_trash(tmp_path)
    assert list(tmp_path.iterdir()) == []


def _step(**change):
    from sentinel.contract.records import StepRecord

    base = StepRecord(run="r", step=5, timeline=1, loss=3.0, loss_max_rank=3.1, grad_norm=1.0, lr=3e-4, tokens=5 * 65536,
                      batch_tokens=65536, batch_fingerprint="f", sample_ids=list(range(320, 384)), time=1e9, step_seconds=0.1,
                      tokens_per_second=1e5, mfu=0.4, val_loss=3.2, val_ppl=24.5, checkpoint_age_seconds=60.0,
                      effective_token_ratio=0.98)
    return base.model_copy(update=change)


NAN, INF = float("nan"), float("inf")
# (change to a plausible step record, what the range check must say: None, or a word of its message)
STEP_RANGES = [
    ({}, None),
    ({"loss": NAN, "grad_norm": INF, "val_loss": NAN, "val_ppl": INF, "loss_max_rank": INF}, None),  # real signals
    ({"rank_losses": [3.0, NAN, INF]}, None),
    ({"phases": {"forward_backward": 0.4}, "rank_phases": [{"forward_backward": 0.4}], "rank_step_seconds": [0.1]}, None),
    ({"sample_ids": []}, None),
    ({"mfu": None, "val_loss": None, "step_seconds": None}, None),
    ({"step": 0, "timeline": 0, "tokens": 0, "batch_tokens": 0, "loss": 0.0, "lr": 0.0}, None),
    ({"step": -1}, "step=-1"), ({"step": 10**40}, "step=<a"), ({"timeline": -2}, "timeline=-2"),
    ({"tokens": -1}, "tokens=-1"), ({"batch_tokens": -1}, "batch_tokens=-1"),
    ({"world_size": 0}, "world_size=0"), ({"world_size": 1 << 25}, "world_size="),
    ({"sample_ids": [1, -3, 5]}, "sample_ids=-3"), ({"sample_ids": [1, 10**30]}, "sample_ids="),
    ({"loss": -INF}, "loss="), ({"loss": -1.0}, "loss=-1.0"), ({"loss": 1e308}, "loss=1e+308"),
    ({"grad_norm": -0.5}, "grad_norm="), ({"lr": NAN}, "lr is not finite"), ({"lr": INF}, "lr is not finite"),
    ({"time": NAN}, "time is not finite"), ({"time": -1.0}, "time="), ({"step_seconds": INF}, "step_seconds is not finite"),
    ({"tokens_per_second": -1.0}, "tokens_per_second="), ({"mfu": NAN}, "mfu is not finite"),
    ({"checkpoint_age_seconds": -5.0}, "checkpoint_age_seconds="), ({"effective_token_ratio": INF}, "effective_token_ratio"),
    ({"val_loss": -1.0}, "val_loss="), ({"val_ppl": -INF}, "val_ppl="),
    ({"rank_losses": [3.0, -1.0]}, "rank_losses="), ({"rank_step_seconds": [0.1, NAN]}, "rank_step_seconds is not finite"),
    ({"phases": {"forward_backward": -0.1}}, "phases="), ({"rank_phases": [{"x": 0.1}, {"x": INF}]}, "rank_phases is not finite"),
]


@pytest.mark.parametrize("change,want", STEP_RANGES, ids=[str(sorted(c))[:60] for c, _ in STEP_RANGES])
def test_a_step_records_numbers_are_range_checked_in_one_pass(change, want):
    """``record_range_error`` checks a step record in one pass that builds a message only for a value
    the plain comparison refuses: a NaN or +inf loss passes, anything else out of range is named.
    Its fast path (``_step_in_range``, every number by the plain comparison) passes no record the
    full check refuses."""
    from sentinel.contract.bounds import _step_in_range, record_range_error

    rec = _step(**change)
    got = record_range_error(rec)
    if want is None:
        assert got is None
    else:
        assert got is not None and want in got, got
        assert not _step_in_range(rec)
    nonfinite = any(v != v or v == INF for v in _numbers(change))  # allowed where a NaN or +inf is a signal
    assert _step_in_range(rec) == (want is None and not nonfinite)


def _numbers(x):
    """Every number in a (nested) change."""
    if isinstance(x, dict):
        return [n for v in x.values() for n in _numbers(v)]
    if isinstance(x, list):
        return [n for v in x for n in _numbers(v)]
    return [x] if isinstance(x, (int, float)) else []


# sentinel.contract.yamlio: (document, the value, or the reason in the YamlError's brackets)
YAML_DOCS = [
    (b"seed: 3\nmodel: {d_model: 64}\n", {"seed": 3, "model": {"d_model": 64}}),
    (b"", None),
    (b"x: .nan\ny: 1:30\n", "float-nan-and-sexagesimal"),  # YAML 1.1, alike in both loaders
    (b"[" * 50_000 + b"]" * 50_000, "nested too deep"),
    (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, "nested too deep"),
    ("".join(" " * i + "a:\n" for i in range(3000)).encode() + b" " * 3000 + b"1\n", "nested too deep"),
    (b"model: [unclosed\n  d_model: 3\n", "at line 2, column 10"),  # the words differ between the loaders
    (b"!!python/object/apply:os.system ['true']", "could not determine a constructor"),
    (b"seed: \xff\xfe\n", "not UTF-8 text"),
]


@pytest.mark.parametrize("loader", ["libyaml", "python"])
@pytest.mark.parametrize("doc,want", YAML_DOCS, ids=["config", "empty", "yaml-1.1", "deep-flow", "deep-object", "deep-block",
                                                     "unclosed", "python-tag", "not-utf8"])
def test_yaml_documents_parse_or_fail_in_one_line_with_either_loader(doc, want, loader, tmp_path, monkeypatch):
    """One loader for every YAML document both sides read; libyaml's when PyYAML has it (10x faster, and a
    document nested 50,000 deep fails in milliseconds, not ~0.7 s of recursion), else PyYAML's own, with
    the same values and the same one-line reasons."""
    import math

    import yaml

    from sentinel.contract import yamlio

    if loader == "python":
        monkeypatch.setattr(yamlio, "Loader", yaml.SafeLoader)
    else:
        assert yamlio.Loader is yaml.CSafeLoader  # the wheels ship libyaml: the fast path is the one in use
    path = tmp_path / "doc.yaml"
    path.write_bytes(doc)
    if want == "float-nan-and-sexagesimal":
        got = yamlio.read_yaml(path)
        assert math.isnan(got["x"]) and got["y"] == 90
    elif isinstance(want, str):
        with pytest.raises(yamlio.YamlError) as ei:
            yamlio.read_yaml(path)
        assert want in ei.value.reason and "\n" not in str(ei.value), str(ei.value)
    else:
        assert yamlio.read_yaml(path) == want


def test_read_yaml_is_bounded_and_refuses_what_is_no_regular_file(tmp_path):
    from sentinel.contract.fsio import UnreadableFileError
    from sentinel.contract.yamlio import read_yaml

    big = tmp_path / "big.yaml"
    big.write_bytes(b"a: 1\n" * 100)
    with pytest.raises(UnreadableFileError, match="larger than 100 bytes"):
        read_yaml(big, limit=100)
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with pytest.raises(UnreadableFileError, match="FIFO"):
        read_yaml(fifo)
    with pytest.raises(FileNotFoundError):
        read_yaml(tmp_path / "missing.yaml")


JSON_TEXTS = [  # (text, what json.loads makes of it: "same" when it parses, else the SchemaError reason)
    ('{"a":1.00000000000000000000000000001,"b":2.2250738585072011e-308,"c":4.9406564584124654e-324}', "same"),
    ('{"a":1,"a":2}', "same"),  # the last of a repeated key
    ('{"a":NaN,"b":Infinity,"c":-Infinity,"d":1e400,"e":-0.0}', "same"),
    ('{"a":' + "9" * 4300 + "}", "same"),  # an int of the most digits json reads
    ('{"a":' + "9" * 4301 + "}", "malformed"),
    ('{"a":"\\ud800"}', "same"),  # a lone surrogate escape: pydantic-core refuses it, json.loads reads it
    ('{"a":"\\ud83d\\ude00\\u0000"}', "same"),
    ("[" * 300 + "]" * 300, "too_deep"),  # past pydantic-core's nesting limit: json.loads and the walk decide
    ("[" * 17 + "]" * 17, "too_deep"),
    ('{"a":1} x', "malformed"),
    ('{"a":01}', "malformed"),
    ("\ufeff{}", "malformed"),
    ('{"a":"tab\there"}', "malformed"),
]


@pytest.mark.parametrize("text,want", JSON_TEXTS, ids=range(len(JSON_TEXTS)))
def test_json_is_read_as_json_loads_reads_it_or_refused_with_a_reason(text, want):
    """``loads_bounded`` parses with pydantic-core first (a third of json.loads's time on a step
    record) and falls back to json.loads where that fails: what it returns is what json.loads
    returns (NaN compared as NaN), and what it refuses it refuses with the reason it always gave."""
    from sentinel.contract.parsing import SchemaError, loads_bounded

    if want == "same":
        got = loads_bounded(text)
        assert json.dumps(got) == json.dumps(json.loads(text)) and repr(got) == repr(json.loads(text))
        assert got == json.loads(text)  # NaN too: json.loads's one NaN object, so equal where it is the same
    else:
        with pytest.raises(SchemaError) as e:
            loads_bounded(text)
        assert e.value.reason == want


STEP_FIELD_VALUES = [  # hostile values for every field of a step record: the one-pass parse must agree with the two steps
    "1e400", "-1e400", "9" * 400, "-" + "9" * 400, "9" * 4301, "Infinity", "-Infinity", "NaN", '"1.5"', '"5"', '"inf"', '"nan"',
    "true", "false", "null", "5.0", "5.5", "1e2", "-0.0", '"-0"', "-1", "1" + "0" * 30, '"\\ud800"', '"x"', "[]", "{}", "[1.0, 2]",
    "[true]", '["1"]', "[1e400]", '" 5"', '"1_000"', '"+5"', '"5e0"', '""', '{"data_wait": "1"}', '{"data_wait": 1e400}',
    '{"x": {"y": [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]}}',
]
STEP_FIELDS = ["v", "kind", "run", "step", "timeline", "loss", "loss_max_rank", "grad_norm", "lr", "tokens", "batch_tokens",
               "batch_fingerprint", "sample_ids", "skipped", "skip_reason", "time", "phases", "rank_losses", "rank_phases",
               "world_size", "source_loss", "mfu", "unknown"]


@pytest.mark.parametrize("value", STEP_FIELD_VALUES, ids=range(len(STEP_FIELD_VALUES)))
def test_a_step_line_parses_in_one_pass_as_it_does_in_two(value):
    """``parse_step_line`` validates a step record straight from its text: whatever a hostile value
    in any field, it returns what ``loads_bounded`` + ``StepRecord.from_json`` return (the same
    record, the same reason for a refusal). The two differ where this one pass is left out: ``v``
    given as true, 1.0 or "1" (lax int), and an integer literal of 309 digits in a float field
    (infinite in one pass, refused in the other)."""
    from sentinel.contract.parsing import SchemaError, loads_bounded
    from sentinel.contract.records import StepRecord, parse_step_line

    base = StepRecord(run="r", step=5, timeline=1, loss=3.0, loss_max_rank=3.0, grad_norm=1.0, lr=3e-4, tokens=10,
                      batch_fingerprint="ab", sample_ids=[1, 2, 3], time=1.7e9, phases={"data_wait": 0.1}).to_json()
    assert parse_step_line(base) == StepRecord.model_validate_json(base) == StepRecord.from_json(base)
    for field in STEP_FIELDS:
        text = base[:-1] + f', "{field}": {value}}}'
        try:
            want = repr(StepRecord.from_json(loads_bounded(text)).model_dump())
        except SchemaError as e:
            want = e.reason
        try:
            got = repr(parse_step_line(text).model_dump())
        except SchemaError as e:
            got = e.reason
        assert got == want, (field, value)
