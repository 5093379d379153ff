"""The step log's start-up repair of its last line (``sentinel.client.steplog.StepLog._repair_torn_tail``).

A crash mid-write can leave steps.jsonl without its final newline. What is there must not be lost:

* a last line that is a whole record is kept, and only the newline is appended;
* a torn write (not a record) is moved, byte for byte, to ``steps.jsonl.torn-<unix time>`` beside
  the log, and the log cut back to its last whole line;
* a log no reader can parse (garbage in the middle) is a one-line error naming the file and the
  1-based line, and the file is left byte for byte as it was;
* a log that ends with a newline is not touched.

The files are written by hand from the protocol's record models; one cheap end-to-end run (a few
tiny CPU steps) checks the trainer keeps the last record of a run whose newline was lost.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from sentinel.client import steplog as steplog_mod
from sentinel.client.steplog import StepLog, read
from sentinel.protocol import MarkerRecord, StepRecord, TimelineRecord
from tests.helpers.trainer import BASE_ARGS, run_trainer


def _step(n: int, timeline: int = 0) -> StepRecord:
    return StepRecord(run="r", step=n, timeline=timeline, loss=3.0 + n / 7, loss_max_rank=3.5, grad_norm=0.5,
                      lr=1e-3, tokens=256 * n, batch_tokens=256, batch_fingerprint=f"fp{n:04d}",
                      sample_ids=[4 * n, 4 * n + 1, 4 * n + 2, 4 * n + 3], time=1000.0 + n, param_digest=f"d{n}")


def _lines(n_steps: int = 5) -> list[bytes]:
    """A healthy log as its lines (each ending in a newline): start, a marker, steps 1..n."""
    recs = [TimelineRecord(kind="start", run="r", from_step=0, timeline=0, time=999.0),
            MarkerRecord(run="r", step=0, marker="warmup_end", time=999.5)]
    recs += [_step(i) for i in range(1, n_steps + 1)]
    return [(r.to_json() + "\n").encode() for r in recs]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _side_files(d: Path) -> list[Path]:
    return sorted(d.glob("steps.jsonl.torn-*"))


def _open(path: Path) -> tuple[StepLog, list[str]]:
    msgs: list[str] = []
    log = StepLog(path, log=msgs.append)
    return log, msgs


def _steps_in(path: Path) -> list[int]:
    return [r.step for r in read(path) if isinstance(r, StepRecord)]


# ------------------------------------------------------------------ a whole last record is kept
def test_whole_last_record_without_newline_is_kept(tmp_path):
    p = tmp_path / "steps.jsonl"
    full = b"".join(_lines(5))
    p.write_bytes(full[:-1])  # the step-5 record, all of it but its newline

    log, msgs = _open(p)
    assert p.read_bytes() == full, "the record must be kept and only its newline appended"
    assert len(msgs) == 1 and "\n" not in msgs[0], msgs
    assert str(p) in msgs[0] and "line 7" in msgs[0] and "newline appended" in msgs[0], msgs[0]
    assert not _side_files(tmp_path)

    log.write(_step(6))  # the next record starts a line of its own
    log.close()
    assert _steps_in(p) == [1, 2, 3, 4, 5, 6]
    assert p.read_bytes() == full + (_step(6).to_json() + "\n").encode()


def test_only_line_a_whole_record_without_newline_is_kept(tmp_path):
    p = tmp_path / "steps.jsonl"
    line = (_step(1).to_json()).encode()
    p.write_bytes(line)
    log, msgs = _open(p)
    log.close()
    assert p.read_bytes() == line + b"\n" and len(msgs) == 1 and not _side_files(tmp_path)


# ------------------------------------------------------------------ a torn write goes to a side file
TORN = {
    "half a record": lambda rec: rec[: len(rec) // 2],
    "all but the closing brace": lambda rec: rec[:-2],
    "one byte": lambda rec: rec[:1],
    "zeros a crash left past the end": lambda rec: b"\0" * 4096,
    "a valid JSON object that is no record": lambda rec: b'{"kind": "step", "step": 6}',
    "not UTF-8": lambda rec: rec[:40] + b"\xff\xfe",
    "blanks": lambda rec: b"  \t",
}


@pytest.mark.parametrize("case", list(TORN))
def test_torn_tail_moves_to_a_side_file_with_the_exact_bytes(tmp_path, case):
    p = tmp_path / "steps.jsonl"
    good = b"".join(_lines(5))
    torn = TORN[case]((_step(6).to_json() + "\n").encode())
    p.write_bytes(good + torn)

    log, msgs = _open(p)
    assert p.read_bytes() == good, "the log is cut back to its last whole line"
    (side,) = _side_files(tmp_path)
    assert side.read_bytes() == torn, "the side file holds exactly the torn bytes"
    assert len(msgs) == 1 and "\n" not in msgs[0], msgs
    assert str(side) in msgs[0] and f"{len(torn)} bytes" in msgs[0], msgs[0]

    log.write(_step(6))
    log.close()
    assert _steps_in(p) == [1, 2, 3, 4, 5, 6], "the next record is not glued to the torn bytes"


def test_a_log_that_is_only_a_torn_line(tmp_path):
    p = tmp_path / "steps.jsonl"
    torn = _step(1).to_json().encode()[:50]
    p.write_bytes(torn)
    log, msgs = _open(p)
    log.close()
    (side,) = _side_files(tmp_path)
    assert p.read_bytes() == b"" and side.read_bytes() == torn and len(msgs) == 1


def test_an_existing_side_file_is_never_overwritten(tmp_path, monkeypatch):
    # the side file's clock, frozen (the module's own ``time`` only: absent before the fix)
    monkeypatch.setattr(steplog_mod, "time", SimpleNamespace(time=lambda: 1_700_000_000.25), raising=False)
    p = tmp_path / "steps.jsonl"
    good = b"".join(_lines(3))
    taken = tmp_path / "steps.jsonl.torn-1700000000"
    taken.write_bytes(b"an earlier torn tail")
    (tmp_path / "steps.jsonl.torn-1700000000-1").write_bytes(b"and another")

    p.write_bytes(good + b'{"kind": "st')
    StepLog(p, log=lambda m: None).close()
    p.write_bytes(good + b'{"kind": "step", "ru')  # a second crash in the same second
    StepLog(p, log=lambda m: None).close()

    assert taken.read_bytes() == b"an earlier torn tail"
    assert (tmp_path / "steps.jsonl.torn-1700000000-1").read_bytes() == b"and another"
    assert (tmp_path / "steps.jsonl.torn-1700000000-2").read_bytes() == b'{"kind": "st'
    assert (tmp_path / "steps.jsonl.torn-1700000000-3").read_bytes() == b'{"kind": "step", "ru'
    assert p.read_bytes() == good


# ------------------------------------------------------------------ an unreadable log: one line, untouched
def _bad_mid(tail: bytes) -> tuple[bytes, int]:
    lines = _lines(5)
    lines[3] = b"\x80\x81garbage that is not UTF-8\n"
    return b"".join(lines) + tail, 4


def _bad_json_mid(tail: bytes) -> tuple[bytes, int]:
    lines = _lines(5)
    lines[5] = b'{"kind": "step", "step": 4}\n'  # JSON, but no record (fields missing)
    return b"".join(lines) + tail, 6


def _random_bytes(_tail: bytes) -> tuple[bytes, int]:
    body = random.Random(7).randbytes(10_000)
    if body.endswith(b"\n"):
        body += b"x"
    first = next(i for i, ln in enumerate(body.split(b"\n"), 1) if ln.strip())
    return body, first


UNREADABLE = {
    "not UTF-8 mid-file, torn tail": (_bad_mid, "torn"),
    "not UTF-8 mid-file, whole last record without newline": (_bad_mid, "whole"),
    "not a record mid-file, torn tail": (_bad_json_mid, "torn"),
    "not a record mid-file, whole last record without newline": (_bad_json_mid, "whole"),
    "10000 random bytes": (_random_bytes, ""),
}


@pytest.mark.parametrize("case", list(UNREADABLE))
def test_unreadable_log_is_a_one_line_error_naming_file_and_line_and_stays_unchanged(tmp_path, case):
    make, kind = UNREADABLE[case]
    whole6 = _step(6).to_json().encode()
    body, bad_line = make({"torn": whole6[:30], "whole": whole6, "": b""}[kind])
    p = tmp_path / "steps.jsonl"
    p.write_bytes(body)
    before = _sha(p)

    msgs: list[str] = []
    with pytest.raises(ValueError) as ei:
        StepLog(p, log=msgs.append)
    msg = str(ei.value)
    assert "\n" not in msg and str(p) in msg and f"line {bad_line}:" in msg, msg
    assert _sha(p) == before, "the file must be left byte for byte unchanged"
    assert not _side_files(tmp_path) and not msgs


def test_overlong_last_line_is_refused_untouched(tmp_path, monkeypatch):
    """A last line without a newline longer than any torn write could be is not cut away."""
    monkeypatch.setattr(steplog_mod, "TAIL_LIMIT", 4096, raising=False)  # absent before the fix
    p = tmp_path / "steps.jsonl"
    p.write_bytes(b"".join(_lines(3)) + b"x" * 5000)
    before = _sha(p)
    with pytest.raises(ValueError) as ei:
        StepLog(p, log=lambda m: None)
    msg = str(ei.value)
    assert "\n" not in msg and str(p) in msg and "line 6:" in msg and "5000 bytes" in msg, msg
    assert _sha(p) == before and not _side_files(tmp_path)


# ------------------------------------------------------------------ a log ending with a newline
def test_log_ending_with_newline_is_untouched(tmp_path):
    p = tmp_path / "steps.jsonl"
    p.write_bytes(b"".join(_lines(5)))
    before = _sha(p)
    log, msgs = _open(p)
    assert log.last_timeline() == 0
    log.close()
    assert _sha(p) == before and not msgs and not _side_files(tmp_path)


def test_garbage_mid_file_is_untouched_and_left_to_the_readers(tmp_path):
    """Nothing to repair: the log is not read at open. The trainer's start reads only the log's end
    for its newest timeline (every line, parsed, cost a long run 10 s per 300,000 records at every
    start), so a line in the middle that cannot be read does not stop a resume; the readers name it."""
    from sentinel.rundir import read_records

    body, bad_line = _bad_mid(b"")
    p = tmp_path / "steps.jsonl"
    p.write_bytes(body)
    before = _sha(p)
    log, msgs = _open(p)
    assert log.last_timeline() == 0
    log.close()
    assert _sha(p) == before and not msgs and not _side_files(tmp_path)
    rejected: list[str] = []
    assert [r.step for r in read_records(tmp_path, rejected) if isinstance(r, StepRecord)] == [1, 3, 4, 5]
    assert len(rejected) == 1 and f"{p.name}:{bad_line}:" in rejected[0]


def test_the_newest_timeline_is_read_from_the_end_of_a_long_log(tmp_path, monkeypatch):
    """Timelines 0..3 (a resume, two rollbacks) over 4,000 records, a 4 KiB tail: the newest is 3,
    as the whole log says; a tail with nothing readable in it falls back to the whole log, whose
    reader names the bad line."""
    monkeypatch.setattr(StepLog, "TAIL_BYTES", 4096)
    recs = [TimelineRecord(kind="start", run="r", from_step=0, timeline=0, time=1.0)]
    step = 0
    for t in range(4):
        if t:
            step -= 300
            recs.append(TimelineRecord(kind="rollback" if t > 1 else "resume", run="r", from_step=step, timeline=t, time=2.0))
        for _ in range(1000):
            step += 1
            recs.append(_step(step).model_copy(update={"timeline": t}))
    p = tmp_path / "steps.jsonl"
    p.write_bytes(b"".join((r.to_json() + "\n").encode() for r in recs))
    log, _ = _open(p)
    assert log.last_timeline() == 3 == max(r.timeline for r in read(p))
    log.close()
    p.write_bytes(p.read_bytes() + b"\x80 not a record\n" * 600)  # the whole tail unreadable
    log, _ = _open(p)
    with pytest.raises(ValueError, match=r"line 4005:"):
        log.last_timeline()
    log.close()


# ------------------------------------------------------------------ end to end: a real (tiny) run
def test_trainer_keeps_the_last_step_of_a_run_whose_newline_was_lost(tmp_path, dataset):
    run = tmp_path / "run"
    run_trainer(run, *BASE_ARGS, "--data", str(dataset), "--max-steps", "4", "--device", "cpu",
                data_dir=dataset, check=True)
    log = run / "steps.jsonl"
    full = log.read_bytes()
    last = [r for r in read(log) if isinstance(r, StepRecord)][-1]
    assert last.step == 4
    log.write_bytes(full[:-1])

    p = run_trainer(run, *BASE_ARGS, "--data", str(dataset), "--max-steps", "6", "--device", "cpu",
                    data_dir=dataset, check=True)
    assert "a whole record without its newline; kept" in p.stdout, p.stdout[-2000:]
    assert log.read_bytes().startswith(full), "the first run's log is kept whole"
    recs = list(read(log))
    assert [r.model_dump() for r in recs if isinstance(r, StepRecord) and r.step == 4][:1] == [last.model_dump()]
    assert [r.step for r in recs if isinstance(r, StepRecord)] == [1, 2, 3, 4, 5, 6]
    assert not _side_files(run)
