"""Lightning: ``SentinelCallback``, a ``lightning.pytorch.Callback`` that lets ``sentinel run`` watch and steer a fit.

Add it to ``Trainer(callbacks=[...])`` and the run dir fills like our own trainer's (``steps.jsonl``, the skip
list, the directives log, checkpoints known to the bus), so ``sentinel run / status / incidents / pages /
report / backtest RUN_DIR`` work on it::

    data = SkipAwareDataset(my_dataset)                       # sentinel.integrations.torch_data
    sentinel = SentinelCallback(run_dir="runs/tiny-gpt", dataset=data)
    trainer = L.Trainer(max_steps=2000, callbacks=[sentinel, ModelCheckpoint(every_n_train_steps=100, save_top_k=-1)])
    fit(trainer, model, DataLoader(data, batch_size=8))    # trainer.fit, relaunched from the checkpoint a rollback names

From Lightning's own hooks, per optimizer step: the loss (mean and max over ranks), the grad norm before
clipping, the learning rate, tokens, the step time and the batch's sample ids; validation losses; and every
checkpoint Lightning writes (found through the strategy's ``CheckpointIO``, so ``ModelCheckpoint``,
``trainer.save_checkpoint`` and ours alike, with their removals). Directives are applied at the step boundary
by :class:`sentinel.client.control.ControlLoop`: pause / resume / stop / checkpoint-now in-process.

Rollback: Lightning has no public way to swap the model, optimizer, schedulers, loop progress and a live
data iterator under a running ``fit`` (its data fetcher has already drawn the next batch), so a rollback is
a relaunch: the directive is acked ``relaunch from checkpoint N``, the fit stops at once (no checkpoint of
the damaged state), and :func:`fit` calls ``trainer.fit(ckpt_path=...)`` again with the checkpoint of step N.
The skip list has grown first, and the data position comes back from the checkpoint (it is in this
callback's ``state_dict``), so the new fit trains on from step N without the window.

Distributed (DDP): only rank 0 talks to the bus; the directives it reads reach every rank through
``trainer.strategy.broadcast`` at the same step, and the losses and sample ids of all ranks reach rank 0
through one ``all_gather`` per step.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import CheckpointIO

from sentinel.client.checkpoints import verify_checkpoint
from sentinel.client.control import RelaunchRequired, RestoreFailed
from sentinel.contract.fsio import clear_trash, remove_dir
from sentinel.contract.ranges import id_list
from sentinel.integrations.torch_data import epoch_order
from sentinel.protocol import checkpoint_dir_name

__all__ = ["SentinelCallback", "fit"]



def default_sample_ids(batch: Any) -> Sequence[int]:
    """The global sample ids of a batch: a ``sample_id`` (or ``sample_ids``) entry of a dict batch. A tensor is
    returned as it is: it is read when the step record is built, off the loop's thread."""
    if isinstance(batch, Mapping):
        for key in ("sample_id", "sample_ids"):
            if key in batch:
                ids = batch[key]
                return ids if torch.is_tensor(ids) else list(ids)
    return []


def default_tokens(batch: Any) -> int:
    """Tokens in a batch: ``input_ids`` of a dict batch, else the first tensor found."""
    if torch.is_tensor(batch):
        return batch.numel()
    if isinstance(batch, Mapping):
        if "input_ids" in batch and torch.is_tensor(batch["input_ids"]):
            return batch["input_ids"].numel()
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        return next((t.numel() for t in batch if torch.is_tensor(t)), 0)
    return 0


def position_after(dataset: Any, ids: Sequence[int]) -> dict:
    """``dataset.state_dict()`` as it was right after the last of ``ids`` (the batch just trained) was drawn.

    The loader draws ahead (Lightning's fetcher holds the next batch), so the dataset's own position is past
    data not trained yet; a checkpoint must resume right after what was. ``ids`` are found in the stream
    order of the dataset's epoch (or the one before, when the drawn-ahead batch crossed into a new epoch)."""
    state = dataset.state_dict()
    ids = id_list([ids])
    if not ids:
        return state
    epoch, pos, n = state["epoch"], state["pos"], len(dataset.dataset)
    for e in (epoch, epoch - 1):
        if e < 0:
            break
        order = epoch_order(n, dataset.seed, e, dataset.shuffle)[: pos if e == epoch else n]
        hit = np.flatnonzero(np.isin(order, np.asarray(ids, dtype=np.int64)))
        if hit.size:
            return {**state, "epoch": e, "pos": int(hit.max()) + 1}
    return state


def _loss_of(outputs: Any) -> torch.Tensor | None:
    if type(outputs) is dict or isinstance(outputs, Mapping):  # the exact type first: an ABC check costs more
        outputs = outputs.get("loss")
    return outputs if torch.is_tensor(outputs) else None


def _rng_state() -> dict:
    """The CPU RNG states, in types ``torch.load(weights_only=True)`` (Lightning's default) accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
            "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])


class _RegisteringIO(CheckpointIO):
    """The strategy's own CheckpointIO, plus: every file written is registered, every file removed forgotten."""

    def __init__(self, inner: CheckpointIO, owner: SentinelCallback) -> None:
        self.inner, self.owner = inner, owner

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self.owner._saved(int(checkpoint.get("global_step", 0)), Path(path))

    def load_checkpoint(self, path, map_location: Any | None = None, **kwargs: Any) -> dict[str, Any]:
        return self.inner.load_checkpoint(path, map_location=map_location, **kwargs)

    def remove_checkpoint(self, path) -> None:
        try:
            st = os.stat(path)
        except OSError:
            st = None
        self.inner.remove_checkpoint(path)
        if st is not None:
            self.owner._removed((st.st_dev, st.st_ino))

    def teardown(self) -> None:
        self.inner.teardown()


class _Host:
    """What the control loop asks of Lightning: save now, and restore (a relaunch, see the module docstring)."""

    def __init__(self, cb: SentinelCallback, trainer: Trainer) -> None:
        self.cb, self.trainer = cb, trainer

    def save_checkpoint(self) -> None:
        self.cb._save_now(self.trainer)

    def restore_checkpoint(self, step: int) -> None:
        path = self.cb._share(self.cb.checkpoint_path(step) if self.cb._is_main else None)
        if path is None:
            raise RestoreFailed(f"no Lightning checkpoint of step {step} on disk (deleted by save_top_k?)")
        self.cb.relaunch_checkpoint = path
        raise RelaunchRequired(f"relaunch from {path}")


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The 2-norm of all ``grads`` together: fused per-tensor norms (``foreach``, also on CPU, where the
    default is a Python loop of single norms: 41 against 55 us for a tiny GPT's 15 tensors)."""
    if not grads:
        return None
    try:
        return torch.nn.utils.get_total_norm(grads, foreach=True)
    except RuntimeError:  # a device without foreach kernels
        return torch.nn.utils.get_total_norm(grads)


class SentinelCallback(Callback):
    """Let ``sentinel run RUN_DIR`` watch and steer this fit (see the module docstring).

    Args:
        run_dir: the run directory; its name is the run's name. Created if missing.
        redis_url: ``None`` (``$SENTINEL_REDIS_URL``, else the run dir's embedded bus), ``"embedded"``, or a URL.
        dataset: the train loader's ``sentinel.integrations.torch_data.SkipAwareDataset``: it is given the
            run's live skip list, and its position (after the last batch trained, not the batches the loader
            drew ahead) is saved in every Lightning checkpoint.
        sample_ids: ``batch -> ids`` (default: a dict batch's ``sample_id``); tokens: ``batch -> int``. In a
            single process both run on the session's writer thread after the step (they must only read the batch).
        val_loss_key: the logged metric read after each validation (``self.log("val_loss", ...)``).
        initial_checkpoint: save the state of step 0 on a fresh start (damage before the first periodic
            checkpoint can then be rolled back, not only paged).
        metrics_port: ``None``: no /metrics; 0: a free port (file-SD targets in the run dir).
    """

    def __init__(self, run_dir: str | Path, redis_url: str | None = None, *, dataset: Any = None,
                 sample_ids: Callable[[Any], Sequence[int]] = default_sample_ids,
                 tokens: Callable[[Any], int] = default_tokens, val_loss_key: str = "val_loss",
                 initial_checkpoint: bool = True, grad_norm: bool = True, metrics_port: int | None = None,
                 model: str = "custom", log: Callable[[str], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.redis_url, self.dataset = redis_url, dataset
        self.sample_ids, self.tokens = sample_ids, tokens
        self.val_loss_key, self.initial_checkpoint, self.grad_norm = val_loss_key, initial_checkpoint, grad_norm
        self.metrics_port, self.model = metrics_port, model
        self._log = log
        self.session = None
        self.relaunch_checkpoint: str | None = None  # set by a rollback: fit() relaunches from it
        self.applied: list[tuple[int, str, str, str]] = []  # (step, kind, status, directive id), this process
        self._tokens_total = 0
        self._last_ids: Sequence[int] = []  # the sample ids of the last step trained (every rank's; maybe a tensor)
        self._step_logged: int | None = None
        self._params: list[torch.nn.Parameter] | None = None
        self._clip_captured = False  # the grad norm comes from Lightning's own norm clipping
        self._norm_here = grad_norm  # the callback computes the norm (no norm clipping to take it from)
        self._rng_to_load: dict | None = None
        self._reset_step()

    # ------------------------------------------------------------------ helpers
    @property
    def _is_main(self) -> bool:
        return self._rank == 0

    def _share(self, obj: Any) -> Any:
        return self._trainer.strategy.broadcast(obj, src=0)

    def _say(self, msg: str) -> None:
        if self._log:
            self._log(msg)
        elif self._is_main:
            print(f"[sentinel] {msg}", flush=True)

    def _reset_step(self) -> None:
        self._pend: list[tuple[Any, Any]] = []  # this step's micro-batches' (outputs, batch), read by _values
        self._gnorm = self._lr = None

    def checkpoint_path(self, step: int) -> str | None:
        """The Lightning checkpoint of ``step`` registered in this run dir (by any process of the run), if on disk."""
        d = self.run_dir / "checkpoints" / checkpoint_dir_name(step)
        found = sorted(d.glob("*.ckpt")) if d.is_dir() else []
        return str(found[0]) if found else None

    def pending_checkpoint(self) -> str | None:
        """The checkpoint a rollback plan waiting in the run dir names (a relaunch, or ``sentinel rollback`` of
        a stopped run), or None."""
        try:
            plan = json.loads((self.run_dir / "pending_rollback.json").read_text())
            return self.checkpoint_path(int(plan["to_step"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # ------------------------------------------------------------------ setup / teardown
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer, self._rank, self._world = trainer, trainer.global_rank, trainer.world_size
        strategy = trainer.strategy
        if self.grad_norm:
            self._capture_clip_norm(trainer)
        if not isinstance(strategy.checkpoint_io, _RegisteringIO):
            strategy.checkpoint_io = _RegisteringIO(strategy.checkpoint_io, self)
        if self.session is None:
            from sentinel.client.session import RunSession

            self.run_dir.mkdir(parents=True, exist_ok=True)
            if self._rank == 0 and (self.run_dir / "checkpoints").is_dir():
                clear_trash(self.run_dir / "checkpoints")  # what a kill left while a step dir was removed
            self.session = RunSession(self.run_dir, host=_Host(self, trainer), redis_url=self.redis_url,
                                      rank=self._rank, world_size=self._world,
                                      broadcast=self._share if self._world > 1 else None,
                                      metrics_port=self.metrics_port, model=self.model, framework="lightning",
                                      log=self._log)
        else:
            self.session.control.host = _Host(self, trainer)
        if self.dataset is not None:
            self.dataset.skip = self.session.skip  # the same object the control loop grows
            self.dataset.shard = (self._rank, self._world)  # each rank its share of the one stream

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._rng_to_load is not None:
            _set_rng_state(self._rng_to_load)
            self._rng_to_load = None
        step = trainer.global_step
        resumed = trainer.ckpt_path
        ctl = self.session.control  # a relaunch reuses the loop: what stopped the last fit is done
        ctl.stop_requested, ctl.relaunch_step = False, None
        if resumed is None:
            self._tokens_total = 0
        self._step_logged = None
        self._params = None
        self._norm_here = self.grad_norm and not (self._clip_captured and trainer.gradient_clip_val and
                                                  trainer.gradient_clip_algorithm in (None, "norm"))  # None: norm
        self.session.begin(step, checkpoint=Path(resumed).name if resumed and step else None, tokens=self._tokens_total)
        self._reset_step()
        if step == 0 and resumed is None and self.initial_checkpoint:
            self._save_now(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.session is None:
            return
        if self.relaunch_checkpoint is None:  # over on purpose (on_exception closed the session of a crash)
            ctl = self.session.control
            self.session.end(trainer.global_step, "stopped" if ctl.stop_requested else "completed")
            self.close()
        elif self.session.bus is not None:  # kept open for the relaunch; the rollback's ack goes out now
            self.session.bus.flush(timeout=5.0)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Flush and close the session (also stops the embedded bus when nothing else needs it)."""
        if self.session is not None:
            self.session.close()
            self.session = None

    # ------------------------------------------------------------------ per step
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        if self.session is not None:  # autograd runs without the GIL: the held step records go out meanwhile
            self.session.kick()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        # the grad norm before clipping; under DDP the grads are already averaged (the same on every rank).
        # With norm clipping on, Lightning computes it anyway (clip_grad_norm_ returns it): taken from there
        # (_capture_clip_norm), it costs nothing. Otherwise one fused norm over the grads here.
        if self._norm_here:
            self._gnorm = _total_norm(self._grads(pl_module))
        self._lr = optimizer.param_groups[0]["lr"]

    def _grads(self, module: LightningModule) -> list[torch.Tensor]:
        if self._params is None:  # walking the module tree every step costs more than the norm's bookkeeping
            self._params = [p for p in module.parameters() if p.requires_grad]
        return [p.grad for p in self._params if p.grad is not None]

    def _capture_clip_norm(self, trainer: Trainer) -> None:
        """Record the total norm that Lightning's own norm clipping computes and throws away (the precision
        plugin's ``clip_grad_by_norm``, when it is the stock one: FSDP and DeepSpeed clip their own way)."""
        from lightning.pytorch.plugins.precision import Precision

        plugin = trainer.strategy.precision_plugin
        if getattr(plugin, "_sentinel_callback", None) is not None:  # wrapped by an earlier fit: point it here
            plugin._sentinel_callback = self
            self._clip_captured = True
            return
        if type(plugin).clip_grad_by_norm is not Precision.clip_grad_by_norm:
            return

        def clip_grad_by_norm(optimizer, clip_val) -> None:
            norm = torch.nn.utils.clip_grad_norm_(plugin.main_params(optimizer), clip_val)
            plugin._sentinel_callback._gnorm = norm

        plugin.clip_grad_by_norm, plugin._sentinel_callback = clip_grad_by_norm, self
        self._clip_captured = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._pend.append((outputs, batch))  # read when the step's record is built (_values)
        step = trainer.global_step
        if step == self._step_logged:  # gradient accumulation: not an optimizer step yet
            return
        self._step_logged = step
        self._publish(step)
        self._control(trainer, step)

    def _publish(self, step: int) -> None:
        pend, gnorm, lr = self._pend, self._gnorm, self._lr
        if gnorm is None and self.grad_norm:  # clipping on, but a custom configure_gradient_clipping
            # did not call the stock clip: the grads are still this step's (Lightning zeroes them next step)
            gnorm = _total_norm(self._grads(self._trainer.lightning_module))
        self._pend, self._gnorm = [], None
        # the session times the step (from one logged step to the next)
        if self._world > 1:  # the values are gathered from every rank: a collective, now
            self.session.log_step(step, **self._values(pend, gnorm, lr))
        else:  # one process: the loop's thread only keeps the references; the writer thread reads them
            self.session.log_step_later(step, lambda: self._values(pend, gnorm, lr))

    def _values(self, pend: list[tuple[Any, Any]], gnorm, lr) -> dict[str, Any]:
        """``log_step``'s arguments for one optimizer step, from its micro-batches' ``(outputs, batch)``."""
        losses, chunks, tok = [], [], 0
        for outputs, batch in pend:
            loss = _loss_of(outputs)
            if loss is not None:
                losses.append(loss.detach())
            chunks.append(self.sample_ids(batch))
            tok += int(self.tokens(batch))
        # one micro-batch: its loss tensor as it is; more: their mean (one op, no sync)
        loss = losses[0] if len(losses) == 1 else torch.stack([x.float() for x in losses]).mean() if losses else 0.0
        ids = chunks[0] if len(chunks) == 1 else id_list(chunks)
        loss_max, rank_losses = loss, None
        if self._world > 1:
            rank_losses, ids, tok = self._gather(float(loss), id_list([ids]), tok)
            loss, loss_max = sum(rank_losses) / len(rank_losses), max(rank_losses)
        self._tokens_total += tok
        self._last_ids = ids
        return {"loss": loss, "loss_max_rank": loss_max, "rank_losses": rank_losses, "grad_norm": gnorm, "lr": lr,
                "tokens": self._tokens_total, "batch_tokens": tok, "sample_ids": ids}

    def _gather(self, loss: float, ids: list[int], tok: int) -> tuple[list[float], list[int], int]:
        """One all_gather: every rank's loss, tokens and sample ids (float64: ids are exact below 2**53)."""
        width = self._share(len(ids)) if not hasattr(self, "_width") else self._width
        self._width = max(width, len(ids))
        row = torch.full((3 + self._width,), -1.0, dtype=torch.float64)
        row[0], row[1], row[2] = loss, tok, len(ids)
        row[3:3 + len(ids)] = torch.tensor(ids, dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self._world)]
        dist.all_gather(rows, row)
        losses = [float(r[0]) for r in rows]
        all_ids = [int(i) for r in rows for i in r[3:3 + int(r[2])].tolist()]
        return losses, all_ids, int(sum(float(r[1]) for r in rows))

    def _control(self, trainer: Trainer, step: int) -> None:
        ctl = self.session.control
        done = self.session.poll(step)
        if ctl.paused:
            self._say(f"paused at step {step}")
            done += self.session.hold_while_paused(step)
        if done:
            self.applied += [(step, a.kind, a.status, a.directive_id) for a in done]
        if not ctl.stop_requested:
            return
        if ctl.relaunch_step is None:  # stop: checkpoint, then exit
            self._save_now(trainer)
        trainer.should_stop = True

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or self.session is None or not self._is_main:
            return
        val = trainer.callback_metrics.get(self.val_loss_key)
        if val is not None:
            self.session.log_eval(trainer.global_step, val_loss=float(val))

    # ------------------------------------------------------------------ checkpoints
    def _save_now(self, trainer: Trainer) -> None:
        mc = trainer.checkpoint_callback
        root = Path(mc.dirpath) if isinstance(mc, ModelCheckpoint) and mc.dirpath else self.run_dir / "lightning"
        trainer.save_checkpoint(root / f"sentinel-step={trainer.global_step}.ckpt")

    def _saved(self, step: int, path: Path) -> None:  # rank 0 only: Lightning writes on global zero
        """A .ckpt Lightning just wrote becomes ``RUN_DIR/checkpoints/step-N/`` (a hard link to the file, so a
        rollback target outlives ``save_top_k``'s pruning until Lightning removes it, and its manifest)."""
        if path.stem.startswith(ModelCheckpoint.CHECKPOINT_NAME_LAST) or self.session is None or not path.is_file():
            return  # last.ckpt is overwritten in place: a rollback target must stay what it was
        d = self.run_dir / "checkpoints" / checkpoint_dir_name(step)
        if d.is_symlink() or d.is_file():
            d.unlink()
        elif d.is_dir():  # the same step on an earlier timeline (before a rollback): replaced
            remove_dir(d)  # renamed out of the step names first: a kill midway leaves no half step
        d.mkdir(parents=True)
        try:
            os.link(path, d / path.name)
        except OSError:  # another filesystem: a copy
            shutil.copy2(path, d / path.name)
        self.session.checkpoint_saved(step, d)

    def _removed(self, file_id: tuple[int, int]) -> None:
        """Lightning deleted a checkpoint (``save_top_k``): its step dir goes too (the hard link), and the bus
        forgets it, so no rollback is sent to a checkpoint that is gone."""
        gone = False
        for ckpt in (self.run_dir / "checkpoints").glob("step-*/*.ckpt"):
            with contextlib.suppress(OSError):
                st = ckpt.stat()
                if (st.st_dev, st.st_ino) == file_id:
                    remove_dir(ckpt.parent)
                    gone = True
        if gone and self.session is not None:
            self.session.retain_checkpoints()

    # ------------------------------------------------------------------ state in every Lightning checkpoint
    def state_dict(self) -> dict[str, Any]:
        if self.session is not None:  # the held steps' values are read first: the tokens and ids trained so far
            self.session.write_held()
        state = {"rng": _rng_state(), "tokens": self._tokens_total}
        if self.dataset is not None:
            state["data"] = position_after(self.dataset, self._last_ids)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "data" in state_dict and self.dataset is not None:
            self.dataset.load_state_dict(state_dict["data"])
        self._rng_to_load = state_dict.get("rng")
        self._tokens_total = int(state_dict.get("tokens", 0))


def fit(trainer: Trainer, model: LightningModule, *args: Any, ckpt_path: str | None = None, **kwargs: Any) -> None:
    """``trainer.fit(model, ...)``, relaunched from the checkpoint each rollback names until the fit ends.

    Lightning cannot restore a checkpoint inside a running fit, so a rollback stops the fit and this calls
    ``trainer.fit(..., ckpt_path=<checkpoint of step N>)`` again (every rank alike). A rollback planned while
    the run was stopped (``sentinel rollback RUN_DIR --to-step N``) is taken at the first fit."""
    cb = next((c for c in trainer.callbacks if isinstance(c, SentinelCallback)), None)
    if cb is not None and ckpt_path is None:
        ckpt_path = cb.pending_checkpoint()
    kwargs.setdefault("weights_only", True)  # and the manifest's checksums are checked first (a rollback's target)
    while True:
        if cb is not None and ckpt_path is not None:
            verify_checkpoint(Path(ckpt_path).parent)
        trainer.fit(model, *args, ckpt_path=ckpt_path, **kwargs)
        if cb is None or cb.relaunch_checkpoint is None:
            return
        ckpt_path, cb.relaunch_checkpoint = cb.relaunch_checkpoint, None
