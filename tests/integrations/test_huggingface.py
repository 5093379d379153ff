"""A real Hugging Face ``transformers.Trainer`` guarded by the real ``sentinel run`` daemon.

One module-scoped story, many assertions (tiny GPT-2, random init, byte tokens of the Python stdlib,
one torch thread, no hub):

* ``healthy``: the docs' Hugging Face snippet (docs/integrate.md), extracted and executed verbatim: the
  reference loss, and the watch mode (steps, checkpoints, timelines) with nothing but the callback.
* ``watched``: the same run with poisoned samples (a batch of them makes the step's lr x300, as a
  learning-rate blow-up would) trained with a plain ``trainer.train()``: HF cannot restore mid-train, so the
  daemon's rollback is acked ``failed`` and escalated to a page; the run ends damaged.
* ``guarded``: the same poisoned run under ``sentinel.integrations.hf.train(trainer)``: the daemon rolls
  it back to a checkpoint from before the onset, the run is relaunched from it with the window skipped,
  and it ends at the healthy run's loss.

``sentinel status`` is read while the guarded run trains (live steps); ``incidents``, ``pages`` and
``report`` (a PNG) afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.services import in_ci

if not all(importlib.util.find_spec(m) for m in ("transformers", "accelerate")):  # the 'hf' extra
    if in_ci():
        raise ImportError("transformers and accelerate are required under CI: pip install 'sentinel[hf]'")
    pytest.skip("transformers / accelerate not installed (pip install 'sentinel[hf]')", allow_module_level=True)

import torch

from sentinel.client.session import prepare, stop_bus
from sentinel.drill import DEMO_RULES as RULES  # the demo's short run: a short rollback margin

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

POISON_STEP = 150  # the step whose batch holds the poisoned samples on the first pass
BATCH = 8


def snippet(heading: str) -> str:
    """The first ```python block under ``## heading`` in docs/integrate.md."""
    text = (ROOT / "docs" / "integrate.md").read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def sentinel(*args, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sentinel", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, check=check)


class Poison:
    """The drill: ``ids`` hold garbage (token 0, never in text), and a step that trains on one of them runs at
    ``factor`` x its lr (what a loss spike does to an unclipped update), damaging the weights for good."""

    def __init__(self, ids, factor: float = 300.0):
        self.ids, self.factor, self.hits = set(ids), factor, []

    def wrap(self, dataset):
        poison = self

        class Poisoned(torch.utils.data.Dataset):
            def __len__(self):
                return len(dataset)

            def __getitem__(self, i):
                item = dataset[i]
                if i in poison.ids:
                    item = {k: torch.zeros_like(v) for k, v in item.items()}
                return item

        return Poisoned()

    def callback(self):
        from transformers import TrainerCallback

        poison = self

        class LrDrill(TrainerCallback):
            hit = False

            def on_train_begin(self, args, state, control, model=None, **kw):
                def look(module, a, kwargs):
                    x = kwargs.get("input_ids")
                    if module.training and x is not None and bool((x == 0).all(dim=1).any()):
                        LrDrill.hit = True

                self.handle = model.register_forward_pre_hook(look, with_kwargs=True)

            def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
                if LrDrill.hit:
                    poison.hits.append(state.global_step + 1)
                    for g in optimizer.param_groups:
                        g["lr"] *= poison.factor  # the scheduler sets the next step's lr afresh

            def on_step_end(self, args, state, control, **kw):
                LrDrill.hit = False

            def on_train_end(self, args, state, control, **kw):
                self.handle.remove()

        return LrDrill()


def build(run_dir: Path, ns: dict, *, poison: Poison | None = None, extra=(), max_pause_s: float = 30):
    """The docs snippet's trainer (its model, data and arguments, from its executed namespace ``ns``)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from sentinel.integrations.hf import SentinelCallback
    from sentinel.integrations.torch_data import SampleIdCollator, SkipAwareDataset

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**ns["model"].config.to_diff_dict()))
    a = ns["args"]
    args = TrainingArguments(output_dir=str(run_dir), max_steps=a.max_steps, per_device_train_batch_size=a.per_device_train_batch_size,
                             learning_rate=a.learning_rate, save_steps=a.save_steps, logging_steps=a.logging_steps,
                             report_to=[], use_cpu=True, seed=a.seed, disable_tqdm=True)
    data = ns["Windows"]()
    callbacks = [SentinelCallback(run_dir=run_dir, max_pause_s=max_pause_s), *extra]
    if poison is not None:
        data = poison.wrap(data)
        callbacks.append(poison.callback())
    return Trainer(model=model, args=args, train_dataset=SkipAwareDataset(data, seed=0), data_collator=SampleIdCollator(),
                   callbacks=callbacks)


def steps_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]


def final_loss(run_dir: Path, last: int = 50) -> float:
    """Mean loss of the last ``last`` authoritative steps."""
    by_step = {}
    for r in steps_of(run_dir):
        if r.get("kind") == "step":
            by_step[r["step"]] = r["loss"]
    top = max(by_step)
    return sum(by_step[s] for s in range(top - last + 1, top + 1)) / last


@pytest.fixture(scope="module")
def story(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf")
    old_cwd, old_threads = os.getcwd(), torch.get_num_threads()
    os.chdir(base)
    torch.set_num_threads(1)  # tiny model: one thread is the fastest, and the CPU is shared
    runs = {name: base / "runs" / name for name in ("hf-demo", "hf-watched", "hf-guarded")}
    for d in runs.values():
        prepare(d)  # the bus URL and secret exist before the run: `sentinel run` may start first
    (base / "rules.yaml").write_text(RULES)
    log = (base / "daemon.log").open("w")
    daemon = subprocess.Popen([sys.executable, "-m", "sentinel", "run", *runs.values(), "--rules", base / "rules.yaml"],
                              stdout=log, stderr=subprocess.STDOUT)
    out = {"base": base, "runs": runs, "daemon_log": base / "daemon.log"}
    try:
        ns: dict = {}
        t0 = time.monotonic()
        exec(compile(snippet("Hugging Face Transformers"), "docs/integrate.md", "exec"), ns)  # verbatim
        out["healthy_s"] = time.monotonic() - t0
        out["ns"] = ns
        from sentinel.integrations.hf import train
        from sentinel.integrations.torch_data import epoch_order

        n = len(ns["Windows"]())
        poison_ids = epoch_order(n, 0, 0, True)[(POISON_STEP - 1) * BATCH:POISON_STEP * BATCH].tolist()
        out["poison_ids"] = poison_ids

        watched = Poison(poison_ids)
        # watch mode (no relaunch helper): the failed rollback is escalated to a pause and a page; the pause
        # ends on its own after max_pause_s (a human would `sentinel resume` or stop it)
        build(runs["hf-watched"], ns, poison=watched, max_pause_s=2).train()
        out["watched_hits"] = watched.hits

        status: list = []

        from transformers import TrainerCallback

        class ReadStatus(TrainerCallback):  # the operator's view while the run trains
            def on_step_end(self, args, state, control, **kw):
                if state.global_step == 100 and not status:
                    status.append(json.loads(sentinel("status", runs["hf-guarded"], "--json").stdout))

        guarded = Poison(poison_ids)
        trainer = build(runs["hf-guarded"], ns, poison=guarded, extra=[ReadStatus()])
        train(trainer)
        out["guarded_hits"], out["status"] = guarded.hits, status
        time.sleep(2)  # the daemon reads the last records
        for name, d in runs.items():
            out[f"incidents:{name}"] = json.loads(sentinel("incidents", d, "--json").stdout)
        yield out
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
        for d in runs.values():
            with contextlib.suppress(Exception):
                stop_bus(d)
        os.chdir(old_cwd)
        torch.set_num_threads(old_threads)


def test_the_docs_snippet_trains_a_watched_run_with_nothing_but_the_callback(story):
    d = story["runs"]["hf-demo"]
    recs = steps_of(d)
    assert recs[0]["kind"] == "start" and recs[0]["timeline"] == 0
    # it ended on purpose: a watching sentinel will not page "trainer hung" when the heartbeat goes quiet
    assert (recs[-1]["kind"], recs[-1]["marker"], recs[-1]["detail"]) == ("marker", "run_end", "completed")
    steps = [r for r in recs if r["kind"] == "step"]
    args = story["ns"]["args"]
    assert [r["step"] for r in steps] == list(range(1, args.max_steps + 1))  # every step, logging_steps=50
    assert all(len(r["sample_ids"]) == BATCH and r["grad_norm"] > 0 and r["lr"] > 0 for r in steps)
    assert steps[-1]["tokens"] == args.max_steps * BATCH * 64
    assert len({i for r in steps for i in r["sample_ids"]}) == args.max_steps * BATCH  # stable, distinct ids
    ckpts = json.loads(sentinel("checkpoints", d, "--json").stdout)
    assert {c["step"] for c in ckpts["checkpoints"]} >= {25, 50, 300}
    manifest = json.loads((d / "checkpoint-25" / "manifest.json").read_text())
    assert manifest["framework"] == "hf" and "model.safetensors" in manifest["files"]


def test_hf_logs_every_step_its_own_loss_and_grad_norm_where_hf_logs_every_fiftieth(story):
    d = story["runs"]["hf-demo"]
    state = json.loads((d / "checkpoint-300" / "trainer_state.json").read_text())
    hf = {e["step"]: e for e in state["log_history"] if "grad_norm" in e}
    ours = {r["step"]: r for r in steps_of(d) if r["kind"] == "step"}
    assert set(hf) == {50, 100, 150, 200, 250, 300}
    for s, e in hf.items():
        assert ours[s]["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-4)  # the same pre-clip norm
        window = [ours[k]["loss"] for k in range(s - 49, s + 1)]
        assert sum(window) / 50 == pytest.approx(e["loss"], rel=1e-3)  # HF's 50-step mean of our per-step losses
    timed = [ours[k]["step_seconds"] for k in range(2, 301)]  # the session times a step from the one before
    assert sum(t is not None and 0 < t < 5 for t in timed) >= 290, timed


@pytest.mark.parametrize("losses, scaled, chunks, want_loss, want_ids", [
    ([], False, [], math.nan, []),  # no training forward seen: NaN, no ids
    ([2.0], False, [torch.tensor([3, 4])], 2.0, [3, 4]),  # one micro-batch: its loss and ids as they are
    ([2.0, 4.0], False, [torch.tensor([1]), [7, 8]], 3.0, [1, 7, 8]),  # per-micro-batch means: their mean
    ([1.5, 0.5], True, [[5], [6]], 2.0, [5, 6]),  # normalised over the whole step (num_items_in_batch): the sum
])
def test_a_steps_values_are_read_off_the_loops_thread_from_what_the_hooks_kept(losses, scaled, chunks, want_loss, want_ids):
    from sentinel.contract.ranges import id_list
    from sentinel.integrations.hf import _step_values

    kept = [torch.tensor(x, requires_grad=True) * 1 for x in losses]  # as a model returns them: with a graph
    v = _step_values(kept, chunks, 512, scaled, torch.tensor(0.5), 1e-3, 4096)
    loss = float(v["loss"])
    assert (math.isnan(loss) and math.isnan(want_loss)) or loss == pytest.approx(want_loss)
    assert not getattr(v["loss"], "requires_grad", False)  # detached: no graph kept alive by the record
    assert id_list([v["sample_ids"]]) == want_ids
    assert (v["batch_tokens"], v["tokens"], v["lr"], float(v["grad_norm"])) == (512, 4096, 1e-3, 0.5)


def test_a_watch_only_run_cannot_roll_back_so_the_sentinel_pages(story):
    d = story["runs"]["hf-watched"]
    assert story["watched_hits"] == [POISON_STEP]
    [view] = story["incidents:hf-watched"]["runs"]
    incs = [i for i in view["incidents"] if any(a["kind"] == "rollback" for a in i["actions"])]
    assert incs, view
    [rb] = [a for a in incs[0]["actions"] if a["kind"] == "rollback"]
    assert rb["outcome"] in ("failed", "escalated"), rb
    directives = [json.loads(x) for x in (d / "directives.jsonl").read_text().splitlines()]
    assert any(x["kind"] == "rollback" and x["status"] == "failed" for x in directives)
    pages = sentinel("pages", d, "--json")
    assert json.loads(pages.stdout)["runs"][0]["pages"], pages.stdout
    assert final_loss(d) > final_loss(story["runs"]["hf-demo"]) + 0.3  # damaged for good


def test_a_guarded_run_is_rolled_back_past_the_poison_and_ends_healthy(story):
    d, poison = story["runs"]["hf-guarded"], story["poison_ids"]
    assert story["guarded_hits"] == [POISON_STEP]  # after the relaunch the poison was never trained on again
    recs = steps_of(d)
    [mark] = [r for r in recs if r["kind"] == "rollback"]
    assert mark["from_step"] < POISON_STEP - 1 and mark["directive_id"]
    assert mark["timeline"] == 1 and recs[0]["kind"] == "start"
    skip = json.loads((d / "skiplist.json").read_text())
    assert all(any(lo <= i < hi for lo, hi in skip) for i in poison)
    after = [r for r in recs[recs.index(mark):] if r["kind"] == "step"]
    assert after[0]["step"] == mark["from_step"] + 1 and after[-1]["step"] == 300
    # the relaunch is not an end; the finished run is, once
    assert [(r["marker"], r["step"]) for r in recs if r["kind"] == "marker"] == [("run_end", 300)]
    assert not set(poison) & {i for r in after for i in r["sample_ids"]}
    [view] = story["incidents:hf-guarded"]["runs"]
    [inc] = [i for i in view["incidents"] if any(a["kind"] == "rollback" for a in i["actions"])]
    [act] = [a for a in inc["actions"] if a["kind"] == "rollback"]
    assert act["outcome"] == "acked" and act["to_step"] == mark["from_step"]
    assert inc["state"] in ("healthy", "verifying"), inc
    healthy, damaged = final_loss(story["runs"]["hf-demo"]), final_loss(story["runs"]["hf-watched"])
    # the healthy run's level (the relaunched run trains on other samples after the skipped window: its
    # loss may come out a little lower), far from where the damaged run ends
    assert final_loss(d) < healthy + 0.05 and damaged > healthy + 0.3, (final_loss(d), healthy, damaged)


def test_status_showed_live_steps_and_report_draws_the_run(story):
    [row] = story["status"][0]["runs"]
    # read at step 100: a fast loop's records reach the bus within ~0.3 s (held up to 0.25 s, then sent at once)
    assert row["step"] >= 80 and row["state"] == "live", row
    d = story["runs"]["hf-guarded"]
    out = sentinel("report", d, "--out", story["base"] / "guarded.png").stdout
    assert str(story["base"] / "guarded.png") in out and "1 rollback(s)" in out, out
    assert (story["base"] / "guarded.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_embedded_buses_stop_when_training_ends_and_the_views_read_the_files(story):
    # the daemon was connected during training: each bus was left for it, so stop them and read the files
    d = story["runs"]["hf-demo"]
    stop_bus(d)
    st = json.loads(sentinel("status", d, "--json").stdout)["runs"][0]
    assert st["step"] == 300 and st["state"] == "finished" and st["ended"]["detail"] == "completed", st


def test_the_own_loop_snippet_runs_verbatim_and_a_second_run_continues_the_timeline(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = compile(snippet("Your own loop"), "docs/integrate.md", "exec")
    for _ in range(2):  # the same script again in the same run dir: a new timeline, not a replay
        exec(code, {})
    recs = steps_of(tmp_path / "runs" / "own-loop")
    starts = [r for r in recs if r["kind"] == "start"]
    assert [r["timeline"] for r in starts] == [0, 1]
    assert [r["step"] for r in recs if r["kind"] == "step"] == list(range(1, 51)) * 2
    assert [(r["marker"], r["step"], r["timeline"]) for r in recs if r["kind"] == "marker"] == [("run_end", 50, 0), ("run_end", 50, 1)]
    ckpts = json.loads(sentinel("checkpoints", tmp_path / "runs" / "own-loop", "--json").stdout)["checkpoints"]
    assert {c["step"] for c in ckpts} == {0, 10, 20, 30, 40, 50}
    from sentinel import bus
    from sentinel.client.session import other_clients

    assert other_clients(bus.resolve_url(tmp_path / "runs" / "own-loop")) == -1  # stopped at close: nobody else attached


def test_pause_resume_checkpoint_now_and_stop_are_honoured_in_process_with_acks(tmp_path, monkeypatch, request):
    """Signed directives, as `sentinel pause/resume/checkpoint-now/stop` send them, reach a live HF run."""
    import threading

    from transformers import TrainerCallback

    from sentinel import bus
    from sentinel.protocol import Directive, Keys

    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(snippet("Hugging Face Transformers").rsplit("\ntrain(trainer)", 1)[0], "docs/integrate.md", "exec"), ns)
    run_dir = tmp_path / "runs" / "ctl"
    prepare(run_dir)
    for d in (run_dir, tmp_path / "runs" / "hf-demo"):  # this test's connection (and the snippet's own) keep them up
        request.addfinalizer(lambda d=d: stop_bus(d))  # also when an assertion fails
    r, secret = bus.connect(bus.resolve_url(run_dir)), bus.load_secret(run_dir)

    def send(kind: str) -> None:
        bus.publish(r, Keys("ctl").directives, Directive(run="ctl", kind=kind, reason="test").signed(secret))

    paused_at: list[float] = []

    applied_log = run_dir / "directives.jsonl"
    sent_at: dict[str, int] = {}

    class Operator(TrainerCallback):  # what an operator does while the run trains: each next one once the last is applied
        def on_step_end(self, args, state, control, **kw):
            done = [json.loads(x)["kind"] for x in applied_log.read_text().splitlines()] if applied_log.exists() else []
            step = state.global_step
            if step == 5:
                send("pause")
                threading.Timer(1.5, send, ("resume",)).start()
                paused_at.append(time.monotonic())
                sent_at["pause"] = step
            elif "resume" in done and "checkpoint-now" not in sent_at:
                paused_at.append(time.monotonic())
                send("checkpoint-now")
                sent_at["checkpoint-now"] = step
            elif "checkpoint-now" in done and "stop" not in sent_at:
                send("stop")
                sent_at["stop"] = step

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ns["args"].save_steps = 1000
        trainer = build(run_dir, ns, extra=[Operator()])
        trainer.eval_dataset = torch.utils.data.Subset(ns["Windows"](), range(16))  # no sample ids: plain batches
        trainer.args.eval_strategy, trainer.args.eval_steps = "steps", 8
        trainer.train()
    finally:
        torch.set_num_threads(old)
    done = [json.loads(x) for x in (run_dir / "directives.jsonl").read_text().splitlines()]
    assert [(d["kind"], d["status"]) for d in done] == [("pause", "applied"), ("resume", "applied"),
                                                        ("checkpoint-now", "applied"), ("stop", "applied")]
    assert paused_at[1] - paused_at[0] >= 1.4  # held at the step boundary until the resume came
    # the step boundary each was applied at: after it was sent, within a few of the bus client's 0.25 s reads
    # (a loaded 2-core machine stretches that to many of these ~30 ms steps)
    at = {d["kind"]: d["step"] for d in done}
    assert all(sent_at[k] < at[k] <= sent_at[k] + 40 for k in sent_at), (sent_at, at)
    assert (run_dir / f"checkpoint-{at['checkpoint-now']}").is_dir()  # saved at the step it was applied
    assert trainer.state.global_step == at["stop"]  # the stop ends training at that step boundary
    assert (run_dir / f"checkpoint-{at['stop']}").is_dir()  # and saves first
    evals = [r for r in steps_of(run_dir) if r.get("val_loss") is not None]
    eval_steps = [r["step"] for r in evals]  # every 8 steps until the stop
    assert eval_steps == list(range(8, 8 * len(eval_steps) + 1, 8)) and at["stop"] - 8 <= eval_steps[-1] <= at["stop"], (eval_steps, at)
    assert evals[0]["val_ppl"] == pytest.approx(math.exp(evals[0]["val_loss"]))
    acks = [bus.decode(e) for e in bus.read_stream(r, Keys("ctl").acks, "0-0")]
    r.close()
    assert sorted(a["kind"] if isinstance(a, dict) else a.kind for a in acks) == ["checkpoint-now", "pause", "resume", "stop"]


DDP_SCRIPT = """\
'''2 ranks (gloo, CPU) under torchrun: the docs' HF trainer with the callback; rank 0 sends itself a stop at step 20.'''
import json, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from sentinel.integrations.hf import SentinelCallback, train
from sentinel.integrations.torch_data import SampleIdCollator, SkipAwareDataset

run_dir = Path(sys.argv[1])
text = b"".join(p.read_bytes() for p in sorted(Path(json.__file__).parent.parent.glob("*.py")))[:400_000]
tokens = torch.tensor(list(text))
class Windows(torch.utils.data.Dataset):
    def __len__(self): return (len(tokens) - 1) // 64
    def __getitem__(self, i):
        x = tokens[i * 64:(i + 1) * 64]
        return {"input_ids": x, "labels": x}

class Stop(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if state.global_step == 20 and args.process_index == 0:
            from sentinel import bus
            from sentinel.protocol import Directive, Keys
            r = bus.connect(bus.resolve_url(run_dir))
            bus.publish(r, Keys(run_dir.name).directives,
                        Directive(run=run_dir.name, kind="stop", reason="ddp test").signed(bus.load_secret(run_dir)))
            time.sleep(1.0)  # the bus client (it reads every 0.1 s) has it before the poll of this step

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2))
args = TrainingArguments(output_dir=str(run_dir), max_steps=40, per_device_train_batch_size=4, learning_rate=3e-3,
                         save_steps=1000, logging_steps=1000, report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=SkipAwareDataset(Windows(), seed=0), data_collator=SampleIdCollator(),
                  callbacks=[Stop(), SentinelCallback(run_dir=run_dir)])
train(trainer)
print(f"rank {args.process_index} stopped at step {trainer.state.global_step}", flush=True)
"""


def test_ddp_two_ranks_every_rank_applies_the_stop_at_the_same_step(tmp_path):
    """torchrun, 2 CPU ranks (gloo): only rank 0 talks to the bus, the directive is broadcast, both stop at 20."""
    script = tmp_path / "ddp_hf.py"
    script.write_text(DDP_SCRIPT)
    run_dir = tmp_path / "hf-ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    from tests.helpers.services import free_port

    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(free_port()), script, run_dir], capture_output=True, text=True, timeout=400, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "rank 0 stopped at step 20" in p.stdout and "rank 1 stopped at step 20" in p.stdout, p.stdout[-2000:]
    steps = [r for r in steps_of(run_dir) if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 21))  # one record per step: rank 0's
    assert all(len(r["rank_losses"]) == 2 and r["loss_max_rank"] == max(r["rank_losses"]) and len(r["sample_ids"]) == 8
               for r in steps)  # per-rank losses and both ranks' ids gathered
    done = [json.loads(x) for x in (run_dir / "directives.jsonl").read_text().splitlines()]
    assert [(d["kind"], d["status"], d["step"]) for d in done] == [("stop", "applied", 20)]
