"""The judgement of the two judged benchmarks, on tables (the benches themselves take minutes of a real
run each: ``python bench/checkpoint_cost.py --json``, ``python bench/daemon_scale.py --json``).

- ``checkpoint_cost``: each target's verdict (met, missed, out of reach by the same run's floor) and
  the proposed figures where a target is out of reach (docs/benchmarks/checkpoint-cost.md);
- ``daemon_scale``: the p99 it reads from the daemon's own histogram, between two scrapes;
- both: hostile arguments get one line and exit 2 before anything starts.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import checkpoint_cost
import daemon_scale
import torch
from failures import Failed

INF = math.inf


def fig(median: float, floor: float | None = None, **kw) -> dict:
    return {"median": median, **({"floor_ratio_median": floor} if floor is not None else {}), **kw}


@pytest.mark.parametrize(("result", "want"), [
    ({"save_vs_raw": fig(0.85, 0.95)}, {"save_vs_raw": "met"}),
    ({"save_vs_raw": fig(0.8, 0.95)}, {"save_vs_raw": "met"}),  # the bound itself meets it
    ({"save_vs_raw": fig(0.79, 0.95)}, {"save_vs_raw": "missed"}),  # the floor reached it: a saver could have
    ({"save_vs_raw": fig(0.26, 0.50)}, {"save_vs_raw": "out of reach"}),  # tiny: the commit protocol alone is at 0.5
    ({"save_vs_raw": fig(0.79)}, {"save_vs_raw": "missed"}),  # no floor arm: never excused
    ({"load_vs_raw": fig(0.62, 0.59)}, {"load_vs_raw": "out of reach"}),
    ({"load_vs_raw": fig(0.69, 0.72)}, {"load_vs_raw": "missed"}),
    ({"async_stall_vs_sync": fig(0.10)}, {"async_stall_vs_sync": "met"}),
    ({"async_stall_vs_sync": fig(0.11, 0.01)}, {"async_stall_vs_sync": "missed"}),  # an upper bound has no floor excuse
    ({"rollback_vs_resume": fig(0.6)}, {"rollback_vs_resume": "missed"}),
    ({}, {}),  # --figures: what did not run gets no verdict
    ({"save_vs_raw": fig(0.9, 0.95), "load_vs_raw": fig(0.5, 0.4), "async_stall_vs_sync": fig(0.05),
      "rollback_vs_resume": fig(0.1)},
     {"save_vs_raw": "met", "load_vs_raw": "out of reach", "async_stall_vs_sync": "met", "rollback_vs_resume": "met"}),
])
def test_each_target_is_met_missed_or_out_of_reach_by_the_same_runs_floor(result, want):
    assert checkpoint_cost.verdicts(result) == want


SMALL, LARGE = 1_500_000, 39_000_000


@pytest.mark.parametrize(("result", "want"), [
    # a checkpoint under 32 MiB: a save within 15 ms, a load within 20 ms, and the load at its floor
    ({"save_vs_raw": fig(0.26, bytes=SMALL, a_seconds_median=0.006),
      "load_vs_raw": fig(0.6, bytes=SMALL, a_seconds_median=0.003, load_vs_floor_median=0.9)},
     {"save_seconds": True, "load_seconds": True, "load_vs_floor": True}),
    ({"save_vs_raw": fig(0.26, bytes=SMALL, a_seconds_median=0.016),
      "load_vs_raw": fig(0.6, bytes=SMALL, a_seconds_median=0.021, load_vs_floor_median=0.84)},
     {"save_seconds": False, "load_seconds": False, "load_vs_floor": False}),
    # from 32 MiB: the save's target as it is, and no load-seconds figure
    ({"save_vs_raw": fig(0.79, bytes=LARGE, a_seconds_median=0.05),
      "load_vs_raw": fig(0.9, bytes=LARGE, a_seconds_median=0.05, load_vs_floor_median=0.95)},
     {"save_vs_raw": False, "load_vs_floor": True}),
    # the size is the checkpoint's, whichever figure ran; the async and rollback targets as they are
    ({"load_vs_raw": fig(0.9, bytes=LARGE, a_seconds_median=0.05), "async_stall_vs_sync": fig(0.2),
      "rollback_vs_resume": fig(0.4)},
     {"async_stall_vs_sync": False, "rollback_vs_resume": True}),
])
def test_the_proposed_figures_follow_the_checkpoints_size(result, want):
    got = checkpoint_cost.proposed(result)
    assert {k: v["met"] for k, v in got.items()} == want
    for v in got.values():  # each printed with its value and bound, for a reader to check
        assert set(v) == {"value", "target", "met"} and v["target"].split()[0] in (">=", "<=")


BEFORE = {0.005: 10.0, 0.01: 20.0, 0.05: 30.0, INF: 30.0}


@pytest.mark.parametrize(("after", "q", "want"), [
    (BEFORE, 0.99, None),  # nothing observed between the scrapes
    ({0.005: 110.0, 0.01: 120.0, 0.05: 130.0, INF: 130.0}, 0.5, 0.0025),  # 100 new, all in the first bucket
    ({0.005: 10.0, 0.01: 120.0, 0.05: 130.0, INF: 130.0}, 0.5, 0.005 + 0.005 * 0.5),  # linear in its bucket
    ({0.005: 10.0, 0.01: 20.0, 0.05: 130.0, INF: 130.0}, 0.99, 0.01 + 0.04 * 0.99),
    ({0.005: 10.0, 0.01: 20.0, 0.05: 30.0, INF: 130.0}, 0.99, 0.05),  # beyond the last finite edge: its lower edge
    ({0.005: 60.0, 0.01: 70.0, 0.05: 80.0, INF: 130.0}, 0.5, 0.005),  # exactly at an edge
])
def test_the_fleets_p99_comes_from_the_daemons_histogram_between_two_scrapes(after, q, want):
    got = daemon_scale.quantile(BEFORE, after, q)
    assert got == (None if want is None else pytest.approx(want))


A_FILE = Path(__file__)  # a path under a file: no directory can be made there


@pytest.mark.parametrize(("module", "argv", "says"), [
    (checkpoint_cost, ["--reps", "3"], "--reps must be at least 5"),
    (checkpoint_cost, ["--save-reps", "9"], "at least 10 (five quads)"),
    (checkpoint_cost, ["--load-reps", "0"], "at least 10 (five quads)"),
    (checkpoint_cost, ["--figures", "save_vs_raw,speed"], "--figures takes"),
    (checkpoint_cost, ["--figures", ","], "--figures takes"),
    (checkpoint_cost, ["--presets", "huge"], "--presets takes"),
    (checkpoint_cost, ["--ranks", "0"], "--presets takes"),
    (checkpoint_cost, ["--ranks", "two"], "--ranks: not a list of integers"),
    (checkpoint_cost, ["--reps", "five"], "invalid int value"),
    (checkpoint_cost, ["--dir", f"{A_FILE}/scratch"], f"--dir {A_FILE}/scratch: cannot write there (Not a directory)"),
    (checkpoint_cost, ["--data", "/nonexistent/data"], "data dir /nonexistent/data does not exist (run `python -m trainer.data prepare"),
    (checkpoint_cost, ["--data", "/"], "data dir / has no meta.json"),
    pytest.param(checkpoint_cost, ["--device", "cuda"], "no CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
    (daemon_scale, ["--runs", "x"], "--runs: not a list of integers"),
    (daemon_scale, ["--runs", "0"], "need --runs >= 1"),
    (daemon_scale, ["--seconds", "1"], "--seconds >= 2"),
    (daemon_scale, ["--workers", "0"], "--workers: each count must be 1 to 64"),
    (daemon_scale, ["--workers", "1,2", "--profile", "/tmp/p"], "--profile profiles one process"),
    (daemon_scale, ["--workers", "1", "--profile", f"{A_FILE}/prof"], f"--profile {A_FILE}/prof: cannot write there"),
    (daemon_scale, ["--floor-us", "-5"], "--floor-us: each amount of work"),
    (daemon_scale, ["--cpu-dips", "1:2"], "--cpu-dips: '1:2': want DUTY:MS:EVERY"),
])
def test_hostile_arguments_get_one_line_and_exit_2_before_anything_starts(module, argv, says, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    with pytest.raises(SystemExit) as e:
        module.main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"{module.__name__}.py: error: ") and says in err[-1]
    assert "Traceback" not in "\n".join(err)


@pytest.mark.parametrize(("log_text", "want"), [
    ("Traceback (most recent call last):\n  File ...\nDataError: shard x.bin has 100 bytes\n\n",
     "the measuring worker failed (1): DataError: shard x.bin has 100 bytes (log: {log})"),
    ("", "the measuring worker failed (1): (an empty log) (log: {log})"),
    (None, "the measuring worker failed (1): (no log) (log: {log})"),
    ("x" * 1000, "the measuring worker failed (1): " + "x" * 300 + " (log: {log})"),
])
def test_a_failed_process_is_said_in_one_line_with_its_last_line_and_its_log(tmp_path, log_text, want):
    log = tmp_path / "worker.log"
    if log_text is not None:
        log.write_text(log_text)
    msg = str(Failed("the measuring worker failed (1)", log))
    assert msg == want.format(log=log) and "\n" not in msg


@pytest.mark.parametrize(("prog", "exc", "where", "rc", "want"), [
    ("checkpoint_cost.py", Failed("the measuring worker failed (1)"), "tiny x1", 1,
     "checkpoint_cost.py: error: tiny x1: the measuring worker failed (1) (scratch kept: {s})"),
    ("daemon_scale.py", Failed("sentinel did not take the runs' leases"), "", 1,
     "daemon_scale.py: error: sentinel did not take the runs' leases (scratch kept: {s})"),
    ("checkpoint_cost.py", KeyboardInterrupt(), "small x2", 130, "checkpoint_cost.py: interrupted at small x2 (scratch kept: {s})"),
    ("daemon_scale.py", KeyboardInterrupt(), "", 130, "daemon_scale.py: interrupted (scratch kept: {s})"),
])
def test_a_bench_says_its_failure_in_one_line_and_keeps_its_scratch(tmp_path, capsys, prog, exc, where, rc, want):
    from failures import said

    assert said(prog, exc, tmp_path, where) == rc
    assert capsys.readouterr().err == want.format(s=tmp_path) + "\n"


@pytest.mark.parametrize(("num", "den", "want"), [
    ([1.0, 1.0], [1.0, 1.0], [1.0]),
    # an order effect: the raw arm 0.5 ms slower whenever it follows the load, the load whenever it follows the raw
    # read: per round 1.2 and 0.5, the median of rounds falls in the gap; each quad pools them to the same 0.75
    ([1.5, 1.0] * 4, [1.25, 2.0] * 4, [2.5 / 3.25] * 4),
    ([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [1.5]),  # an odd round out: the last is dropped
    ([1.0], [2.0], []),
])
def test_abba_quads_pool_two_rounds_so_that_an_order_effect_cancels(num, den, want):
    import checkpoint_arms

    assert checkpoint_arms.pooled(num, den) == pytest.approx(want)


def test_a_figure_is_the_median_of_its_quads_and_lists_its_rounds():
    import checkpoint_arms

    a, b = [1.25, 2.0] * 5, [1.5, 1.0] * 5
    fig = checkpoint_arms.summarise(a, b, [y / x for x, y in zip(a, b)], checkpoint_arms.pooled(b, a))
    assert fig["median"] == pytest.approx(2.5 / 3.25) and fig["min"] == fig["max"] == pytest.approx(2.5 / 3.25)
    assert fig["ratios"] == [1.2, 0.5] * 5 and fig["round_ratio_median"] == pytest.approx(0.85)
    assert len(fig["quad_ratios"]) == 5
    rollback = checkpoint_arms.summarise([1.0, 2.0], [4.0, 4.0], [0.25, 0.5])  # pairs only: the median of rounds
    assert rollback["median"] == pytest.approx(0.375) and "quad_ratios" not in rollback
