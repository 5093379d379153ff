"""A real ``lightning.Trainer`` guarded by ``SentinelCallback`` beside the real ``sentinel run`` daemon.

The script is the one in ``docs/integrate.md`` (## Lightning), run verbatim: a tiny GPT (random init) on the
Shakespeare tokens prepared locally. One shared story serves most assertions:

1. the healthy run: the script as ``__main__``, untouched;
2. the damaged run: the same script's ``main`` with one change to the model: the step that trains on the
   samples of step ``POISON_STEP`` (first pass) does so with the learning rate x300 (the issue's drill,
   tied to data, so skipping the data avoids it). ``sentinel run`` watches it from before the first step;
   while it trains, ``sentinel status`` shows it live. The daemon opens an incident, pages (the grad norm
   spike is a paging rule here), orders a rollback to a checkpoint from before the onset that skips the
   window; the callback stops the fit, ``fit`` relaunches it from Lightning's own checkpoint, and the run
   ends at the healthy run's loss level. ``sentinel incidents / pages / report`` then work on the run dir.

A second test runs the script under torchrun with DDP on 2 CPU ranks (gloo): rank 0 alone talks to the bus,
and a ``skip-samples`` and a ``stop`` from the CLI are applied by both ranks at the same step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import runpy
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

from tests.helpers.services import skip_or_fail

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integrate.md"
POISON_STEP = 100  # the samples of this step (first pass) are trained with the learning rate x300
SENTINEL = [sys.executable, "-m", "sentinel"]


def snippet() -> str:
    """The Python block of the docs' Lightning section, verbatim."""
    section = DOC.read_text().split("\n## Lightning\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)[0]


def cli(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([*SENTINEL, *args], capture_output=True, text=True, timeout=timeout, check=check)


def steps(run_dir: Path) -> list[dict]:
    out = []
    with contextlib.suppress(OSError):
        for line in (run_dir / "steps.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def final_loss(run_dir: Path, last: int = 20) -> float:
    """Median loss of the last ``last`` steps of the run's last timeline."""
    recs = [r for r in steps(run_dir) if r.get("kind") == "step"]
    tl = max(r["timeline"] for r in recs)
    tail = sorted([r["loss"] for r in recs if r["timeline"] == tl][-last:])
    return tail[len(tail) // 2]


def rules_file(path: Path) -> Path:
    """The built-in rules, with a margin that fits a 200-step run and the grad norm spike paging a human."""
    import sentinel

    rules = yaml.safe_load((Path(sentinel.__file__).parent / "default_rules.yaml").read_text())
    rules["policy"]["rollback_margin_steps"] = 40
    rules["rules"]["grad_norm_spike"]["action"] = "page"
    path.write_text(yaml.safe_dump(rules))
    return path


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A working dir holding the docs' script and prepared data; the tests run from it."""
    try:
        import lightning  # noqa: F401
    except ImportError:
        skip_or_fail("lightning is not installed (pip install 'sentinel-train[lightning]')")
    from trainer.data import ensure_prepared

    wd = tmp_path_factory.mktemp("lightning")
    data = ensure_prepared(wd / "data")
    (wd / "tiny_gpt.py").write_text(snippet())
    saved = {k: os.environ.get(k) for k in ("SENTINEL_DATA_DIR",)}
    os.environ["SENTINEL_DATA_DIR"] = str(data)
    cwd = os.getcwd()
    os.chdir(wd)
    try:
        yield wd
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Daemon:
    """``sentinel run RUN_DIR`` beside the training, its output kept for failure messages."""

    def __init__(self, run_dir: Path, *extra: str):
        self.proc = subprocess.Popen([*SENTINEL, "run", str(run_dir), "--metrics-port", "0", *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.out = ""

    def stop(self) -> str:
        self.proc.terminate()
        try:
            self.out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.out, _ = self.proc.communicate()
        return self.out


def watch_status(run_dir: Path, at_step: int, found: dict) -> threading.Thread:
    """From another thread, once the run is past ``at_step``: ``sentinel status RUN_DIR --json``, as an operator."""

    def probe():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if any(r.get("step", 0) >= at_step for r in steps(run_dir)[-5:]):
                p = cli("status", str(run_dir), "--json", check=False)
                with contextlib.suppress(ValueError):
                    found.update(json.loads(p.stdout)["runs"][0])
                return
            time.sleep(0.2)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def story(workdir):
    """The healthy run (the script as written) and the damaged run rolled back by the daemon."""
    import torch

    from sentinel.client.session import prepare, stop_bus

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: one thread per process steps fastest
    try:
        runpy.run_path("tiny_gpt.py", run_name="__main__")  # verbatim: runs/tiny-gpt
        ns = runpy.run_path("tiny_gpt.py", run_name="tiny_gpt")

        class Drilled(ns["TinyGPT"]):
            """The step that trains on the samples of step POISON_STEP (first pass) runs with the lr x300."""

            poison: ClassVar[set[int] | None] = None  # class-wide: the relaunched fit reuses the module
            hits: ClassVar[list[int]] = []

            def on_train_batch_start(self, batch, batch_idx):
                ids = set(batch["sample_id"].tolist())
                if self.poison is None and self.global_step == POISON_STEP - 1:
                    type(self).poison = ids
                self._hit = bool(self.poison and ids & self.poison)

            def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
                scale = 300.0 if self._hit else 1.0
                for g in optimizer.param_groups:
                    g["lr"] *= scale
                super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
                for g in optimizer.param_groups:
                    g["lr"] /= scale
                if self._hit:
                    type(self).hits.append(self.global_step + 1)  # the step this update completes

        run_dir = Path("runs/damaged")
        prepare(run_dir)  # the embedded bus exists before the daemon attaches
        daemon = Daemon(run_dir, "--rules", str(rules_file(workdir / "rules.yaml")))
        live: dict = {}
        probe = watch_status(run_dir, 40, live)
        try:
            trainer = ns["main"](run_dir=str(run_dir), module=Drilled)
            probe.join(60)
            cb = next(c for c in trainer.callbacks if type(c).__name__ == "SentinelCallback")
            incidents = json.loads(cli("incidents", str(run_dir), "--json").stdout)
            pages = json.loads(cli("pages", str(run_dir), "--json").stdout)
        finally:
            out = daemon.stop()
            stop_bus(run_dir)
        report = cli("report", str(run_dir), "--json", check=False)
    finally:
        torch.set_num_threads(threads)
    return {"healthy": Path("runs/tiny-gpt"), "damaged": run_dir, "daemon_out": out, "live": live,
            "incidents": incidents, "pages": pages, "report": report, "applied": cb.applied, "hits": Drilled.hits,
            "poison": Drilled.poison}


@pytest.mark.parametrize("clip", [None, "norm", "default", "value"])
def test_the_grad_norm_is_the_pre_clip_norm_and_norm_clipping_gives_it_for_free(workdir, clip, monkeypatch):
    """The step record's grad norm is the norm before clipping, whatever the clipping: with norm clipping it is
    the one Lightning's own ``clip_grad_norm_`` returns (no second norm computed), otherwise the callback's."""
    import lightning as L
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader

    from sentinel.integrations import lightning as integration
    from sentinel.integrations.lightning import SentinelCallback
    from sentinel.integrations.torch_data import SkipAwareDataset
    from trainer.data import ensure_prepared

    ns = runpy.run_path(str(workdir / "tiny_gpt.py"))
    seen: dict[int, float] = {}
    norms = []  # the callback's own norm computations
    monkeypatch.setattr(integration, "_total_norm", lambda grads, f=integration._total_norm: norms.append(1) or f(grads))

    class Reference(Callback):  # runs before the sentinel's hook, before Lightning clips
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            import torch

            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            seen[trainer.global_step + 1] = float(torch.nn.utils.get_total_norm(grads))

    run_dir = workdir / "runs" / f"clip-{clip}"
    data = SkipAwareDataset(ns["Windows"](ensure_prepared()), seed=0)
    cb = SentinelCallback(run_dir=run_dir, dataset=data, initial_checkpoint=False, log=lambda m: None)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", callbacks=[Reference(), cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=clip and 1e-4,
                        gradient_clip_algorithm=None if clip == "default" else clip)  # default: Lightning's, norm
    trainer.fit(ns["TinyGPT"](data.dataset.tokens.vocab_size), DataLoader(data, batch_size=8))
    got = {r["step"]: r["grad_norm"] for r in steps(run_dir) if r.get("kind") == "step"}
    assert sorted(got) == [1, 2, 3, 4] and all(v > 1e-3 for v in seen.values())  # far above the clip: it clipped
    assert got == pytest.approx(seen, rel=1e-5)
    assert len(norms) == (0 if clip in ("norm", "default") else 4)  # with norm clipping, Lightning's own norm: none computed


def test_the_docs_script_trains_and_leaves_a_run_dir_the_sentinel_reads(story):
    healthy = story["healthy"]
    recs = steps(healthy)
    assert [r["kind"] for r in recs if r.get("kind") != "step"] == ["start", "marker"]
    assert (recs[-1]["marker"], recs[-1]["step"], recs[-1]["detail"]) == ("run_end", 200, "completed")
    done = [r for r in recs if r.get("kind") == "step"]
    assert [r["step"] for r in done if r.get("val_loss") is None] == list(range(1, 201))
    last = done[-1]
    assert last["grad_norm"] > 0 and last["lr"] == pytest.approx(3e-3) and last["tokens"] == 200 * 8 * 64
    assert len(last["sample_ids"]) == 8 and last["step_seconds"] > 0
    evals = [r for r in recs if r.get("val_loss") is not None]
    assert [r["step"] for r in evals] == [50, 100, 150, 200] and all(r["val_ppl"] > 1 for r in evals)
    linked = sorted(p.name for p in (healthy / "checkpoints").iterdir())
    assert linked == [f"step-{s:08d}" for s in range(0, 201, 25)]  # step 0 (ours) and every ModelCheckpoint file
    assert all(len(list((healthy / "checkpoints" / n).glob("*.ckpt"))) == 1 for n in linked)


def test_sentinel_status_shows_the_run_live_while_it_trains(story):
    live = story["live"]
    assert live, f"status never answered: {story['daemon_out'][-2000:]}"
    assert live["state"] == "live" and live["step"] >= 40 and live["loss"] > 0, live


def test_the_damaged_run_is_rolled_back_past_the_window_and_ends_healthy(story):
    applied, out = story["applied"], story["daemon_out"]
    rollbacks = [a for a in applied if a[1] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0][2] == "applied", (applied, out[-3000:])
    assert story["hits"] == [POISON_STEP], story["hits"]  # the drilled samples were never trained on again
    recs = steps(story["damaged"])
    [marker] = [r for r in recs if r.get("kind") == "rollback"]
    assert marker["from_step"] < POISON_STEP and marker["timeline"] == 1
    assert all(any(lo <= i < hi for lo, hi in marker["skip_ranges"]) for i in story["poison"])
    after = [r for r in recs if r.get("kind") == "step" and r["timeline"] == 1]
    assert after[0]["step"] == marker["from_step"] + 1 and after[-1]["step"] == 200
    assert [(r["marker"], r["step"]) for r in recs if r.get("kind") == "marker"] == [("run_end", 200)]  # the relaunch is no end
    before = [r["loss"] for r in recs if r.get("kind") == "step" and r["timeline"] == 0 and r["step"] > POISON_STEP]
    healthy, damaged = final_loss(story["healthy"]), final_loss(story["damaged"])
    assert max(before) > 1.5 * healthy  # the drill did real damage ...
    assert damaged <= healthy * 1.05, (damaged, healthy)  # ... and the rolled-back run ends at the healthy level


def test_incidents_pages_and_report_work_on_the_lightning_run_dir(story):
    [view] = story["incidents"]["runs"]
    [inc] = [i for i in view["incidents"] if any(a["kind"] == "rollback" for a in i["actions"])]
    assert POISON_STEP < inc["onset_step"] <= POISON_STEP + 5, inc
    [act] = [a for a in inc["actions"] if a["kind"] == "rollback"]
    assert act["outcome"] == "acked" and act["to_step"] < POISON_STEP
    assert inc["state"] == "healthy", inc  # verified: the loss came back after the rollback
    [pview] = story["pages"]["runs"]
    assert any(p["rule"] == "grad_norm_spike" for p in pview["pages"]), pview
    rep = story["report"]
    assert rep.returncode == 0, rep.stderr
    png = Path(json.loads(rep.stdout)["path"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


DRIVER = """
import json, runpy, sys
ns = runpy.run_path("tiny_gpt.py", run_name="tiny_gpt")
trainer = ns["main"](run_dir=sys.argv[1], max_steps=int(sys.argv[2]), devices=2)
[cb] = [c for c in trainer.callbacks if type(c).__name__ == "SentinelCallback"]
with open(f"{sys.argv[1]}/applied-rank{trainer.global_rank}.json", "w") as f:
    json.dump({"applied": cb.applied, "step": trainer.global_step}, f)
"""


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("step", 0) >= step and r.get("kind") == "step" for r in steps(run_dir)[-3:]):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    proc.kill()
    pytest.fail(f"no step {step} in {run_dir}: {proc.communicate()[0][-3000:]}")


def checkpoint_now(run_dir: Path) -> dict:
    """A signed ``checkpoint-now`` directive (the daemon's action; no CLI command sends one), its ack awaited."""
    from sentinel.cli.common import send_and_wait
    from sentinel.protocol import Directive
    from sentinel.runref import resolve

    ref = resolve(str(run_dir), None, need_bus=True)
    secret = ref.secret(None)
    now = time.time()
    d = Directive(run=ref.run, kind="checkpoint-now", reason="test", issuer="test", issued_at=now,
                  expires_at=now + 120).signed(secret)
    ack = send_and_wait(ref, d, 120, console=None, as_json=True, doing="checkpoint", secret=secret)
    return {"status": ack.status if ack else "timeout", "step": ack.step if ack else None}


def test_ddp_two_ranks_apply_each_directive_at_the_same_step(workdir):
    """torchrun, 2 CPU ranks (gloo): rank 0 alone talks to the bus; pause, resume, checkpoint-now,
    skip-samples and stop, sent while it trains, are applied by both ranks at the same step."""
    run_dir = Path("runs/ddp")
    (workdir / "driver.py").write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "driver.py", str(run_dir), "3000"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_step(run_dir, 10, proc)
        status = json.loads(cli("status", str(run_dir), "--json").stdout)["runs"][0]
        cli("pause", str(run_dir), "--json", "--timeout", "120")
        paused = json.loads(cli("status", str(run_dir), "--json").stdout)["runs"][0]
        # the ids the two ranks train from 2 steps after the pause (16 a step; Lightning has fetched the next
        # batch already): the skip, applied while paused, must keep them out, however slow this machine is
        from sentinel.integrations.torch_data import epoch_order
        from trainer.data import TokenDataset

        n = TokenDataset.open(os.environ["SENTINEL_DATA_DIR"]).num_samples(64)
        first = 16 * (paused["step"] + 2)
        ahead = [int(i) for i in epoch_order(n, 0, 0, True)[first:first + 160]]
        skip = json.loads(cli("skip-list", str(run_dir), "add", *[f"{i}:{i + 1}" for i in ahead], "--json",
                              "--timeout", "120").stdout)
        cli("resume", str(run_dir), "--json", "--timeout", "120")
        ckpt = checkpoint_now(run_dir)
        wait_for_step(run_dir, paused["step"] + 15, proc)
        stop = json.loads(cli("stop", str(run_dir), "--json", "--timeout", "120").stdout)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert status["state"] == "live" and status["step"] >= 10, status
    assert paused["state"] == "paused", paused
    assert ckpt["status"] == "applied" and stop["status"] == "applied" and skip["directive_id"], (ckpt, skip, stop)
    ranks = [json.loads((run_dir / f"applied-rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1], ranks  # the same directives, at the same steps, on both ranks
    applied = ranks[0]["applied"]
    kinds = [a[1] for a in applied]
    assert kinds == ["pause", "skip-samples", "resume", "checkpoint-now", "stop"], applied
    assert all(a[2] == "applied" for a in applied)
    at = {kind: step for step, kind, _, _ in applied}
    assert at["pause"] == at["skip-samples"] == at["resume"] == paused["step"], (applied, paused)  # all while paused
    assert ranks[0]["step"] == at["stop"]  # the stop was the last step both ranks took
    recs = [r for r in steps(run_dir) if r.get("kind") == "step"]
    assert recs[-1]["step"] == at["stop"] and all(len(r["sample_ids"]) == 16 for r in recs)  # 8 per rank
    assert all(len(set(r["sample_ids"])) == 16 for r in recs)  # the ranks train on different samples
    after = [i for r in recs if r["step"] > at["skip-samples"] for i in r["sample_ids"]]
    assert not set(after) & set(ahead)  # the stream stepped over them: skip-samples works mid-epoch
    for kind in ("checkpoint-now", "stop"):  # each saved a checkpoint, registered in the run dir
        assert (run_dir / "checkpoints" / f"step-{at[kind]:08d}").is_dir(), kind


def test_pruned_checkpoints_leave_the_run_dir_and_sentinel_rollback_of_a_stopped_run_is_taken_by_fit(workdir):
    """``save_top_k`` deletes old .ckpt files: their step dirs go too, and a rollback to one is acked failed
    (a one-line reason), never a relaunch from nothing. Once the fit is over, ``sentinel checkpoints`` verifies
    the rest and ``sentinel rollback RUN_DIR --to-step 15 --skip ...`` plans a rollback that the next ``fit``
    takes: it resumes from Lightning's checkpoint of step 15 without the skipped samples."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from sentinel.integrations.lightning import SentinelCallback, fit
    from sentinel.integrations.torch_data import SkipAwareDataset
    from sentinel.protocol import Directive

    ns = runpy.run_path("tiny_gpt.py", run_name="tiny_gpt")
    from trainer.data import ensure_prepared

    windows = ns["Windows"](ensure_prepared())
    data = SkipAwareDataset(windows, seed=0)
    run_dir = Path("runs/pruned")
    cb = SentinelCallback(run_dir=run_dir, dataset=data, log=lambda m: None)
    keep = ModelCheckpoint(dirpath=run_dir / "lightning", every_n_train_steps=5, save_top_k=2, monitor="step", mode="max")

    class Probe(L.Callback):  # at step 20: the host is asked to restore a checkpoint that save_top_k deleted
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 20:
                self.failed = cb.session.control.apply(Directive(run=cb.session.run, kind="rollback", to_step=5,
                                                                 reason="test"), 20)

    probe = Probe()
    # what a kill leaves while a step dir is removed (renamed out of the step names first): cleared at setup
    (run_dir / "checkpoints" / ".trash-step-00000003-1").mkdir(parents=True)
    (run_dir / "checkpoints" / ".trash-step-00000003-1" / "x.ckpt").write_bytes(b"half")
    trainer = L.Trainer(max_steps=20, accelerator="cpu", devices=1, callbacks=[cb, keep, probe], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(ns["TinyGPT"](windows.tokens.vocab_size), DataLoader(data, batch_size=8))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000000", "step-00000015",
                                                                           "step-00000020"]  # no trash either
    assert probe.failed.status == "failed" and "no Lightning checkpoint of step 5" in probe.failed.detail
    assert cb.relaunch_checkpoint is None and not (run_dir / "pending_rollback.json").exists()
    listed = json.loads(cli("checkpoints", str(run_dir), "--json").stdout)
    rows = listed["runs"][0]["checkpoints"] if "runs" in listed else listed["checkpoints"]
    assert sorted(c["step"] for c in rows if c["verified"] == "checksum_ok") == [0, 15, 20], listed
    # the ids steps 16-20 trained on: skipped from now on, so the resumed fit must draw others
    trained = [i for r in steps(run_dir) if r.get("kind") == "step" and r["step"] > 15 for i in r["sample_ids"]]
    cli("rollback", str(run_dir), "--to-step", "15", "-y", *[f"--skip={i}:{i + 1}" for i in trained])
    data2 = SkipAwareDataset(windows, seed=0)
    cb2 = SentinelCallback(run_dir=run_dir, dataset=data2, log=lambda m: None)
    again = L.Trainer(max_steps=25, accelerator="cpu", devices=1, callbacks=[cb2], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    fit(again, ns["TinyGPT"](windows.tokens.vocab_size), DataLoader(data2, batch_size=8))
    recs = steps(run_dir)
    [marker] = [r for r in recs if r.get("kind") == "rollback"]
    assert marker["from_step"] == 15 and marker["timeline"] == 1 and marker["directive_id"]
    resumed = [r for r in recs if r.get("kind") == "step" and r["timeline"] == 1]
    assert [r["step"] for r in resumed] == list(range(16, 26))
    assert not {i for r in resumed for i in r["sample_ids"]} & set(trained)
    assert not (run_dir / "pending_rollback.json").exists()
