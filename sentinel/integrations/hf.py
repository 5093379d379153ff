"""Guard a Hugging Face ``transformers.Trainer`` run with the sentinel: one callback, one line to train.

::

    from sentinel.integrations.hf import SentinelCallback, train

    trainer = Trainer(model=model, args=args, train_dataset=SkipAwareDataset(ds, seed=0),
                      data_collator=SampleIdCollator(), callbacks=[SentinelCallback(run_dir=args.output_dir)])
    train(trainer)                  # trainer.train(), relaunched from a checkpoint when the sentinel rolls back

What :class:`SentinelCallback` does from HF's own hooks (watch mode needs nothing else):

- per optimizer step (``on_step_end``, whatever ``logging_steps`` is): the loss, read from the model's own
  forward output by a forward hook (so a NaN is seen as a NaN: HF's ``logging_nan_inf_filter`` hides it
  from its logs), the pre-clip grad norm, the lr the step used, tokens, step time and the batch's sample
  ids (a :class:`~sentinel.integrations.torch_data.SampleIdCollator` batch carries them; the hook strips them
  before ``forward``); evals (``eval_loss`` -> val loss / PPL); every ``checkpoint-N`` HF saves is
  registered (manifest written, rollback target on the bus);
- directives: pause (held in ``on_step_end``), resume, stop (save, then ``should_training_stop``),
  checkpoint-now (``should_save``), skip-samples (the :class:`SkipAwareDataset` shares the live skip list),
  with acks (``sentinel.client.ControlLoop``);
- rollback: HF cannot restore mid-``train()``, so under :func:`train` the callback raises
  ``RelaunchRequired``: the plan is saved, training stops at the step boundary, and :func:`train` calls
  ``trainer.train(resume_from_checkpoint=output_dir/checkpoint-N)`` again (weights, optimizer, scheduler,
  RNG and data position restored; the window skipped). Without :func:`train` a rollback is acked
  ``failed`` (the sentinel pages a human instead of waiting).

Only rank 0 talks to the bus; under ``torch.distributed`` every rank gets rank 0's directives at the same
step (a broadcast), and per-rank losses and ids are gathered for the step record.
"""

from __future__ import annotations

import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from sentinel.client.checkpoints import verify_checkpoint
from sentinel.client.control import RelaunchRequired, RestoreFailed
from sentinel.client.session import EMBEDDED, RunSession, prepare
from sentinel.contract.ranges import id_list
from sentinel.integrations.torch_data import SAMPLE_ID, SkipAwareDataset

CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a collective on the default group)."""
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj: Any) -> list:
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def _find_trainer(max_depth: int = 8):
    """The ``transformers.Trainer`` calling this callback (HF passes callbacks no reference to it)."""
    from transformers import Trainer

    frame = sys._getframe(2)
    for _ in range(max_depth):
        if frame is None:
            return None
        obj = frame.f_locals.get("self")
        if isinstance(obj, Trainer):
            return obj
        frame = frame.f_back
    return None


def _find(obj: Any, cls: type, depth: int = 6):
    """``obj`` or the object it wraps (``.dataset``, ``.base_dataloader``...) that is a ``cls``."""
    for _ in range(depth):
        if obj is None or isinstance(obj, cls):
            return obj
        obj = getattr(obj, "dataset", None) or getattr(obj, "base_dataloader", None)
    return None


class SentinelCallback(TrainerCallback):
    """Watch and steer a ``transformers.Trainer`` run from ``run_dir`` (see the module docstring).

    ``run_dir``: the run directory (default: the Trainer's ``output_dir``), whose name is the run id.
    ``redis_url``: ``"embedded"`` (the run's own bus in ``RUN_DIR/bus``), a Redis URL, or None (env
    ``SENTINEL_REDIS_URL``, else embedded). ``metrics_port``: serve the ``training_*`` Prometheus metrics
    (0: a free port; None: not served). ``max_pause_s``: a pause longer than this resumes on its own.
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, redis_url: str | None = EMBEDDED, *,
                 metrics_port: int | None = None, max_pause_s: float | None = None, log=None):
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.redis_url, self.metrics_port, self.max_pause_s = redis_url, metrics_port, max_pause_s
        self._log = log
        self.session: RunSession | None = None
        self.relaunch_enabled = False  # set by train(): a rollback is a relaunch, not a failure
        self.resume_from: str | None = None  # the checkpoint this train() call resumes from (train() sets it)
        self._trainer = None
        self._hooks: list = []
        self._reset_step()
        self._save_now = False
        if self.run_dir is not None and _dist()[0] == 0:  # the bus URL and secret exist from here on
            prepare(self.run_dir, redis_url)

    # ------------------------------------------------------------------ ControlHost
    def restore_checkpoint(self, step: int) -> None:
        if not self.relaunch_enabled:
            raise RestoreFailed("a Hugging Face Trainer cannot restore a checkpoint mid-train(): train with "
                                "sentinel.integrations.hf.train(trainer) to roll back by relaunching")
        path = self._output_dir / f"{CHECKPOINT_PREFIX}-{step}"
        if not path.is_dir():
            raise RestoreFailed(f"no checkpoint directory {path}")
        raise RelaunchRequired(str(path))

    def save_checkpoint(self) -> None:
        self._save_now = True  # HF saves at the end of this step (control.should_save); on_save registers it

    # ------------------------------------------------------------------ HF hooks
    def on_init_end(self, args, state, control, **kwargs):
        trainer = _find_trainer()
        if trainer is not None and isinstance(getattr(trainer, "train_dataset", None), SkipAwareDataset):
            # HF drops batch keys its model's forward does not name (RemoveColumnsCollator): sample_id
            # must reach the collator; the forward pre-hook strips it before the model sees it
            args.remove_unused_columns = False
        return control

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self._output_dir = Path(args.output_dir)
        if self.run_dir is None:
            self.run_dir = self._output_dir
        rank, world = _dist()
        self._distributed = world > 1 and torch.distributed.is_initialized()
        if self.session is None:
            self.session = RunSession(
                self.run_dir, host=self, redis_url=self.redis_url, rank=rank, world_size=world,
                broadcast=_broadcast if self._distributed else None, metrics_port=self.metrics_port,
                model=getattr(getattr(model, "config", None), "model_type", None) or "custom", framework="hf",
                device=str(args.device.type), log=self._log)
        self._trainer = _find_trainer()
        self._install_hooks(model)
        ds = _find(train_dataloader, SkipAwareDataset)
        if ds is not None:
            ds.skip = self.session.skip  # the live list: skip-samples directives apply from the next sample
        step = int(state.global_step)
        ckpt = Path(self.resume_from).name if self.resume_from and step else None
        self._register_existing(step)
        self.session.begin(step, checkpoint=ckpt, tokens=int(state.num_input_tokens_seen or 0))
        self._reset_step()
        return control

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if optimizer is not None:
            self._lr = optimizer.param_groups[0]["lr"]  # the lr this step used (the scheduler steps after)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        s = self.session
        step = state.global_step
        seen = state.num_input_tokens_seen
        if self._distributed:  # every rank's loss, ids and tokens: a collective, now
            loss, ids, tokens = self._gathered(args)
            s.log_step(step, loss=loss[0], loss_max_rank=loss[1], rank_losses=loss[2], grad_norm=self._grad_norm,
                       lr=self._lr, tokens=int(seen) if seen else None, batch_tokens=tokens, sample_ids=ids)
        else:  # the loop's thread keeps references; the writer thread reads them (no device sync, cold caches spared)
            s.log_step_later(step, partial(_step_values, self._losses, self._ids, self._tokens, self._scaled,
                                           self._grad_norm, self._lr, seen))
        self._reset_step()  # the session times the step: from one logged step to the next
        s.poll(step)
        if s.control.paused:
            s.hold_while_paused(step, max_pause_s=self.max_pause_s)
        if s.control.relaunch_step is not None:
            control.should_training_stop = True  # the rollback target exists: no save, relaunch from it
        elif s.control.stop_requested:
            control.should_training_stop = control.should_save = True
        if self._save_now:
            control.should_save, self._save_now = True, False
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.session is not None and self.session.is_main:
            path = self._output_dir / f"{CHECKPOINT_PREFIX}-{state.global_step}"
            if path.is_dir():
                self.session.checkpoint_saved(int(state.global_step), path)
            self.session.retain_checkpoints()
        return control

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if self.session is not None and loss is not None:
            self.session.log_eval(int(state.global_step), val_loss=float(loss))
        return control

    def on_train_end(self, args, state, control, **kwargs):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        s = self.session
        if s is not None and s.control.relaunch_step is None:  # over on purpose (not a relaunch, not a crash)
            s.end(int(state.global_step), "stopped" if s.control.stop_requested else "completed")
        if not self.relaunch_enabled:  # under train() the session lives on across relaunches
            self.close()
        return control

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    # ------------------------------------------------------------------ per step
    def _reset_step(self) -> None:
        self._losses: list[torch.Tensor] = []  # this step's micro-batch losses (as the model returned them)
        self._scaled = False  # the model normalised its loss over the whole step (num_items_in_batch)
        self._ids: list = []  # the micro-batches' sample ids (tensors as they came: read off the loop's thread)
        self._tokens = 0
        self._grad_norm = None
        self._lr = None

    def _install_hooks(self, model) -> None:
        if model is None or self._hooks:
            return

        def before(module, args, kwargs):  # one pre-hook: take the ids out of the batch, count the tokens
            ids = kwargs.pop(SAMPLE_ID, None)
            if module.training:
                if ids is not None:
                    self._ids.append(ids if torch.is_tensor(ids) else [int(i) for i in ids])
                x = kwargs.get("input_ids")
                if x is not None:
                    self._tokens += x.numel()
                if not self._scaled and kwargs.get("num_items_in_batch") is not None:
                    self._scaled = True
            return args, kwargs

        def after(module, args, kwargs, output):  # the loss as the model returned it (a NaN stays a NaN)
            if module.training:
                loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
                if loss is not None:
                    self._losses.append(loss)  # detached when the record is built (_step_values)
                if self.session is not None:  # backward comes next, without the GIL: held records go out now
                    self.session.kick()

        self._hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
                       model.register_forward_hook(after, with_kwargs=True)]
        t = self._trainer
        if t is not None and callable(getattr(t, "_get_grad_norm", None)) and "_get_grad_norm" not in vars(t):
            original = t._get_grad_norm

            def grad_norm(model, grad_norm=None):  # the pre-clip norm HF computes anyway (it logs it every N steps)
                self._grad_norm = original(model, grad_norm=grad_norm)
                return self._grad_norm

            t._get_grad_norm = grad_norm

    def _gathered(self, args) -> tuple[tuple[float, float, list[float]], list[int], int]:
        """((mean loss, max rank loss, rank losses), the global batch's sample ids, its tokens) of this step,
        gathered from every rank (a collective)."""
        local = _step_values(self._losses, self._ids, self._tokens, self._scaled, None, None, None)
        loss, ids = float(local["loss"]), id_list([local["sample_ids"]])
        world = torch.distributed.get_world_size()
        if self._scaled and getattr(args, "average_tokens_across_devices", False):
            loss *= world  # normalised by the tokens of all ranks: this rank's own mean
        parts = _gather((loss, ids, self._tokens))
        losses = [p[0] for p in parts]
        return ((sum(losses) / world, max(losses), losses), [i for p in parts for i in p[1]],
                sum(p[2] for p in parts))

    def _register_existing(self, step: int) -> None:
        """Checkpoints already in ``output_dir`` up to ``step`` (an earlier launch saved them) are rollback
        targets again (a new bus client does not know them)."""
        if not self.session.is_main or not self._output_dir.is_dir():
            return
        for p in sorted(self._output_dir.glob(f"{CHECKPOINT_PREFIX}-*")):
            try:
                n = int(p.name.rsplit("-", 1)[1])
            except ValueError:
                continue
            if p.is_dir() and n <= step:
                self.session.checkpoint_saved(n, p)


def _step_values(losses: list, chunks: list, tokens: int, scaled: bool, grad_norm, lr, seen) -> dict:
    """``RunSession.log_step``'s arguments for one optimizer step of one process, from what the hooks kept (its
    micro-batches' losses and sample ids, its tokens): read on the writer thread, off the loop's time."""
    if not losses:
        loss = float("nan")
    else:  # a single micro-batch's loss as it is, else one op over them
        loss = losses[0].detach() if len(losses) == 1 else torch.stack([x.detach() for x in losses]).float().sum()
        if not scaled and len(losses) > 1:
            loss = loss / len(losses)  # per-micro-batch means: their mean
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": int(seen) if seen else None,
            "batch_tokens": tokens, "sample_ids": chunks[0] if len(chunks) == 1 else id_list(chunks)}


def find_callback(trainer) -> SentinelCallback:
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, SentinelCallback):
            return cb
    raise ValueError("the trainer has no SentinelCallback: pass callbacks=[SentinelCallback(run_dir=...)]")


def train(trainer, *, resume_from_checkpoint: str | bool | None = None, max_relaunches: int = 100, **kwargs):
    """``trainer.train(...)``, relaunched from ``checkpoint-N`` whenever the sentinel rolls the run back to N
    (and at once when ``sentinel rollback`` left a plan for a stopped run). Returns the last ``TrainOutput``."""
    cb = find_callback(trainer)
    cb.relaunch_enabled = True
    out_dir = Path(trainer.args.output_dir)
    resume = resume_from_checkpoint
    plan = _pending_plan(cb.run_dir or out_dir)
    if plan is not None:  # an offline rollback (`sentinel rollback` of a stopped run): start from its checkpoint
        resume = str(out_dir / f"{CHECKPOINT_PREFIX}-{int(plan['to_step'])}")
    try:
        for _ in range(max_relaunches + 1):
            cb.resume_from = str(resume) if isinstance(resume, (str, os.PathLike)) else None
            if cb.resume_from is not None and Path(cb.resume_from, "manifest.json").is_file():
                verify_checkpoint(cb.resume_from)  # every file against its checksum before HF loads any of it
            out = trainer.train(resume_from_checkpoint=resume, **kwargs)
            ctl = cb.session.control if cb.session else None
            if ctl is None or ctl.relaunch_step is None:
                return out
            resume = str(out_dir / f"{CHECKPOINT_PREFIX}-{ctl.relaunch_step}")
            ctl.relaunch_step, ctl.stop_requested = None, False
            trainer.control.should_training_stop = False
        raise RuntimeError(f"more than {max_relaunches} rollbacks in one run: stopping")
    finally:
        cb.relaunch_enabled = False
        cb.close()


def _pending_plan(run_dir: Path) -> dict | None:
    from sentinel.client.control import read_pending_plan
    from sentinel.protocol import PENDING_ROLLBACK

    path = Path(run_dir) / PENDING_ROLLBACK
    if not path.is_file():
        return None
    plan, bad = read_pending_plan(path)
    if bad:
        raise ValueError(bad)
    return plan
