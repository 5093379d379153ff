"""Atomic, verified, full-state checkpoints.

Layout: ``RUN_DIR/checkpoints/step-NNNNNNNN/`` holding ``model.safetensors``, ``optim.safetensors`` (or ``dcp/``
for FSDP2), ``train_state.json``, ``rng-rank{r}.safetensors`` for every rank (``trainer/tensor_file.py``; ``.pt``
files of torch's format in checkpoints written before it), and ``manifest.json`` — written
**last**, with a checksum per file (BLAKE3: ``sentinel.contract.fsio``). A checkpoint is valid iff its manifest exists and every checksum
matches, so a crash (or SIGKILL) at any moment leaves either the old set of valid checkpoints or the
old set plus one new complete one.

Write protocol: every rank writes its files into ``.tmp-step-N.K`` (K: the process's save count),
each file's checksum computed from the bytes as they are written (``trainer.checkpoint_io``: no
read-back) and its writeback started early; rank 0 then writes the manifest, makes every file and
directory durable, and renames the directory into place (then fsyncs its parent). Nothing outside
``step-N`` directories is ever loaded, so the rename is the commit point: everything in the
temporary directory is fsynced before it. The fsyncs, the manifest's included, run concurrently (the
file system commits them together: one journal round trip for all the files, not one per file;
bench/checkpoint_cost.py measured 7 sequential fsyncs as two thirds of a small checkpoint's save).
Loading (``trainer.checkpointing.TrainerCheckpoints.load``; the reading side is
``trainer/checkpoint_verify.py``) applies nothing until every checksum has passed on every rank. While
the disk reads, it parses each tensor file's JSON header (and dry-runs the RNG state) just before
hashing that file: a format without pickle, whose reader refuses hostile input in one line, and a file
whose checksum then fails is never used. Torch's format (``.pt``, checkpoints from before tensor files)
is opened only after its checksum passed, with ``torch.load(weights_only=True)``
(``trainer/piece_files.py``). The ranks of one node share the hashing (``checksum_share``), each parses
what it restores, and one vote says that every share passed and every rank's files parsed and checked,
before any rank applies a byte (torch's format is hashed by each rank that reads it). The model's and
the optimizer's files are mapped and copied into the live tensors.

Async saves (``async_save``) take the live tensors: the background thread copies them to host memory
first, and ``Checkpointer.fence`` (called before the optimizer step) waits for that copy, so the
training loop blocks only for the hand-off, and the copy overlaps the next step's forward pass. The
files are then written by the rank's writer process (``async_writer="process"``: the copy is in memory
it shares, ``trainer/checkpoint_writer.py``) or by the thread itself (``"thread"``); both run
``write_async_files``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sentinel.contract.checkpoints import (
    manifest_digest,  # noqa: F401  (re-exported)
)
from sentinel.contract.fsio import clear_trash, file_checksum, move_to_trash, remove_dir, sha256_file  # noqa: F401  (sha256_file: re-exported)
from sentinel.contract.fsio import fsync_dir as _fsync  # by name: a file's data, or a directory's names
from sentinel.contract.rundir import CHECKPOINT_FORMAT as FORMAT_VERSION
from sentinel.contract.rundir import CHECKPOINT_MANIFEST as MANIFEST
from sentinel.contract.rundir import checkpoint_dir_name
from trainer.checkpoint_io import HashLater, write_file, write_json
from trainer.checkpoint_thread import HostStage, _run_jobs, built, host_copy
from trainer.checkpoint_verify import (  # noqa: F401  (re-exported: the reading side)
    TORCH_SUFFIX,
    CheckpointError,
    ValidCheckpoint,
    checksum_share,
    files_fingerprint,
    list_checkpoints,
    read_train_state,
    verify,
    verify_share,
)

step_dir_name = checkpoint_dir_name


def _read_mark(path: Path) -> str | None:
    """What an async save's ``.done-rankN`` marker says (``ok`` / ``fail``), or None while it is absent."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


class Checkpointer:
    """Saves and finds checkpoints for one rank. Collective calls go through ``barrier``/``all_ok``
    (supplied by the trainer) so this module stays testable without a process group."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_every: int,
        barrier: Callable[[], None],
        all_ok: Callable[[bool], bool],
        log: Callable[[str], None] = print,
        idle_writer: bool = False,
        async_writer: str = "thread",
        hash_thread: bool = True,
    ):
        self.root = Path(run_dir) / "checkpoints"
        self.rank, self.world_size = rank, world_size
        self.keep_last, self.keep_every = keep_last, keep_every
        self.barrier, self.all_ok, self.log = barrier, all_ok, log
        self.idle_writer = idle_writer  # the async save's thread runs at SCHED_IDLE (checkpoint.async_priority)
        # who writes an async save's files (checkpoint.async_writer): "process", this rank's writer process
        # (trainer/checkpoint_writer.py: none of the pickling holds this process's GIL), or "thread", the
        # save's thread itself. A writer that cannot start or dies turns it to "thread" for good
        self.async_writer = async_writer
        # the tensor files are written first and hashed after, while the disk drains (checkpoint_io.HashLater);
        # with ``hash_thread`` (the rank has cores to spare: HASH_THREAD_MIN_CORES) a helper thread hashes too
        self.hash_thread = hash_thread
        self._proc = None  # the WriterProcess, started by the first async save that uses it
        self._host_stage = HostStage()  # a sync save's host copy of its device tensors (kept between saves)
        # async saves run one at a time on one long-lived thread: starting a thread per save waited for it
        # to boot (~45 us of the loop's time); a queue hand-over is ~4 us
        self._jobs: queue.SimpleQueue | None = None
        self._writer: threading.Thread | None = None  # started by the first async save
        self._idle = threading.Event()  # no async save is queued or running
        self._idle.set()
        self._saves = 0
        self._async_error: BaseException | None = None
        # set once an async save's background thread has copied the state it writes: until then the
        # trainer must not change a parameter or an optimizer moment (``fence``, before the optimizer step)
        self._snapshot_taken = threading.Event()
        self._snapshot_taken.set()
        self.fence_wait_seconds = 0.0  # how long the last ``fence`` blocked (bench/checkpoint_cost.py)
        self.snapshot_seconds = 0.0  # how long the last async save's host copy took, on its thread
        self.last_error: str | None = None  # why the last failed save failed (one line, for the exit message)
        self._make_root()

    def _make_root(self) -> None:
        """Create ``checkpoints/`` if missing. Something else at that path (a file, a FIFO, a dangling
        link) is a one-line CheckpointError that every caller already reports (the trainer, replay-batch,
        verify-resume), never a FileExistsError traceback; and it is left as it is."""
        if (self.root.exists() or self.root.is_symlink()) and not self.root.is_dir():
            raise CheckpointError(f"{self.root} is not a directory: move it aside (the checkpoints live in that directory)")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:  # raced, or a parent that is a file
            raise CheckpointError(f"cannot create {self.root}: {e.strerror}") from None

    # ------------------------------------------------------------------ discovery
    def clean_partial(self) -> None:
        """Remove leftovers of writes that died midway (rank 0, at start)."""
        if self.rank == 0:
            for p in self.root.glob(".tmp-step-*"):
                shutil.rmtree(p, ignore_errors=True)
            clear_trash(self.root)

    def newest_valid(self, at_or_before: int | None = None) -> ValidCheckpoint | None:
        """Newest checkpoint that verifies; corrupt ones are reported in one line and passed over."""
        for step, path in list_checkpoints(self.root, strays=True):
            if at_or_before is not None and step > at_or_before:
                continue
            try:
                return ValidCheckpoint(step, path, verify(path))
            except CheckpointError as e:
                if self.rank == 0:
                    self.log(f"warning: checkpoint {e}; falling back to the previous one")
        return None

    def exact(self, step: int) -> ValidCheckpoint:
        path = self.root / step_dir_name(step)
        if not path.is_dir():
            raise CheckpointError(f"no checkpoint at step {step} in {self.root}")
        return ValidCheckpoint(step, path, verify(path))

    # ------------------------------------------------------------------ saving
    def fence(self) -> None:
        """Block until a pending async save holds its own copy of the state (before anything changes a
        parameter or an optimizer moment in place: the optimizer step). At once if there is none."""
        t0 = time.perf_counter()
        self._snapshot_taken.wait()
        self.fence_wait_seconds = time.perf_counter() - t0

    def wait(self) -> None:
        """Block until a pending async save has finished (before the next save, a load, or exit)."""
        self._idle.wait()
        if self._async_error is not None:
            err, self._async_error = self._async_error, None
            self.last_error = getattr(err, "strerror", None) or (str(err).splitlines() or [type(err).__name__])[0]
            self.log(f"warning: async checkpoint failed: {self.last_error}")

    def save(
        self,
        step: int,
        *,
        shared: dict[str, Any],
        per_rank: dict[str, Any],
        meta: dict[str, Any],
        dcp_writer: Callable[[Path], None] | None = None,
        dcp_async_writer: Callable[[Path], Any] | None = None,
        async_save: bool = False,
        on_done: Callable[[bool, float, int, Path | None], None] | None = None,
    ) -> None:
        """Write a checkpoint for ``step``.

        ``shared``: rank-0 files (name -> object; ``checkpoint_io.write_file``: by the name's suffix);
        ``per_rank``: this rank's files; ``dcp_writer(dir)``: collective FSDP2 writer;
        ``dcp_async_writer(dir)``: its async form (stages to CPU, returns a Future that completes
        once every rank has written — DCP's coordinator gathers them on its own process group).
        With ``async_save`` the tensors in ``shared``/``per_rank`` may be the live ones: a background
        thread copies them to host memory first (``fence`` waits for that copy, so the caller calls it
        before changing any of them), then writes, checksums and renames while training goes on. A file
        given as a callable is built by calling it, on that thread before the copy (``built``).
        """
        self.wait()
        t0 = time.time()
        # a name no earlier save of this process used (saves are collective: every rank counts them
        # alike), so no rank meets another attempt's files in it, and none waits for rank 0 to clear
        # and make it (a barrier: most of a 2-rank async save's stall). Leftovers of earlier
        # processes are gone before the first save (``clean_partial``, then a barrier).
        self._saves += 1
        tmp = self.root / f".tmp-{step_dir_name(step)}.{self._saves}"
        if not (async_save and dcp_writer is None):  # an async save's job makes it: one syscall off the loop
            tmp.mkdir(parents=True, exist_ok=True)
            shared, per_rank = built(shared), built(per_rank)

        if async_save and dcp_async_writer is not None:
            written = self._write_files(tmp, shared, per_rank)  # small files: written now
            ok = written is not None
            fut = dcp_async_writer(tmp / "dcp") if ok else None  # the step waits only for the CPU staging

            def dcp_job():
                try:
                    done_ok = ok and fut is not None and fut.result() is not None
                except BaseException as e:  # surfaced by wait()
                    self._async_error, done_ok = e, False
                info = None
                if self.rank == 0:
                    info = self._commit(tmp, step, meta, written) if done_ok else None
                    if info is None:
                        shutil.rmtree(tmp, ignore_errors=True)
                    if on_done:
                        on_done(info is not None, time.time() - t0, info[1] if info else 0, info[0] if info else None)

            self._submit(dcp_job)
            return

        if async_save and dcp_writer is None:
            self._snapshot_taken.clear()

            def job():
                nonlocal shared, per_rank
                try:
                    proc = self._writer_process()
                    try:  # the copy runs here (torch copies release the GIL) while the next step's forward runs
                        t_copy = time.perf_counter()
                        shared, per_rank = built(shared) if self.rank == 0 else {}, built(per_rank)  # only rank 0 writes them
                        tmp.mkdir(parents=True, exist_ok=True)
                        if proc is not None:
                            try:
                                structure = proc.snapshot({"shared": shared, "per_rank": per_rank})
                            except OSError as e:  # no process or shared memory to be had here: the thread writes
                                proc = self._use_thread(f"the checkpoint writer process could not start ({e.strerror or e})")
                        if proc is None:
                            shared, per_rank = host_copy(shared), host_copy(per_rank)
                        self.snapshot_seconds = time.perf_counter() - t_copy
                    finally:
                        self._snapshot_taken.set()
                    if proc is not None:
                        done = self._write_in_process(proc, tmp, step, meta, structure)
                    else:
                        done = self.write_async_files(tmp, step, meta, shared, per_rank)
                    if self.rank == 0 and on_done:
                        info = done["info"]
                        on_done(done["ok"], time.time() - t0, info[1] if info else 0, Path(info[0]) if info else None)
                except BaseException as e:  # surfaced by wait()
                    self._async_error = e
                    if self.rank == 0 and on_done:
                        on_done(False, time.time() - t0, 0, None)

            self._submit(job)
            return

        written = self._write_files(tmp, *self._host_stage.stage(shared if self.rank == 0 else {}, per_rank))
        ok = written is not None
        if ok and dcp_writer is not None:
            try:
                dcp_writer(tmp / "dcp")
            except Exception as e:  # DCP wraps rank failures (disk full included) in CheckpointException
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                self.last_error = getattr(e, "strerror", None) or first
                self.log(f"error: checkpoint step {step} (torch.distributed.checkpoint): {self.last_error}")
                ok = False
        if not self.all_ok(ok):
            if ok:
                self.last_error = "a write failed on another rank"
            ok = False
        result = None
        if self.rank == 0:
            if ok:
                result = self._commit(tmp, step, meta, written)
            if result is None:
                shutil.rmtree(tmp, ignore_errors=True)
            if on_done:
                on_done(result is not None, time.time() - t0, result[1] if result else 0, result[0] if result else None)
        self.barrier()

    def write_async_files(self, tmp: Path, step: int, meta: dict, shared: dict, per_rank: dict) -> dict:
        """An async save's work once its state is copied (on the save's thread, or in the writer process):
        this rank's files, its ``.done-rankN`` marker, and on rank 0 the commit once every rank's marker says
        ``ok``. Returns ``{"ok": committed, "info": (path, bytes) or None}`` (info on rank 0 only)."""
        written = self._write_files(tmp, shared, per_rank)
        self._mark(tmp, written is not None)
        info = None
        if self.rank == 0:
            info = self._finalize_when_ranks_done(tmp, step, meta, written or {})
            if info is None and written is not None:  # else _write_files said why
                self.log(f"warning: async checkpoint step {step} failed: {self.last_error}")
        return {"ok": info is not None if self.rank == 0 else written is not None,
                "info": (str(info[0]), info[1]) if info else None}

    def _mark(self, tmp: Path, ok: bool) -> None:
        mark, part = tmp / f".done-rank{self.rank}", tmp / f".part-done-rank{self.rank}"
        part.write_text("ok" if ok else "fail")
        os.replace(part, mark)  # whole or absent: rank 0 never reads a marker half written

    def start_writer(self) -> None:
        """Start this rank's writer process now, if async saves will use one: it imports torch while the
        trainer loads its checkpoint, so that the first async save finds it ready. Said in one line, and the
        thread writes instead, where it cannot start."""
        proc = self._writer_process()
        if proc is None or proc.alive():
            return
        try:
            proc.start()
        except OSError as e:
            self._use_thread(f"the checkpoint writer process could not start ({e.strerror or e})")

    def _use_thread(self, why: str) -> None:
        """From now on the save's thread writes async saves (said in one line); returns None, the process."""
        if self._proc is not None:
            self._proc.close()
        self.async_writer = "thread"
        self.log(f"warning: {why}; async saves write on a thread")

    def _writer_process(self):
        """This rank's writer process (``WriterProcess``: its ``snapshot`` starts it when it is not running),
        or None: async saves write on the save's thread (``async_writer="thread"``, or no process to be had)."""
        if self.async_writer != "process":
            return None
        if not hasattr(os, "memfd_create"):  # not Linux: no memory to share with a writer that way
            return self._use_thread("no memfd_create on this system")
        if self._proc is None:
            from trainer.checkpoint_writer import WriterProcess

            self._proc = WriterProcess(idle=self.idle_writer)
            weakref.finalize(self, self._proc.close)
        return self._proc

    def _write_in_process(self, proc, tmp: Path, step: int, meta: dict, structure: dict) -> dict:
        reply = proc.write({"run_dir": str(self.root.parent), "rank": self.rank, "world_size": self.world_size,
                            "keep_last": self.keep_last, "keep_every": self.keep_every, "hash_thread": self.hash_thread,
                            "tmp": str(tmp), "step": step,
                            "meta": meta, "shared": structure["shared"], "per_rank": structure["per_rank"]})
        for line in reply["logs"]:
            self.log(line)
        if reply["last_error"]:
            self.last_error = reply["last_error"]
        if reply.get("died"):  # its files are unfinished: this rank's marker says so, and rank 0 removes them
            self._use_thread(f"async checkpoint step {step} failed: {reply['last_error']}")
            with contextlib.suppress(OSError):
                self._mark(tmp, False)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        return reply

    def _submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` (an async save, which catches its own errors) on the checkpoint thread."""
        if self._writer is None:
            self._jobs = queue.SimpleQueue()
            self._writer = threading.Thread(target=_run_jobs, name="ckpt-writer", daemon=True,
                                            args=(self._jobs, self._idle, weakref.ref(self), self.idle_writer))
            self._writer.start()
            weakref.finalize(self, self._jobs.put, None)  # a Checkpointer let go of: its thread ends
        self._idle.clear()
        self._jobs.put(job)

    def _write_files(self, tmp: Path, shared: dict, per_rank: dict) -> dict[str, str] | None:
        """Write this rank's files (not fsynced: rank 0's ``_finalize`` makes them durable, all
        together); return their checksums by name, or None when a write failed (said in one line)."""
        files = dict(per_rank)
        if self.rank == 0:
            files.update(shared)
        try:
            with HashLater(helper=self.hash_thread) as later:
                digests = {name: write_file(tmp / name, obj, sync=False, later=later) for name, obj in files.items()}
                sums = later.checksums()
            return {name: d if d is not None else sums[tmp / name] for name, d in digests.items()}
        except OSError as e:  # disk full, quota, EFBIG: the previous checkpoints are untouched
            self.last_error = e.strerror or str(e)
            self.log(f"error: checkpoint write failed on rank {self.rank}: {self.last_error}")
            return None

    def _finalize_when_ranks_done(self, tmp: Path, step: int, meta: dict, written: dict[str, str], timeout: float = 600.0):
        deadline = time.time() + timeout
        while time.time() < deadline:
            marks = [tmp / f".done-rank{r}" for r in range(self.world_size)]
            said = [_read_mark(m) for m in marks]
            if all(x in ("ok", "fail") for x in said):  # anything else: not written yet
                if all(x == "ok" for x in said):
                    for m in marks:
                        m.unlink()
                    return self._finalize(tmp, step, meta, written)
                break
            time.sleep(0.05)
        if _read_mark(tmp / f".done-rank{self.rank}") != "fail":  # else _write_files said why
            self.last_error = "a write failed on another rank" if all(m.exists() for m in marks) else "timed out waiting for the other ranks"
        shutil.rmtree(tmp, ignore_errors=True)
        return None

    def _commit(self, tmp: Path, step: int, meta: dict, written: dict[str, str]) -> tuple[Path, int] | None:
        """``_finalize``, or None when the disk refused it (said in one line; the caller removes ``tmp``)."""
        try:
            return self._finalize(tmp, step, meta, written)
        except OSError as e:
            self.last_error = e.strerror or str(e)
            self.log(f"error: checkpoint step {step} could not be finalized: {self.last_error}")
            return None

    def _finalize(self, tmp: Path, step: int, meta: dict, written: dict[str, str]) -> tuple[Path, int]:
        """Manifest, fsync of everything in ``tmp``, rename (the commit point), fsync of the parent.
        ``written``: the checksums of the files this rank wrote, computed as they were written; the
        others (other ranks' files, DCP shards) are hashed here."""
        rel = {p: p.relative_to(tmp).as_posix() for p in sorted(p for p in tmp.rglob("*") if p.is_file())}
        dirs = [tmp, *[p for p in tmp.rglob("*") if p.is_dir()]]
        # every file and directory is fsynced at once (fsync releases the GIL; concurrent fsyncs share
        # journal commits), the manifest included when it can be written first (every digest known)
        with ThreadPoolExecutor(max_workers=min(16, len(rel) + len(dirs) + 1)) as pool:
            hashing = {r: pool.submit(file_checksum, p) for p, r in rel.items() if r not in written}
            synced = [pool.submit(_fsync, p) for p in rel] if hashing else []  # large ones (DCP shards) overlap
            files = {r: written[r] if r in written else hashing[r].result() for r in rel.values()}
            total = sum(p.stat().st_size for p in rel)
            manifest = {"format": FORMAT_VERSION, "step": step, "files": files, "bytes": total,
                        "world_size": self.world_size, "created": time.time(), **meta}
            write_json(tmp / MANIFEST, manifest, sync=False)
            synced += [pool.submit(_fsync, p) for p in [*([] if hashing else rel), tmp / MANIFEST, *dirs]]
            for f in synced:
                f.result()  # an EIO from the disk surfaces here, before anything is renamed
        # the commit point: the step directory appears, complete and durable, or not at all
        final = self.root / step_dir_name(step)
        trash = move_to_trash(final) if final.exists() else None  # re-saving a step after a rollback: swap
        tmp.rename(final)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        _fsync(self.root)
        self._retain()
        return final, total

    def _retain(self) -> None:
        """Keep the newest ``keep_last`` valid checkpoints plus every ``keep_every``-th step forever.
        The initial state (step 0) is not a ``keep_every`` milestone: it is there for damage in the first
        interval, and retires like any other checkpoint once ``keep_last`` newer ones exist."""
        kept = 0
        for step, path in list_checkpoints(self.root):
            if not (path / MANIFEST).is_file():
                continue
            kept += 1
            if kept <= self.keep_last or (self.keep_every and step and step % self.keep_every == 0):
                continue
            with contextlib.suppress(OSError):  # retention never fails the save that made it run
                remove_dir(path)  # renamed out of the step names first: a kill midway leaves only trash
