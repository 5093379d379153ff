"""Acceptance: the step log, resume bookkeeping, data checks, bad input, and the in-process guard.

Everything through ``python -m trainer`` subprocesses on CPU with the tiny preset.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from sentinel.protocol import MarkerRecord, StepRecord, TimelineRecord, authoritative_steps, parse_step_line
from tests.helpers.trainer import (
    BASE_ARGS,
    assert_one_line_error,
    assert_same_trajectory,
    copy_run,
    records,
    run_trainer,
    session_root,
    trajectory,
)

COMMON = ["--grad-accum", "2", "--skip", "3:40", "--skip", "20000:35000"]
REF12 = ["--max-steps", "12", "--ckpt-every", "4", *COMMON]  # shared with test_checkpoint (session cache)
REQUIRED = ("step", "loss", "loss_max_rank", "grad_norm", "lr", "tokens", "batch_fingerprint", "skipped", "time", "param_digest")
FLOATS = ("loss", "loss_max_rank", "grad_norm", "lr", "time")


# ------------------------------------------------------------------ step log
def _bits(o):
    """A structure with every float replaced by its exact hex form (so == means bitwise equal)."""
    if isinstance(o, float):
        return ("f", o.hex())
    if isinstance(o, dict):
        return {k: _bits(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_bits(v) for v in o]
    return o


def test_step_log_fields_and_exact_floats(refs):
    run = refs(*REF12)
    lines = (run / "steps.jsonl").read_text().splitlines()
    steps = [json.loads(ln) for ln in lines if json.loads(ln).get("kind") == "step"]
    assert [s["step"] for s in steps] == list(range(1, 13))
    for ln in lines:
        obj = json.loads(ln)
        if obj.get("kind") != "step":
            continue
        for f in REQUIRED:
            assert f in obj and obj[f] is not None, f"step {obj['step']}: {f} missing"
        assert obj["skipped"] is False and re.fullmatch(r"[0-9a-f]{16}", obj["param_digest"])
        # floats round-trip exactly: the text parses to the value, re-serialising with json and parsing
        # again gives the same bits, and the protocol's own parse -> serialise is byte-identical
        for f in FLOATS:
            text = re.search(rf'"{f}":([^,}}]+)', ln).group(1)
            assert float(text).hex() == float(obj[f]).hex(), f"{f}: {text}"
        again = json.loads(json.dumps(obj))
        assert _bits(again) == _bits(obj)
        assert parse_step_line(ln).to_json() == ln
        assert _bits(json.loads(parse_step_line(ln).to_json())) == _bits(obj)
        # loss / grad norm are fp32 device values carried without rounding
        for f in ("loss", "loss_max_rank", "grad_norm"):
            assert float(np.float32(obj[f])) == obj[f], f
        assert obj["loss_max_rank"] == max(obj["rank_losses"])
        assert obj["tokens"] == obj["step"] * 8 * 64  # global batch 8 (4 x accum 2) x seq 64
        assert len(obj["sample_ids"]) == 8
    assert len({s["param_digest"] for s in steps}) == 12  # the params change every step


def test_resume_appends_timeline_record_and_rerun_steps(tmp_path, dataset, refs):
    """Resume from step 4 (newer checkpoints gone): a ``resume`` TimelineRecord with from_step 4 is
    appended, steps 5..12 are appended again, and the last record of each step is authoritative."""
    ref = refs(*REF12)
    run = copy_run(ref, tmp_path / "run")
    for s in (8, 12):
        shutil.rmtree(run / "checkpoints" / f"step-{s:08d}")
    # schedule/mixture markers (MarkerRecord) are annotations, not part of the timeline: not counted here
    before = len([r for r in records(run) if not isinstance(r, MarkerRecord)])
    run_trainer(run, data_dir=dataset, check=True)
    recs = [r for r in records(run) if not isinstance(r, MarkerRecord)]
    assert len(recs) == before + 1 + 8
    old, mark, new = recs[:before], recs[before], recs[before + 1:]
    assert isinstance(mark, TimelineRecord)
    assert (mark.kind, mark.from_step, mark.timeline, mark.checkpoint) == ("resume", 4, 1, "step-00000004")
    assert [r.step for r in new] == list(range(5, 13)) and all(r.timeline == 1 for r in new)
    assert isinstance(old[0], TimelineRecord) and old[0].kind == "start" and old[0].timeline == 0
    # each run that finished said so last (a watching sentinel then expects no more steps): both launches
    ends = [(r.step, r.timeline, r.detail) for r in records(run) if getattr(r, "marker", None) == "run_end"]
    assert ends == [(12, 0, "completed"), (12, 1, "completed")] and records(run)[-1].marker == "run_end"
    auth = authoritative_steps(recs)
    assert all(auth[s] is new[s - 5] for s in range(5, 13)), "the last record of a step is authoritative"
    assert all(auth[s] is old[s] for s in range(1, 5))
    assert_same_trajectory(ref, run, 12)


# ------------------------------------------------------------------ data
@pytest.fixture(scope="session")
def other_dataset(tmp_path_factory):
    from trainer.data import prepare_dataset

    out = session_root(tmp_path_factory) / "shakespeare-val20"
    if not (out / "meta.json").is_file():
        prepare_dataset(out, val_fraction=0.2)
    return out


def test_resume_with_different_dataset_is_one_line_error(tmp_path, dataset, other_dataset, refs):
    run = copy_run(refs(*REF12), tmp_path / "run")
    config_before = (run / "config.yaml").read_text()
    log_before = (run / "steps.jsonl").read_text()
    p = run_trainer(run, "--data", str(other_dataset), data_dir=dataset)
    line = assert_one_line_error(p, rc=2)
    assert "fingerprint" in line and "step-00000012" in line, line
    # the refused start changed nothing: same config, same log, and a plain resume still works
    assert (run / "config.yaml").read_text() == config_before
    assert (run / "steps.jsonl").read_text() == log_before
    p = run_trainer(run, "--max-steps", "13", data_dir=dataset, check=True)
    assert "resumed from checkpoint step 12" in p.stdout


def test_skip_list_honoured_and_survives_resume(tmp_path, dataset):
    """Skip ranges from flags and from a pre-existing RUN_DIR/skiplist.json (as the sentinel writes it)
    are all honoured: no skipped id in any StepRecord.sample_ids, before or after a resume."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "skiplist.json").write_text(json.dumps([[50000, 65000]]))  # grown by the sentinel, not in the config
    ranges = [(3, 40), (20000, 35000), (50000, 65000)]
    run_trainer(run, *BASE_ARGS, "--data", str(dataset), *REF12, data_dir=dataset, check=True)
    assert json.loads((run / "skiplist.json").read_text()) == [list(r) for r in ranges]
    first = trajectory(run)
    recs = [r for r in records(run) if isinstance(r, StepRecord)]
    assert any(r.effective_token_ratio < 1.0 for r in recs), "the sampler never stepped over a skipped id"
    ts = json.loads((run / "checkpoints" / "step-00000008" / "train_state.json").read_text())
    assert ts["skiplist"] == [list(r) for r in ranges]
    # resume from step 4 (no skip flags: config.yaml + skiplist.json + the checkpoint carry it)
    for s in (8, 12):
        shutil.rmtree(run / "checkpoints" / f"step-{s:08d}")
    run_trainer(run, data_dir=dataset, check=True)
    assert json.loads((run / "skiplist.json").read_text()) == [list(r) for r in ranges]
    all_steps = [r for r in records(run) if isinstance(r, StepRecord)]
    assert len(all_steps) == 12 + 8
    for r in all_steps:
        bad = [i for i in r.sample_ids if any(lo <= i < hi for lo, hi in ranges)]
        assert not bad, f"step {r.step}: skipped ids {bad} were trained"
    assert trajectory(run) == first


# ------------------------------------------------------------------ bad input
def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


BAD_CONFIGS = {
    "unknown-key": ("model:\n  n_layers: 3\n", "model.n_layers: unknown key"),
    "wrong-type": ("max_steps: lots\n", "max_steps"),
    "wrong-nested-type": ("optim:\n  lr: [1, 2]\n", "optim.lr"),
    "invalid-yaml": ("model: [unclosed\n  d_model: 3\n", "invalid YAML"),
    "not-a-mapping": ("- 1\n- 2\n", "mapping"),
    "too-deep": ("[" * 50_000 + "]" * 50_000, "nested too deep"),  # was a RecursionError traceback
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_file(tmp_path, case):
    text, expect = BAD_CONFIGS[case]
    cfg = _write(tmp_path, "bad.yaml", text)
    p = run_trainer(tmp_path / "run", "--config", str(cfg), "--telemetry", "off")
    assert_one_line_error(p, contains=expect)
    assert not (tmp_path / "run" / "steps.jsonl").exists()


@pytest.mark.parametrize("args, expect", [
    (["--preset", "huge"], "huge"),
    (["--inject-fault", "boom@5"], "--inject-fault"),
    (["--inject-fault", "nan@x-y"], "--inject-fault"),
    (["--skip", "10"], "--skip"),
    (["--set", "optim.lr=-1"], "optim.lr"),
    (["--set", "nosuch.key=1"], "unknown key"),
    (["--max-steps", "ten"], "--max-steps"),
    (["--config", "/nonexistent/cfg.yaml"], "not found"),
    ([], "--run-dir"),
], ids=["unknown-preset", "fault-kind", "fault-range", "skip-syntax", "bad-value", "unknown-set", "flag-type",
        "missing-config", "no-run-dir"])
def test_bad_flags(tmp_path, args, expect):
    argv = ["--run-dir", str(tmp_path / "run"), *args] if args else []
    import subprocess

    from tests.helpers.trainer import PYTHON, REPO, trainer_env
    p = subprocess.run([PYTHON, "-m", "trainer", *argv], env=trainer_env(), cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert_one_line_error(p, contains=expect)


def test_missing_data_dir(tmp_path):
    p = run_trainer(tmp_path / "run", *BASE_ARGS, "--data", str(tmp_path / "no-such-data"))
    line = assert_one_line_error(p)
    assert "no-such-data" in line


def test_a_run_dir_saved_with_a_retired_key_still_loads(tmp_path):
    """``checkpoint.verify_whole_max_bytes`` (in every ``config.yaml`` saved on 2026-11-29 and 30) is
    dropped, not refused, whether the run's config is read or resolved for a resume; a key that never
    existed is still refused in one line."""
    from trainer.config import ConfigError, dump, load_run_config, load_yaml, resolve

    cfg = resolve(preset="tiny")
    text = dump(cfg)
    assert "\ncheckpoint:\n" in text and "verify_whole_max_bytes" not in text
    (tmp_path / "config.yaml").write_text(text.replace("\ncheckpoint:\n", "\ncheckpoint:\n  verify_whole_max_bytes: 8388608\n", 1))
    assert load_run_config(tmp_path) == cfg
    assert resolve(saved=load_yaml(tmp_path / "config.yaml")) == cfg
    (tmp_path / "config.yaml").write_text(text.replace("\ncheckpoint:\n", "\ncheckpoint:\n  verify_half_max_bytes: 1\n", 1))
    with pytest.raises(ConfigError, match="checkpoint.verify_half_max_bytes: unknown key"):
        load_run_config(tmp_path)


def test_corrupt_saved_run_config(tmp_path, dataset, refs):
    run = copy_run(refs(*REF12), tmp_path / "run")
    (run / "config.yaml").write_text("max_steps: [\n")
    assert_one_line_error(run_trainer(run, data_dir=dataset), contains="invalid YAML")


# ------------------------------------------------------------------ guard
def test_injected_nan_is_skipped_by_the_guard(tmp_path, dataset, refs):
    """--inject-fault nan@S-S on a sample S of step 3: that step is recorded skipped/nonfinite, the params
    are unchanged across it, nothing before it changes, and training continues with finite losses."""
    ref = trajectory(refs(*REF12))
    s_id = ref[3]["sample_ids"][5]  # in the second micro-batch of step 3
    assert all(s_id not in ref[s]["sample_ids"] for s in ref if s != 3)
    run = tmp_path / "run"
    p = run_trainer(run, *BASE_ARGS, "--data", str(dataset), *REF12, "--inject-fault", f"nan@{s_id}-{s_id}",
                    data_dir=dataset, check=True)
    assert "Traceback" not in p.stderr
    got = {s: r for s, r in authoritative_steps(records(run)).items()}
    assert sorted(got) == list(range(1, 13))
    r3 = got[3]
    assert r3.skipped is True and r3.skip_reason == "nonfinite"
    assert math.isnan(r3.loss) and s_id in r3.sample_ids
    assert r3.param_digest == got[2].param_digest, "the update of the skipped step was applied"
    assert r3.tokens == got[2].tokens, "a skipped step must not count its tokens"
    for s in (1, 2):
        assert repr(got[s].loss) == repr(ref[s]["loss"]) and got[s].param_digest == ref[s]["param_digest"]
    for s in range(4, 13):
        r = got[s]
        assert not r.skipped and math.isfinite(r.loss) and math.isfinite(r.grad_norm), f"step {s}: {r.loss}"
        assert r.param_digest != got[s - 1].param_digest
    # the drill is part of the run config (a resume replays it)
    assert f"lo: {s_id}" in (run / "config.yaml").read_text()
