"""S_t, the trainer's checkpoint state, as named pieces: each has ``state_dict()`` and
``load_state_dict(sd)`` (the shape of torchtitan's ``Stateful``), and ``check(sd, ckpt)``, which refuses
in one line what ``load_state_dict`` could not take whole, touching nothing. A checkpoint is checked
piece by piece before any piece is loaded, so a bad one is passed over with the live state intact.

A ``check`` raises ``CheckpointError`` for a bad checkpoint (the loader falls back to an older one) and
``TrainingError`` for an incompatible run (every checkpoint would fail alike, so the start stops).

The pieces, their files and what each check refuses: docs/architecture.md ("Checkpoint state").
``trainer/checkpointing.py`` writes the pieces to those files and reads them back; the files and
the keys of ``train_state.json`` are the checkpoint format, unchanged by how the pieces split them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from trainer import byte_plan, flat_state, rng
from trainer.checkpoint_checks import check_optimizer_state, check_rng, check_tensors
from trainer.errors import TrainingError

TRAIN_STATE = "train_state.json"
DCP_DIR = "dcp"  # FSDP2's shards: a directory that DCP reads and writes itself


@dataclass
class TrainState:
    """The host-side counters of S_t."""

    step: int = 0  # optimizer steps completed
    tokens: int = 0  # tokens trained (global, excluding skipped steps)
    accum_pos: int = 0  # micro-batches of the current step already done (0 at every step boundary)


class Piece:
    """One named part of S_t, over the trainer ``tr`` (read late: a rollback or a replay tool may
    swap ``tr.state`` or ``tr.skip``). ``file``: where a checkpoint keeps it; a piece stored in
    ``train_state.json`` owns the top-level ``keys`` its ``state_dict`` returns."""

    file = TRAIN_STATE
    keys: tuple[str, ...] = ()
    per_rank = False  # every rank writes its own file (else rank 0 writes the one copy)
    # its file is loaded with ``mmap`` (no read into fresh memory): ``load_state_dict`` must then copy
    # every tensor into live memory, keeping none that maps the checkpoint file
    maps_file = False
    # ``state_dict`` only refers to live tensors that change in the optimizer step alone (behind
    # ``Checkpointer.fence``): an async save may build it on its own thread (``files(defer_live=True)``)
    live = False

    def __init__(self, tr) -> None:
        self.tr = tr

    def state_dict(self) -> Any:
        raise NotImplementedError

    def load_state_dict(self, sd: Any) -> None:
        raise NotImplementedError

    def check(self, sd: Any, ckpt: str) -> Any:
        """Refuse ``sd`` (of checkpoint directory ``ckpt``) in one line if it cannot be loaded whole. May
        return the form ``load_state_dict`` is then given (what the check built already), else None: ``sd``."""

    # (``byte_plan.BytePlan``, what the piece holds the live side to) as ``remember`` made it, or None
    _plan: tuple | None = None

    def stands(self) -> bool:
        """Whether this piece has a byte plan (``remember``) that the live side still allows
        (``_unchanged``); one that it does not is dropped. A load asks while the disk fetches the
        checkpoint's manifest."""
        if self._plan is None:
            return False
        if self._unchanged():
            return True
        self._plan = None
        return False

    def planned(self, mapping, stands: bool | None = None) -> Any:
        """What ``load_state_dict`` is given for the tensor file ``mapping`` (mapped), by the byte plan
        ``remember`` made of an earlier file with the same header, if that plan still stands
        (``trainer/byte_plan.py``; ``stands``: what ``stands()`` said earlier in this load, else asked
        now); else None, and the file is read and checked."""
        if self._plan is None or not (self.stands() if stands is None else stands):
            return None
        src = self._plan[0].sources(mapping)
        return None if src is None else self._from_plan(src)

    def remember(self, mapping, prepared: Any) -> None:
        """Keep a byte plan of ``prepared`` (what ``check`` gave for the tensor file ``mapping``), for
        ``planned`` to restore the next file with the same header by."""

    def _unchanged(self) -> bool:
        """The live side is as it was when the plan was made."""
        return False

    def _from_plan(self, src: list[torch.Tensor]) -> Any:
        """What ``load_state_dict`` takes, from the plan's cut of a file's data (``BytePlan.sources``)."""
        raise NotImplementedError


class ModelPiece(Piece):
    file = "model.safetensors"
    maps_file = True  # ``load_state_dict`` copies into the parameters
    live = True

    def state_dict(self) -> dict:
        return self.tr.raw_model.state_dict()  # the live tensors: an async save copies them itself

    def check(self, sd, ckpt: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``sd`` against the live model; returns what ``load_state_dict`` then copies: (live, saved), the
        live ones the parameters and buffers themselves (a plan checks that they still are where they were)."""
        live = self.tr.raw_model.state_dict(keep_vars=True)
        check_tensors(sd, live, f"{ckpt}: {self.file}")
        return list(live.values()), [sd[name] for name in live]

    def _unchanged(self) -> bool:
        """The same model object, nothing anywhere registered (a parameter, buffer or submodule) since the
        plan was made, and each of its tensors at its address, shape and dtype."""
        _, model, made, live, sig = self._plan
        return model is self.tr.raw_model and made == byte_plan.registrations() and byte_plan.signature(live) == sig

    def _from_plan(self, src):
        return self._plan[0].dst, src

    def remember(self, mapping, prepared) -> None:  # (plan, the model, registrations(), its live tensors, their signature)
        live, saved = prepared
        plan = byte_plan.BytePlan.make(mapping, zip(live, saved))
        made = byte_plan.registrations()
        self._plan = None if plan is None else (plan, self.tr.raw_model, made, live, byte_plan.signature(live))

    def load_state_dict(self, sd: Any) -> None:
        """What ``Module.load_state_dict`` does for a state dict ``check`` passed (the same keys, shapes
        and dtypes), without its walk of every submodule: a copy into each live tensor, in one call."""
        live, saved = sd if isinstance(sd, tuple) else self.check(sd, "")
        with torch.no_grad():
            torch._foreach_copy_(live, saved)


class OptimizerPiece(Piece):
    """The moments and step counts, written as a few flat tensors (``trainer/flat_state.py``: 3 tensors
    to unpickle instead of 3 per parameter)."""

    file = "optim.safetensors"
    maps_file = True  # ``SkipStepAdamW.load_state_dict`` copies into its moments (or makes private copies)
    live = True

    def state_dict(self) -> dict:
        return flat_state.pack(self.tr.opt.state_dict())

    def _unchanged(self) -> bool:
        """The same optimizer object, with no load hooks, the same keys in each group, and the same
        parameters and state tensors, each at its address, shape and dtype."""
        _, opt, _, (held, _) = self._plan
        return opt is self.tr.opt and _held(opt)[0] == held

    def _from_plan(self, src):
        plan, _, groups, _ = self._plan
        return flat_state.FlatCopy(groups, list(zip(plan.dst, src)))

    def remember(self, mapping, prepared) -> None:  # (plan, the optimizer, the file's hyper-parameters, _held(opt))
        plan = byte_plan.BytePlan.make(mapping, prepared.copies) if isinstance(prepared, flat_state.FlatCopy) else None
        self._plan = None if plan is None else (plan, self.tr.opt, prepared.param_groups, _held(self.tr.opt))

    def check(self, sd, ckpt: str) -> Any:  # torch's own format too: a checkpoint from before this one
        """A file laid out as the live state is: its ``flat_state.FlatCopy`` (an in-process rollback, or
        any load after the first). Else torch's state dict, each tensor a view of the file's."""
        plan = flat_state.copy_plan(sd, self.tr.opt)
        if plan is not None:
            return plan
        what = f"{ckpt}: {self.file}"
        unpacked = flat_state.unpack(sd, what)
        check_optimizer_state(unpacked, self.tr.opt, what)
        return unpacked

    def load_state_dict(self, sd: Any) -> None:
        if isinstance(sd, flat_state.FlatCopy):
            self.tr.opt.load_flat(sd)
        else:
            self.tr.opt.load_state_dict(sd if "state" in sd else flat_state.unpack(sd, self.file))


def _held(opt: torch.optim.Optimizer) -> tuple[tuple, list[torch.Tensor]]:
    """What a byte plan of the optimizer's file holds it to (``flat_state.copy_plan``'s conditions on the
    live side, as they were when the plan was made): its load hooks, each group's keys, and its
    parameters and state tensors, by identity and by ``byte_plan.signature``; and those tensors (a
    plan keeps them, so that no other object takes their ids)."""
    keys, tensors = [], []
    for g in opt.param_groups:
        keys.append(frozenset(g))
        for p in g["params"]:
            tensors.append(p)
            if st := opt.state.get(p):
                tensors.extend(st.values())
    hooks = bool(getattr(opt, "_optimizer_load_state_dict_pre_hooks", None) or getattr(opt, "_optimizer_load_state_dict_post_hooks", None))
    return (hooks, keys, list(map(id, tensors)), byte_plan.signature(tensors)), tensors


class ShardedModelOptimizerPiece(Piece):
    """FSDP2: model and optimizer as one DCP state (``dcp/``, keys ``model`` and ``optim``). Each rank
    holds its shards; DCP checks them against ``dcp/.metadata`` as it reads them, so there is no
    ``check`` of its own, and the reading is the checkpointer's (``dcp.load`` into ``state_dict()``)."""

    file = DCP_DIR

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.tr.model, self.tr.opt)
        return {"model": msd, "optim": osd}

    def load_state_dict(self, sd: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.tr.model, self.tr.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class RngPiece(Piece):
    """This rank's generators (ranks draw distinct dropout streams, so each keeps its own file)."""

    per_rank = True
    maps_file = True  # ``rng.restore`` copies every state out (the generators', Python's, numpy's)

    @property
    def file(self) -> str:
        return f"rng-rank{self.tr.env.rank}.safetensors"

    def state_dict(self) -> dict:
        return rng.capture()

    def check(self, sd, ckpt: str) -> rng.Prepared:
        return check_rng(sd, f"{ckpt}: {self.file}")  # a dry run on throwaway generators

    def load_state_dict(self, sd: dict | rng.Prepared) -> None:
        rng.restore(sd)


class RunPiece(Piece):
    """Where the state comes from. Checked on load, never applied: the run id follows the run dir,
    the ControlLoop starts a new timeline, and the drills are the config's."""

    keys = ("run", "timeline", "world_size", "dataset_fingerprint", "faults", "source_faults", "last_checkpoint_time")

    def state_dict(self) -> dict:
        tr = self.tr
        return {"run": tr.run_id, "timeline": tr.control.timeline, "world_size": tr.env.world_size,
                "dataset_fingerprint": tr.ds.fingerprint, "faults": [f.model_dump() for f in tr.cfg.faults],
                "source_faults": [f.model_dump() for f in tr.cfg.source_faults], "last_checkpoint_time": time.time()}

    def check(self, sd: dict, ckpt: str) -> None:
        tr = self.tr
        if sd["dataset_fingerprint"] != tr.ds.fingerprint:
            raise TrainingError(f"dataset fingerprint mismatch: checkpoint {ckpt} was trained on {sd['dataset_fingerprint']}, "
                                f"this data is {tr.ds.fingerprint} ({tr.data_dir})")
        if sd["world_size"] != tr.env.world_size:
            raise TrainingError(f"checkpoint {ckpt} was written by {sd['world_size']} ranks, this run has "
                                f"{tr.env.world_size}; exact resume needs the same world size")

    def load_state_dict(self, sd: dict) -> None:
        pass


def _seq_len_refused(tr, ckpt: str, was: str) -> TrainingError:
    # not a bad checkpoint to fall back from: every checkpoint of the run would fail the same way
    seq = tr.cfg.model.seq_len
    return TrainingError(f"checkpoint {ckpt} was trained at {was}, this run has seq_len {seq} "
                         f"({tr.sampler.num_samples} samples): a run cannot change model.seq_len (the position "
                         "table and every sample id depend on it); train shorter sequences first with "
                         "data.seq_len_schedule, or start a new run dir")


class CountersPiece(Piece):
    """Step, tokens, grad-accum position, and the conditions the last step trained under (mixture
    weights, sequence length), so a resumed run marks a change of them as a fresh one would."""

    keys = ("step", "tokens", "grad_accum_pos", "mixture_weights", "seq_len", "train_seq_len")

    def state_dict(self) -> dict:
        tr = self.tr
        return {"step": tr.state.step, "tokens": tr.state.tokens, "grad_accum_pos": tr.state.accum_pos,
                "mixture_weights": tr.weights_now, "seq_len": tr.cfg.model.seq_len, "train_seq_len": tr.seq_now}

    def check(self, sd: dict, ckpt: str) -> None:
        if sd.get("seq_len", self.tr.cfg.model.seq_len) != self.tr.cfg.model.seq_len:
            raise _seq_len_refused(self.tr, ckpt, f"seq_len {sd['seq_len']}")

    def load_state_dict(self, sd: dict) -> None:
        tr = self.tr
        tr.state = TrainState(step=sd["step"], tokens=sd["tokens"], accum_pos=sd["grad_accum_pos"])
        tr.weights_now = sd.get("mixture_weights")
        # the length the step trained at (checkpoints from before schedules: model.seq_len); the
        # initial state (step 0) trained nothing, and comes back as a fresh start has it
        tr.seq_now = sd.get("train_seq_len") or (sd.get("seq_len") if sd["step"] else None)


class SamplerPiece(Piece):
    keys = ("sampler",)

    def state_dict(self) -> dict:
        return {"sampler": self.tr.sampler.state_dict()}

    def check(self, sd: dict, ckpt: str) -> None:
        n = sd["sampler"]["num_samples"]
        if n != self.tr.sampler.num_samples:
            raise _seq_len_refused(self.tr, ckpt, f"{n} samples")

    def load_state_dict(self, sd: dict) -> None:
        self.tr.sampler.load_state_dict(sd["sampler"])


class GuardPiece(Piece):
    keys = ("guard",)

    def state_dict(self) -> dict:
        return {"guard": self.tr.guard.state_dict()}

    def check(self, sd: dict, ckpt: str) -> dict:
        window, want = sd["guard"]["window"], self.tr.cfg.guard.window
        if window != want:
            raise TrainingError(f"checkpoint {ckpt} has a guard window of {window}, this run {want}; cannot resume exactly")
        g = sd["guard"]  # its windows as tensors already, for the load to copy
        return {"guard": {**g, "loss": torch.tensor(g["loss"], dtype=torch.float32), "grad": torch.tensor(g["grad"], dtype=torch.float32)}}

    def load_state_dict(self, sd: dict) -> None:
        self.tr.guard.load_state_dict(sd["guard"])


class SkipListPiece(Piece):
    """The skip list only grows: loading adds the checkpoint's ranges to the live ones."""

    keys = ("skiplist",)

    def state_dict(self) -> dict:
        return {"skiplist": [list(r) for r in self.tr.skip.ranges]}

    def load_state_dict(self, sd: dict) -> None:
        self.tr.skip.add([tuple(r) for r in sd["skiplist"]])


class SchedulerPiece(Piece):
    """Warmup + cosine, a pure function of the step (``trainer.optim.lr_at``): saved for the tools,
    nothing to load (the counters bring the step back; the schema ties the two together)."""

    keys = ("scheduler",)

    def state_dict(self) -> dict:
        return {"scheduler": {"kind": "warmup_cosine", "step": self.tr.state.step, "max_steps": self.tr.cfg.max_steps}}

    def load_state_dict(self, sd: dict) -> None:
        pass


class CheckpointState:
    """The trainer's pieces by name (``states``, torchtitan's shape). ``layout(sharded)`` is what one
    checkpoint holds: ``model`` + ``optimizer`` files, or the FSDP2 ``model_optimizer`` shards."""

    def __init__(self, tr) -> None:
        self.sharded = tr.cfg.parallelism == "fsdp" and tr.env.distributed  # how this trainer saves
        self._tensors = {"model": ModelPiece(tr), "optimizer": OptimizerPiece(tr),
                         "model_optimizer": ShardedModelOptimizerPiece(tr)}
        # loaded in this order: the tensors first (under FSDP2, DCP reads its shards only when loading,
        # the one load that can still fail: then nothing else has been touched)
        self._rest = {"rng": RngPiece(tr), "run": RunPiece(tr), "counters": CountersPiece(tr),
                      "sampler": SamplerPiece(tr), "guard": GuardPiece(tr), "skiplist": SkipListPiece(tr),
                      "scheduler": SchedulerPiece(tr)}
        self._layouts = {s: {**{n: self._tensors[n] for n in (("model_optimizer",) if s else ("model", "optimizer"))}, **self._rest}
                         for s in (False, True)}
        self.states = self.layout(self.sharded)
        # the pieces whose tensor file a load maps, by file name (``trainer.checkpointing``: parsed while the disk reads)
        self.mapped = {p.file: p for p in self._layouts[False].values() if p.maps_file}

    def layout(self, sharded: bool) -> dict[str, Piece]:
        """The pieces of a checkpoint, by name, in the order they are loaded (the same dict every call)."""
        return self._layouts[sharded]

    def train_state(self) -> dict:
        """``train_state.json``: the keys of every piece stored there."""
        out: dict = {}
        for piece in self.states.values():
            if piece.file == TRAIN_STATE:
                out.update(piece.state_dict())
        return out

    def files(self, *, shared_files: bool = True, defer_live: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a save writes, by file name: (rank 0's files, this rank's own files); the tensors are the
        live ones. Not the FSDP2 shards (``states["model_optimizer"]``): DCP writes those itself.
        ``shared_files=False`` (a rank other than 0, which writes none of them): only ``train_state.json``.
        ``defer_live``: a ``live`` piece's file is its ``state_dict`` method, for an async save's thread to
        call before its snapshot (``Checkpointer.save``), not the loop."""
        shared: dict[str, Any] = {TRAIN_STATE: self.train_state()}
        per_rank: dict[str, Any] = {}
        for piece in self.states.values():
            if piece.file not in (TRAIN_STATE, DCP_DIR) and (piece.per_rank or shared_files):
                built = piece.state_dict if defer_live and piece.live else piece.state_dict()
                (per_rank if piece.per_rank else shared)[piece.file] = built
        return shared, per_rank
