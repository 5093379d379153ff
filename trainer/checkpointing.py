"""The trainer's checkpoint state S_t: what a checkpoint holds, saving it, loading it back, and how far the
newest valid one may fall behind before the run stops.

S_t = (params, optimizer moments + step counts, scheduler step, RNG of every rank, data cursor,
grad-accumulation position, skip list, guard statistics, tokens seen), as the named pieces of
``trainer/state.py`` (each with ``state_dict`` / ``load_state_dict`` / ``check``). ``trainer/checkpoint.py``
writes and verifies the files (atomic step dirs, a manifest of checksums written last); this module writes
the pieces into them, checks every piece of a checkpoint, then loads them all, on every rank alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from sentinel.contract.fsio import map_file, release_later
from sentinel.protocol import SKIP_REMOVED, CheckpointInfo
from trainer import tensor_file
from trainer.checkpoint import (
    Checkpointer,
    CheckpointError,
    list_checkpoints,
    manifest_digest,
    step_dir_name,
    verify_share,
)
from trainer.checkpoint_io import HASH_THREAD_MIN_CORES
from trainer.dist import copy_threads, intra_op_threads
from trainer.errors import TrainingError
from trainer.piece_files import load_file, piece_path
from trainer.state import DCP_DIR, TRAIN_STATE, CheckpointState

_VERIFY, _READ = 0, 1  # where a load turned a checkpoint down: its checksums (first), or its files' checks


def _log(env, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


class TrainerCheckpoints:
    """Saves and restores a :class:`trainer.train.Trainer`'s full state (``tr``: the trainer)."""

    def __init__(self, tr) -> None:
        self.tr = tr
        self.state = CheckpointState(tr)  # S_t by name: what a checkpoint holds (trainer/state.py)
        env, c = tr.env, tr.cfg.checkpoint
        self.ckpt = Checkpointer(
            tr.run_dir, rank=env.rank, world_size=env.world_size, keep_last=c.keep_last, keep_every=c.keep_every,
            barrier=env.barrier, all_ok=env.all_ok, log=lambda m: print(m, flush=True),
            idle_writer=c.async_priority == "idle", async_writer=c.async_writer,
            hash_thread=env.core_share() >= HASH_THREAD_MIN_CORES,
        )
        self.last_time: float | None = None  # when the newest checkpoint of this state was saved
        # the newest valid checkpoint (step, time) and consecutive failed saves since: bounds the work a
        # failing disk can put at risk (checkpoint.max_age_steps / max_age_seconds)
        self.good = (0, time.time())
        self.failed = 0
        self._group = None  # lazily created gloo group for FSDP2 async checkpoints
        self.unloadable: list[str] = []  # why each checkpoint the last load passed over failed
        self.removals_applied = False  # skiplist.removed.json was applied: deleted at the next checkpoint

    def save(self, *, sync: bool = False) -> None:
        """Save S_t now; ``sync``: wait for it even with ``checkpoint.async_save`` (the initial state's save:
        a run killed in its first seconds must find it, not an async save still under way)."""
        tr = self.tr
        tr._flush_readback()
        async_save = tr.cfg.checkpoint.async_save and not sync
        # only rank 0 writes the shared files; an async save's thread builds the model's and optimizer's
        shared, per_rank = self.state.files(shared_files=tr.env.is_main, defer_live=async_save and not self.state.sharded)
        ts = shared[TRAIN_STATE]
        meta = {k: ts[k] for k in ("run", "timeline", "tokens", "dataset_fingerprint")}
        dcp_writer = dcp_async_writer = None
        if self.state.sharded:  # FSDP2: DCP writes this rank's shards
            sharded = self.state.states["model_optimizer"].state_dict()
            from torch.distributed.checkpoint import save as dcp_save

            dcp_writer = lambda d: dcp_save(sharded, checkpoint_id=str(d))  # noqa: E731
            if async_save:
                from torch.distributed.checkpoint import async_save as dcp_async_save

                if self._group is None:  # DCP's background collectives get their own gloo group
                    self._group = dist.new_group(backend="gloo")
                group = self._group
                dcp_async_writer = lambda d: dcp_async_save(sharded, checkpoint_id=str(d), process_group=group)  # noqa: E731
        # async without DCP: ``shared`` holds the live tensors; the save's thread copies them before the
        # optimizer step may change them (Trainer._one_step calls ckpt.fence() first), then writes while
        # training goes on
        step = tr.state.step
        self.ckpt.save(step, shared=shared, per_rank=per_rank, meta=meta, dcp_writer=dcp_writer,
                       dcp_async_writer=dcp_async_writer, async_save=async_save, on_done=self._on_done(step))

    def _on_done(self, step: int):
        tr = self.tr

        def done(ok: bool, seconds: float, size: int, path: Path | None) -> None:
            now = time.time()
            if ok:
                self.last_time = now
                self.good, self.failed = (step, now), 0
                if self.removals_applied and tr.env.is_main:  # a checkpoint without them: they stick now
                    (tr.run_dir / SKIP_REMOVED).unlink(missing_ok=True)
                    self.removals_applied = False
            else:
                self.failed += 1
            if tr.metrics:
                tr.metrics.on_checkpoint(ok=ok, seconds=seconds, size_bytes=size, timestamp=now)
            if ok and path is not None:
                _log(tr.env, f"checkpoint step {step} saved ({size / 1e6:.1f} MB, {seconds:.2f}s)")
                if tr.bus:
                    manifest = json.loads((path / "manifest.json").read_text())
                    tr.bus.register_checkpoint(CheckpointInfo(
                        run=tr.run_id, step=step, path=str(path.resolve()), created=now, bytes=size,
                        manifest_sha256=manifest_digest(manifest), world_size=tr.env.world_size,
                        timeline=tr.control.timeline, tokens=tr.state.tokens,
                    ))
                    # retention may have deleted older checkpoints: the bus must not offer them as rollback targets
                    tr.bus.retain_checkpoints(s for s, _ in list_checkpoints(self.ckpt.root))
        return done

    def load(self, step: int | None = None, *, restore_skiplist: bool = True) -> int | None:
        """Restore S_t from the newest valid checkpoint (or exactly ``step``); return its step or None.

        Every candidate is verified and fully read and checked in memory before any state is touched;
        one that fails on any rank is reported in one line and the previous one is tried (an exact
        ``step`` fails instead). All ranks take the same decision at each candidate: one vote (a
        collective on the control group) says that every rank's share of the checksums passed, every
        rank's files parsed and checked, and all saw the same files."""
        tr = self.tr
        env = tr.env
        self.ckpt.wait()
        if step is not None:
            path = self.ckpt.root / step_dir_name(step)
            if not os.path.isdir(path):
                raise CheckpointError(f"no checkpoint at step {step} in {self.ckpt.root}")
            candidates = [(step, path)]
        else:
            candidates = list_checkpoints(self.ckpt.root, strays=True)
        self.unloadable = []
        for ck_step, path in candidates:
            verified, why, fingerprint = self._verify(path)
            loaded, stage = None, _VERIFY
            if why is None:
                try:
                    loaded = self._read(path, *verified)
                except CheckpointError as e:
                    why, stage = str(e), _READ
            if env.all_ok(why is None, same=fingerprint):
                self._restore(loaded, restore_skiplist=restore_skiplist)
                release_later((loaded, verified))  # the mappings, unmapped after the load instead of in it
                del loaded, verified
                return ck_step
            why = self._rejection(path, why, stage)
            if step is not None:
                raise CheckpointError(why)
            self.unloadable.append(why)
            _log(env, f"warning: checkpoint {why}; falling back to the previous one")
        return None

    def _verify(self, path: Path) -> tuple[tuple[dict, dict, dict, dict] | None, str | None, int]:
        """Verify this rank's share of ``path`` (``trainer.checkpoint.verify_share``): ((its manifest, its
        train state, the mappings its checksums were computed through, by path, what ``_parse_early``
        parsed while the disk read, by name), None, fingerprint) if it passed, else (None, why,
        fingerprint). ``fingerprint``: the files this rank saw (names and sizes), for the load's vote
        to compare.

        A node's ranks read the same files, so each hashes a share of them (``checksum_share``: on a
        2-rank node, half the bytes each instead of all of them twice), and ``_read`` then parses the
        rest of what this rank restores, hashed by another rank: a tensor file's parser and the JSON
        reader take any bytes and refuse what is wrong in one line, and nothing is applied before the
        vote says that every share passed. Torch's format is hashed by each rank that reads it. One
        vote a load: a collective costs 0.6-1.0 ms between the two ranks of this 2-core VM, more than
        hashing a few MB, and a rank that hashed everything itself still had to vote
        (docs/benchmarks/checkpoint-cost.md, change 26). Ranks of other nodes verify their own copy:
        nothing says two nodes see one file system."""
        env = self.tr.env
        share = (env.local_rank, env.local_world_size) if env.distributed else None
        early: dict = {}
        mappings: dict = {}
        standing: dict = {}  # piece -> whether its byte plan stands (asked while the manifest is on its way)

        def ready() -> None:
            standing.update((piece, piece.stands()) for piece in self.state.mapped.values())

        try:
            manifest, fingerprint, state = verify_share(path, share, mappings, lambda file, mapped: self._parse_early(file, mapped, early, standing),
                                                        ready)
        except CheckpointError as e:
            return None, str(e), 0
        return (manifest, state, mappings, early, standing), None, fingerprint

    def _rejection(self, path: Path, why: str | None, stage: int) -> str:
        """Why the ranks turned ``path`` down, the same line on every rank: this rank's ``why``, or with
        several, the first failure of any rank, a checksum's before a parse's (a file another rank
        found corrupt may fail this rank's parser first), naming the rank. A collective, on the rare
        path only (``trainer.dist.DistEnv.gather``)."""
        env = self.tr.env
        if not env.distributed:
            return why or f"{path.name}: rejected"
        said = env.gather(None if why is None else (stage, why))
        found = sorted((s, r, w) for r, x in enumerate(said) if x is not None for s, w in [x])
        if not found:  # every rank passed: the vote's fingerprints differed
            return f"{path.name}: the ranks see different files (names or sizes)"
        _, rank, first = found[0]
        return first if rank == env.rank else f"{first} (on rank {rank})"

    def _parse_early(self, file: Path, mapped, early: dict, standing: dict) -> None:
        """While the disk reads what ``verify_share`` announced, just before ``file`` is hashed: parse and
        check it as ``_read`` would if it is one of this rank's tensor files (``mapped``: the mapping its
        checksum is about to be computed through), into ``early`` (by name: what ``check`` prepared, or
        the exception it raised, which ``_read`` raises in its turn). Only its header is read, and the
        RNGs' few KB for their dry run; nothing is applied, and a file whose checksum then fails is never
        used. On ``tiny``, the parsing (0.5 ms) overlaps the read instead of following it
        (docs/benchmarks/checkpoint-cost.md)."""
        if file.name == TRAIN_STATE:  # ``mapped``: the state read from it; its pieces' checks
            try:
                early[TRAIN_STATE] = (mapped, self._check_train_state(mapped, file.parent.name))
            except Exception as e:  # noqa: BLE001  (raised by ``_read``)
                early[TRAIN_STATE] = (mapped, e)
            return
        piece = self.state.mapped.get(file.name)
        if piece is None or file.suffix != tensor_file.SUFFIX:  # torch's format: never before its checksum
            return
        try:
            early[file.name] = self._prepare(piece, file, mapped, standing.get(piece))
        except Exception as e:  # noqa: BLE001  (raised by ``_read``, in the order it checks)
            early[file.name] = e

    @staticmethod
    def _prepare(piece, file: Path, mapping, stands: bool | None = None) -> Any:
        """``file`` (a piece's file that ``maps_file``; ``mapping``: its mapping, or None) as the piece's
        ``load_state_dict`` takes it. A tensor file by the piece's byte plan where its header is the one
        the plan was made for (``trainer/byte_plan.py``: on ``tiny``, 0.6 ms less of a 2.3 ms load;
        ``stands``: whether the plan stands, asked earlier in the load); else read and checked, and a
        plan made of it for the next."""
        if file.suffix == tensor_file.SUFFIX:
            if mapping is None:  # hashed by another rank: mapped here (a failure is ``load_file``'s to report)
                with contextlib.suppress(OSError, ValueError):
                    mapping = map_file(file)
            if mapping is not None and (planned := piece.planned(mapping, stands)) is not None:
                return planned
        sd = load_file(file, mapped=True, mapping=mapping)
        prepared = piece.check(sd, file.parent.name)
        out = sd if prepared is None else prepared
        if mapping is not None and file.suffix == tensor_file.SUFFIX:
            piece.remember(mapping, out)
        return out

    def _check_train_state(self, ts: dict, ckpt: str) -> dict:
        """The pieces kept in ``train_state.json`` (the same in both layouts), checked: name -> what their
        ``load_state_dict`` is given."""
        out = {}
        for name, piece in self.state.states.items():
            if piece.file == TRAIN_STATE:
                sd = {k: ts[k] for k in piece.keys}
                prepared = piece.check(sd, ckpt)
                out[name] = sd if prepared is None else prepared
        return out

    def _read(self, path: Path, manifest: dict, ts: dict, mappings: dict, early: dict, standing: dict) -> dict:
        """Every piece of one checkpoint this rank needs, read and checked, nothing applied yet (after
        ``_verify``, which read ``ts``, ``train_state.json``; with several ranks, the files another rank
        hashed are read here unverified by this one: the vote that follows covers them). The pieces in
        ``train_state.json`` first: their checks are the cheapest. The tensor files are mapped, not read (``Piece.maps_file``:
        their ``load_state_dict`` copies the tensors into the live ones), through the mapping their
        checksum was computed through where there is one (``mappings``, by path): the bytes parsed are
        the bytes hashed, and their pages are in place."""
        pieces = self.state.layout(sharded=os.path.isdir(os.path.join(path, DCP_DIR)))  # (pathlib's: 25 us)
        state, checked = early.pop(TRAIN_STATE, (None, None))
        if state is not ts:  # not checked while the disk read
            checked = self._check_train_state(ts, path.name)
        elif isinstance(checked, Exception):
            raise checked
        read: dict = dict(checked)
        for name, piece in pieces.items():
            if piece.file not in (TRAIN_STATE, DCP_DIR):  # DCP reads its shards when loading
                if piece.file in early:  # parsed while the disk read (``_parse_early``), then its checksum passed
                    if isinstance(done := early.pop(piece.file), Exception):
                        raise done
                    read[name] = done
                    continue
                file = piece_path(path, piece.file, manifest["files"])
                if piece.maps_file:
                    read[name] = self._prepare(piece, file, mappings.pop(file, None), standing.get(piece))
                    continue
                sd = load_file(file)
                prepared = piece.check(sd, path.name)
                read[name] = sd if prepared is None else prepared
        return {"path": path, "manifest": manifest, "pieces": [(n, p, read.get(n)) for n, p in pieces.items()]}

    def _restore(self, ck: dict, *, restore_skiplist: bool) -> None:
        """Apply what ``_read`` checked. The copies into the live tensors use this rank's share of the
        node's cores (``intra_op_threads``) from ``COPY_THREADS_MIN_BYTES`` up, else one thread
        (``trainer.dist.copy_threads``)."""
        path = ck["path"]
        threads = copy_threads(int(ck["manifest"].get("bytes", 0)), self.tr.env)
        with intra_op_threads(threads, exact=True):
            for name, piece, sd in ck["pieces"]:  # in the layout's order: the tensors first
                if name == "skiplist" and not restore_skiplist:
                    continue
                if piece.file == DCP_DIR:
                    self._load_sharded(piece, path)
                else:
                    piece.load_state_dict(sd)
        self.last_time = ck["manifest"].get("created")
        self.good, self.failed = (self.tr.state.step, time.time()), 0

    @staticmethod
    def _load_sharded(piece, path: Path) -> None:
        from torch.distributed.checkpoint import load as dcp_load

        sd = piece.state_dict()  # this rank's shards, filled in place
        try:  # DCP validates its shards against .metadata itself; a failure is one line, not a traceback
            dcp_load(sd, checkpoint_id=str(path / DCP_DIR))
            piece.load_state_dict(sd)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"{path.name}: sharded state (dcp/) could not be loaded: {first[:300]}") from None

    def check_age(self, *, final: bool = False) -> None:
        """Stop the run (the same one-line error on every rank) when checkpoint saves keep failing and the
        newest valid checkpoint has fallen too far behind, or when the final save failed: never exit 0 with
        the run's recent work unprotected. A collective: called at the same point on every rank."""
        tr = self.tr
        why = None
        if tr.env.is_main:
            why = self._staleness(final)
            if why and tr.cfg.checkpoint.async_save:  # an in-flight save may still land
                self.ckpt.wait()
                why = self._staleness(final)
        why = tr.env.broadcast_object(why)
        if why:
            self.ckpt.wait()
            with contextlib.suppress(TrainingError):
                tr._close_io()
            raise TrainingError(why)

    def _staleness(self, final: bool) -> str | None:
        tr = self.tr
        if not self.failed:
            return None
        c = tr.cfg.checkpoint
        good_step, good_time = self.good
        age_steps, age_s = tr.state.step - good_step, time.time() - good_time
        bound = c.max_age_steps or c.every
        err = self.ckpt.last_error or "write failed"
        newest = f"newest valid checkpoint is step {good_step}" if good_step else "there is no valid checkpoint"
        if final and age_steps > 0:
            return (f"final checkpoint at step {tr.state.step} failed ({err}); {newest}, {age_steps} steps behind: "
                    f"fix the storage and restart to resume from it")
        too_old = (bound and age_steps > bound) or (c.max_age_seconds and age_s > c.max_age_seconds)
        if not too_old:
            return None
        limit = " / ".join(x for x in (f"{bound} steps" if bound else "", f"{c.max_age_seconds:g} s" if c.max_age_seconds else "") if x)
        return (f"checkpoint saves are failing ({err}): {newest}, {age_steps} steps and {age_s:.0f} s old "
                f"(bound {limit}); stopped at step {tr.state.step}: fix the storage and restart to resume")

