"""`sentinel backtest` on TensorBoard event files, written by the real writer (torch.utils.tensorboard)."""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from torch.utils.tensorboard import SummaryWriter

from sentinel.backtest import SchemaError, load_trace
from sentinel.cli.backtest_cmd import backtest as backtest_cmd

WALL0 = 1.7e9


def _losses(n: int = 600, spike: int = 250, shift_from: int = 400) -> list[float]:
    """A flat noisy curve with one recovered spike and a persistent +10 % shift (damage)."""
    rng = random.Random(0)
    return [round(3.0 * (1 + rng.gauss(0, 0.01)) * (1.5 if s == spike else 1.0) * (1.1 if s >= shift_from else 1.0), 4)
            for s in range(1, n + 1)]


def _jsonl(tmp_path: Path, losses: list[float]) -> Path:
    p = tmp_path / "same.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": x, "time": WALL0 + 0.1 * s}) + "\n" for s, x in enumerate(losses, 1)))
    return p


def _events(logdir: Path, losses: list[float], *, first: int = 1, tag: str = "train/loss", image_at: int | None = None) -> Path:
    """One writer's event file: the loss, a grad norm and the lr (the lr in TensorFlow 2's tensor form)."""
    suffix = f".from{first}"
    w = SummaryWriter(str(logdir), filename_suffix=suffix)
    for s, x in enumerate(losses, first):
        t = WALL0 + 0.1 * s
        w.add_scalar(tag, x, s, walltime=t)
        w.add_scalar("train/grad_norm", 1.0 + s / 1000, s, walltime=t)
        w.add_scalar("lr", 1e-3, s, walltime=t, new_style=True)
        if s == image_at:
            w.add_image("samples", np.zeros((3, 64, 64), dtype=np.uint8), s, walltime=t)
    w.close()
    [f] = logdir.glob(f"events.out.tfevents.*{suffix}")
    return f


def _decisions(out: dict) -> tuple:
    return out["flagged"], [(a["kind"], a["step"], a["to_step"]) for a in out["actions"]], out["records"]


def _cli(*args: str) -> tuple[int, dict | str, str]:
    r = CliRunner().invoke(backtest_cmd, [*args])
    assert "Traceback" not in r.output, r.output[-2000:]
    try:
        return r.exit_code, json.loads(r.stdout), r.stderr
    except ValueError:
        return r.exit_code, r.output, r.stderr


def test_a_tensorboard_log_gets_the_decisions_of_the_same_steps_as_json_lines(tmp_path):
    losses = _losses()
    code, want, _ = _cli(str(_jsonl(tmp_path, losses)), "--json")
    assert code == 0 and any(a[0] == "rollback" and a[2] <= 400 for a in _decisions(want)[1]) and 250 in want["flagged"]
    logdir = tmp_path / "tb" / "run7"
    f = _events(logdir, losses, image_at=100)
    for path, extra in ((logdir, []), (f, []), (f, ["--format", "tb"])):
        code, got, _ = _cli(str(path), "--json", *extra)
        assert code == 0 and _decisions(got) == _decisions(want) and got["rejected_lines"] == 0, (path, extra)
        assert got["source"] == {"format": "tb", "loss": "train/loss", "grad_norm": "train/grad_norm", "files": 1}
    r = CliRunner().invoke(backtest_cmd, [str(logdir)])
    assert "Read as TensorBoard events: loss 'train/loss', grad norm 'train/grad_norm', 1 file(s)" in " ".join(r.output.split())
    recs = load_trace(logdir)
    assert recs[9].step == 10 and abs(recs[9].loss - losses[9]) < 1e-6 and abs(recs[9].time - (WALL0 + 1.0)) < 1e-6  # float32
    assert abs(recs[9].grad_norm - 1.01) < 1e-6 and recs[0].run == "run7"
    lr = load_trace(logdir, loss_column="LR")  # a tag named by --loss-column, case-insensitively; a tensor summary
    assert len(lr) == 600 and abs(lr[0].loss - 1e-3) < 1e-9
    w = SummaryWriter(str(tmp_path / "zero"))  # proto3 writes no step field for step 0, and no value field for 0.0
    for s in range(3):
        w.add_scalar("loss", float(s), s, walltime=WALL0 + s)
    w.close()
    assert [(r.step, r.loss) for r in load_trace(tmp_path / "zero")] == [(0, 0.0), (1, 1.0), (2, 2.0)]


def test_a_resumed_run_writes_a_second_event_file_read_in_order_as_a_restart(tmp_path):
    """A requeued job's writer opens a new file in the same directory; its steps go back to the
    checkpoint it resumed from. The directory reads in the files' order and the step that goes
    back is a restart, not a loss change."""
    losses = _losses(n=600, spike=0, shift_from=10**9)
    logdir = tmp_path / "run"
    _events(logdir, losses[:500])
    _events(logdir, losses[300:], first=301)  # resumed from the checkpoint of step 300
    code, got, _ = _cli(str(logdir), "--json")
    assert code == 0 and got["restarts"] == 1 and got["actions"] == [] and got["records"] == 800


def test_damaged_event_files_keep_what_they_hold_and_count_the_damage(tmp_path):
    losses = _losses()
    f = _events(tmp_path / "a", losses)
    raw = f.read_bytes()
    frames, i = [], 0  # (start, length) of each record
    while i < len(raw):
        (length,) = struct.unpack("<Q", raw[i:i + 8])
        frames.append((i, length))
        i += 12 + length + 4
    # 1) a flipped byte in an event's data: that event is rejected and counted, the read goes on
    start, length = frames[30]
    bad = bytearray(raw)
    bad[start + 12 + length - 2] ^= 0xFF
    f.write_bytes(bytes(bad))
    code, got, err = _cli(str(f), "--json")
    assert code == 0 and got["rejected_lines"] == 1 and "fails its checksum" in err
    assert got["records"] + got["unjudged"] in (599, 600)  # the damaged event was a loss, or another tag's
    # 2) a damaged length: the rest of the file cannot be framed; what came before stays judged
    bad = bytearray(raw)
    bad[frames[900][0] + 3] ^= 0x10
    f.write_bytes(bytes(bad))
    code, got, err = _cli(str(f), "--json")
    assert code == 0 and got["rejected_lines"] == 1 and "damaged record header" in err and 290 <= got["records"] <= 301
    # 3) cut short (a copy that did not finish): the same
    f.write_bytes(raw[: frames[600][0] + 20])
    code, got, err = _cli(str(f), "--json")
    assert code == 0 and got["rejected_lines"] == 1 and "cut short" in err and 190 <= got["records"] <= 201
    # --strict: the first damage is one line, exit 2
    code, out, _ = _cli(str(f), "--strict")
    assert code == 2 and out.strip().count("\n") == 0 and out.startswith("error: ") and "cut short" in out


def test_an_event_file_without_the_loss_tag_or_a_directory_without_events_is_one_line(tmp_path):
    _events(tmp_path / "odd", _losses(n=50), tag="objective")
    code, out, _ = _cli(str(tmp_path / "odd"))
    assert code == 2 and out.strip().count("\n") == 0
    assert "no training-loss tag among 'objective', 'train/grad_norm', 'lr'; name it with --loss-column" in out
    code, got, _ = _cli(str(tmp_path / "odd"), "--loss-column", "objective", "--json")
    assert code == 0 and got["records"] == 50
    code, out, _ = _cli(str(tmp_path / "odd"), "--loss-column", "nope")
    assert code == 2 and "no tag 'nope'" in out
    code, out, _ = _cli(str(tmp_path), "--json")  # a log root: judged as its runs, this one's error in its row
    assert code == 2 and [t["trace"] for t in out["traces"]] == [str(tmp_path / "odd")] and "no training-loss tag" in out["traces"][0]["error"]
    with pytest.raises(SchemaError, match=re.escape(f"TensorBoard runs below it: {tmp_path / 'odd'}")):  # the library names them
        load_trace(str(tmp_path))
    (tmp_path / "empty").mkdir()
    code, out, _ = _cli(str(tmp_path / "empty"), "--format", "tb")
    assert code == 2 and "without TensorBoard event files" in out and out.strip().count("\n") == 0
    junk = tmp_path / "events.out.tfevents.1.host"
    junk.write_bytes(b"\x00" * 7)
    code, out, _ = _cli(str(junk))
    assert code == 2 and out.strip().count("\n") == 0 and "Traceback" not in out
    not_tb = tmp_path / "curve.jsonl"
    not_tb.write_text('{"step": 1, "loss": 3.0}\n' * 50)
    code, out, _ = _cli(str(not_tb), "--format", "tb")
    assert code == 2 and out.strip() == f"error: {not_tb}: not a TensorBoard event file (no record in it passes its checksum)"


def test_hostile_event_files_never_raise(tmp_path):
    """Random damage to a real event file (flipped bytes, cut, inserted garbage): every read ends
    in records and counted rejections, or one line (rc 2), never a traceback."""
    raw = _events(tmp_path / "src", _losses(n=200)).read_bytes()
    rng = random.Random(3)
    f = tmp_path / "fuzz" / "events.out.tfevents.5.host"
    f.parent.mkdir()
    for _ in range(60):
        b = bytearray(raw)
        for _ in range(rng.randint(1, 6)):
            op, k = rng.random(), rng.randrange(len(b))
            if op < 0.5:
                b[k] = rng.randrange(256)
            elif op < 0.75:
                b[k:k] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
            else:
                del b[k:k + rng.randint(1, 200)]
        f.write_bytes(bytes(b))
        for args in ([str(f), "--json"], [str(f), "--strict"], [str(f.parent), "--json"]):
            r = CliRunner().invoke(backtest_cmd, args)
            assert r.exit_code in (0, 2) and "Traceback" not in r.output, r.output[-2000:]
            if r.exit_code == 2:
                assert r.output.strip().count("\n") == 0 and r.output.startswith("error: ")
