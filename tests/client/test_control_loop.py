"""sentinel.client.ControlLoop, the one directive state machine, on its own (no bus, no torch).

Its run against the real daemon is tests/client/test_own_loop.py; our trainer's, tests/e2e/test_sentinel_e2e.py.
Here: what each directive does to the host and to the run dir, once per id, and the relaunch path a
framework that cannot restore mid-run takes (pending_rollback.json, consumed by the next begin)."""

from __future__ import annotations

import json

import pytest

from sentinel.client import ControlLoop, DataError, Directive, RelaunchRequired, RestoreFailed, StepLog

RUN = "loop-run"


class Host:
    def __init__(self, mode: str = "ok"):
        self.mode, self.restored, self.saved = mode, [], 0

    def restore_checkpoint(self, step: int) -> None:
        if self.mode == "fail":
            raise RestoreFailed(f"no checkpoint of step {step}")
        if self.mode == "relaunch":
            raise RelaunchRequired
        self.restored.append(step)

    def save_checkpoint(self) -> None:
        self.saved += 1


def _loop(tmp_path, host=None) -> ControlLoop:
    return ControlLoop(tmp_path, RUN, host=host or Host(), steplog=StepLog(tmp_path / "steps.jsonl"), log=lambda m: None)


def _d(kind: str, **kw) -> Directive:
    return Directive(run=RUN, kind=kind, issuer="test", **kw)


def _records(tmp_path) -> list[dict]:
    return [json.loads(ln) for ln in (tmp_path / "steps.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("kind", "kw", "status", "effect"), [
    ("skip-samples", {"ranges": [(10, 20)]}, "applied", lambda lp, h: lp.skip.ranges == [(10, 20)]),
    ("rollback", {"to_step": 5, "ranges": [(10, 20)]}, "applied",
     lambda lp, h: h.restored == [5] and lp.timeline == 1 and lp.skip.ranges == [(10, 20)]),
    ("rollback", {"ranges": [(1, 2)]}, "failed", lambda lp, h: h.restored == []),  # no to_step
    ("rollback", {"to_step": 5, "ranges": [(1, 2**63 + 5)]}, "failed", lambda lp, h: lp.skip.ranges == []),  # past int64
    ("pause", {}, "applied", lambda lp, h: lp.paused and not lp.stop_requested),
    ("stop", {}, "applied", lambda lp, h: lp.stop_requested),
    ("checkpoint-now", {}, "applied", lambda lp, h: h.saved == 1),
])
def test_each_directive_does_what_it_says_once(tmp_path, kind, kw, status, effect):
    host = Host()
    loop = _loop(tmp_path, host)
    loop.begin(0)
    d = _d(kind, **kw)
    [got] = [loop.apply(d, 7)]
    assert got.status == status and effect(loop, host), (got, loop)
    again = loop.apply(d, 7)
    assert again.status == "duplicate" and effect(loop, host)  # a re-read directive changes nothing
    logged = [json.loads(ln) for ln in (tmp_path / "directives.jsonl").read_text().splitlines()]
    assert [(e["id"], e["status"]) for e in logged] == [(d.id, status)]
    assert _loop(tmp_path).applied == {d.id}  # a restarted loop still knows it


def test_a_rollback_writes_the_marker_and_persists_the_skip_list_first(tmp_path):
    loop = _loop(tmp_path)
    loop.begin(0)
    got = loop.apply(_d("rollback", to_step=40, ranges=[(100, 108)], reason="spike"), 57)
    assert got.to_step == 40 and got.detail == "resumed at step 40, timeline 1"
    assert json.loads((tmp_path / "skiplist.json").read_text()) == [[100, 108]]
    start, rb = _records(tmp_path)
    assert (start["kind"], start["timeline"]) == ("start", 0)
    assert (rb["kind"], rb["from_step"], rb["timeline"], rb["directive_id"]) == ("rollback", 40, 1, got.directive_id)
    assert rb["skip_ranges"] == [[100, 108]]


def test_a_failed_restore_is_acked_failed_and_keeps_the_timeline(tmp_path):
    loop = _loop(tmp_path, Host("fail"))
    loop.begin(0)
    got = loop.apply(_d("rollback", to_step=40, ranges=[(1, 2)]), 57)
    assert (got.status, got.detail, loop.timeline) == ("failed", "no checkpoint of step 40", 0)
    assert loop.skip.ranges == [(1, 2)]  # the data stays skipped: it was blamed either way


def test_a_relaunch_rollback_becomes_a_plan_the_next_launch_consumes(tmp_path):
    loop = _loop(tmp_path, Host("relaunch"))
    loop.begin(0)
    got = loop.apply(_d("rollback", to_step=40, ranges=[(100, 108)], reason="spike"), 57)
    assert (got.status, got.detail) == ("applied", "relaunch from checkpoint 40")
    assert loop.stop_requested and loop.relaunch_step == 40
    plan = json.loads((tmp_path / "pending_rollback.json").read_text())
    assert (plan["id"], plan["to_step"], plan["ranges"]) == (got.directive_id, 40, [[100, 108]])
    relaunched = _loop(tmp_path)  # the framework resumed from checkpoint 40
    relaunched.begin(40, checkpoint="checkpoint-40")
    assert not (tmp_path / "pending_rollback.json").exists()
    assert relaunched.timeline == 1 and relaunched.skip.ranges == [(100, 108)]
    marker = _records(tmp_path)[-1]
    assert (marker["kind"], marker["from_step"], marker["directive_id"]) == ("rollback", 40, got.directive_id)


def test_a_start_and_a_resume_each_get_a_new_timeline(tmp_path):
    _loop(tmp_path).begin(0)
    _loop(tmp_path).begin(30, checkpoint="step-00000030")
    assert [(r["kind"], r["from_step"], r["timeline"]) for r in _records(tmp_path)] == [("start", 0, 0), ("resume", 30, 1)]


@pytest.mark.parametrize("content", ["{", '{"to_step": -1}', '{"id": "x", "to_step": 5, "ranges": [[9, 3]]}'])
def test_a_malformed_plan_is_refused_in_one_line(tmp_path, content):
    (tmp_path / "pending_rollback.json").write_text(content)
    with pytest.raises(DataError) as e:
        _loop(tmp_path).begin(0)
    assert "pending_rollback.json" in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "pending_rollback.json").read_text() == content  # left for the operator


def test_hold_while_paused_returns_when_a_stop_arrives(tmp_path):
    loop = _loop(tmp_path)
    loop.begin(0)
    loop.apply(_d("pause"), 3)
    calls = iter([False, True])
    assert loop.hold_while_paused(3, interval_s=0.001, give_up=lambda: next(calls)) == []
    assert loop.paused  # gave up (a signal), still paused: the host checkpoints and exits


def test_a_rollback_with_skip_after_skips_what_the_abandoned_branch_trained_past_it(tmp_path):
    """The sentinel names the detection step: the samples this loop trained after it, on the branch it
    abandons, go on the skip list with the rollback (no follow-up directive has to reach the loop)."""
    from sentinel.client import StepRecord

    loop = _loop(tmp_path)
    loop.begin(0)
    for step in range(1, 13):  # 4 ids a step: step s trained ids 4(s-1) .. 4s-1
        ids = list(range(4 * (step - 1), 4 * step))
        loop.steplog.write(StepRecord(run=RUN, step=step, timeline=0, loss=3.0, loss_max_rank=3.0, grad_norm=1.0, lr=1e-3,
                                      tokens=step, batch_fingerprint="0" * 16, sample_ids=ids, time=1.0))
    got = loop.apply(_d("rollback", to_step=5, ranges=[(20, 24)], skip_after=9), 12)
    assert got.status == "applied"
    assert loop.skip.ranges == [(20, 24), (36, 48)]  # the window, and steps 10-12's ids (36..47)
    d = _d("rollback", to_step=5, ranges=[(1, 2)])
    assert d.skip_after is None and "skip_after" not in d.canonical().decode()  # signed as before the field


def test_end_writes_a_run_end_marker_that_the_readers_take(tmp_path):
    """``end`` says the run is over on purpose (a crash never calls it): a ``run_end`` marker after the last
    step, parsed by the same reader the sentinel and the offline tools use; the next ``begin`` opens a new
    timeline, so a relaunch in the same run dir is live again."""
    from sentinel.protocol import MarkerRecord, parse_step_line

    loop = _loop(tmp_path)
    loop.begin(0)
    loop.end(12, "completed")
    last = (tmp_path / "steps.jsonl").read_text().splitlines()[-1]
    rec = parse_step_line(last)
    assert isinstance(rec, MarkerRecord) and (rec.marker, rec.step, rec.detail, rec.timeline) == ("run_end", 12, "completed", 0)
    loop2 = _loop(tmp_path)
    loop2.begin(12, checkpoint="step-12")
    assert loop2.timeline == 1 and _records(tmp_path)[-1]["kind"] == "resume"
