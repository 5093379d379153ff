"""An offline trainer session for the replay tools: the run's trainer built without side effects,
a checkpoint restored, one step run, results gathered over ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from sentinel.offline import OfflineError

# ------------------------------------------------------------------------------------ session


def local_env(device_pref: str = "auto"):
    """A single-process DistEnv (no process group), whatever WORLD_SIZE says."""
    from trainer.dist import DistEnv

    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise OfflineError("the run was configured for CUDA but no GPU is available here")
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    return DistEnv(rank=0, local_rank=0, world_size=1, device=device)


def build_trainer(run_dir: Path, env=None, *, warn=None):
    """The run's model/optimizer/data/guard, built offline (no side effects on the run dir).
    Deterministic algorithms are switched on exactly as ``python -m trainer`` does."""
    from trainer.config import load_run_config
    from trainer.train import Trainer

    cfg = load_run_config(run_dir)
    if env is None:
        env = local_env(cfg.device)
    if cfg.deterministic:
        from trainer.determinism import make_deterministic

        make_deterministic(env.device.type)
    tr = Trainer(cfg, Path(run_dir), env, offline=True)
    tr.ckpt.log = warn or _stderr
    return tr


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def restore(tr, step: int) -> None:
    """Load exactly checkpoint ``step`` with the skip list it had (not the run dir's current one,
    which may have grown since): the state S_step as the run had it."""
    from trainer.data import SkipList

    tr.skip = SkipList(tr.cfg.data.skip)
    tr.load_checkpoint(step, restore_skiplist=True)


def param_digest(tr) -> str:
    """The param digest exactly as the trainer records it (``StepRecord.param_digest``)."""
    from trainer.telemetry.digest import digest_hex, param_digest_tensor

    d = param_digest_tensor(tr.raw_model.parameters())
    if tr.cfg.parallelism == "fsdp" and tr.env.distributed:
        dist.all_reduce(d)
    return digest_hex(d.tolist())


def gather(env, obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    out: list = [None] * env.world_size
    dist.all_gather_object(out, obj, group=env.control_group)
    return out


def device_kind(tr) -> str:
    return tr.env.device.type


def checkpoint_problem(e: Exception) -> str:
    """A CheckpointError as one line that says it is about a checkpoint."""
    msg = str(e)
    return msg if msg.startswith("no checkpoint") else f"checkpoint {msg}"


def check_ids(rec, step: int) -> list[int]:
    from trainer.data import batch_fingerprint

    ids = list(rec.sample_ids)
    if not ids:
        raise OfflineError(f"step {step} in the log has no sample_ids: this run's log cannot be replayed")
    if batch_fingerprint(ids) != rec.batch_fingerprint:
        raise OfflineError(
            f"step {step}: the recorded sample_ids do not match the recorded batch fingerprint "
            f"({batch_fingerprint(ids)} != {rec.batch_fingerprint}); the log is inconsistent"
        )
    return ids


def run_step(tr, ids: list[int], *, apply: bool) -> dict:
    """One optimizer step over global batch ``ids`` at the trainer's current step; host values."""
    micro, micro_ids = tr.micro_batches(ids)
    lr = tr.lr_for(tr.state.step, ids)
    loss, ranks, gnorm, factor, reason = tr.train_step(micro, micro_ids, lr, apply=apply)
    if apply:
        tr.state.step += 1
    return {"loss": float(loss.item()), "rank_losses": [float(x) for x in ranks.tolist()],
            "grad_norm": float(gnorm.item()), "lr": lr, "skipped": float(factor.item()) == 0.0,
            "reason": int(reason.item())}
