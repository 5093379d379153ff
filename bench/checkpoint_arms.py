"""The in-process arms of ``bench/checkpoint_cost.py`` (its docstring says what each figure compares):
``save_vs_raw``, ``async_stall_vs_sync`` and ``load_vs_raw``, each timed inside the worker that holds a real
``Trainer``, plus the helpers the driver shares (``abba``, ``summarise``)."""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sentinel.contract.fsio import Checksum
from sentinel.contract.fsio import fsync_dir as fsync_path  # any path: a file's data, or a directory's names


def abba(reps: int) -> list[tuple[str, str]]:
    """Pair orders A B, B A, A B, ... so that drift hits both arms alike."""
    return [("a", "b") if i % 2 == 0 else ("b", "a") for i in range(reps)]


def pooled(num: list[float], den: list[float]) -> list[float]:
    """ABBA's quads: each two consecutive rounds (a b, b a; or a b c, c b a) pooled into one ratio, the sum
    of one arm's seconds over the other's, so that an order effect (an arm slower right after another)
    cancels inside each. The median of per-round ratios does not cancel it: on 2026-12-02 `tiny`'s load
    read 1.2 in every a-first round and 0.5 in every a-last one, and the median of 100 fell in the gap."""
    return [(num[i] + num[i + 1]) / (den[i] + den[i + 1]) for i in range(0, len(num) - 1, 2)]


def summarise(a: list[float], b: list[float], ratio: list[float], quads: list[float] | None = None, **extra) -> dict:
    """A figure: the median of ``quads`` (``pooled``) where given, else of the per-round ``ratio``; both are listed."""
    fig = quads if quads else ratio
    return {"median": statistics.median(fig), "min": min(fig), "max": max(fig), "ratios": [round(r, 4) for r in ratio],
            **({"quad_ratios": [round(r, 4) for r in quads], "round_ratio_median": statistics.median(ratio)} if quads else {}),
            "a_seconds_median": statistics.median(a), "b_seconds_median": statistics.median(b), **extra}


def _checksum(data: bytes) -> str:  # what a checkpoint's files get, as they are written
    h = Checksum()
    h.update(data)
    return h.hexdigest()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class Worker:
    """The trainer ``t`` of this rank and the timing every arm shares."""

    def __init__(self, t, env):
        import torch

        self.torch, self.t, self.env = torch, t, env
        self.root, self.rank0 = t.ckpt.root, env.is_main
        # on a GPU every timed arm ends when the device's work is done, not when the host has queued it
        self.sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)

    def newest(self) -> Path:
        return max((p for p in self.root.iterdir() if p.name.startswith("step-")), key=lambda p: p.name)

    def nbytes(self) -> int:
        return int(json.loads((self.newest() / "manifest.json").read_text())["bytes"])

    def prune(self) -> None:  # retention is not what is measured: keep only the newest checkpoint, outside the clock
        self.env.barrier()
        if self.rank0:
            for p in sorted(p for p in self.root.iterdir() if p.name.startswith("step-"))[:-1]:
                shutil.rmtree(p)
        self.env.barrier()

    def timed(self, fn) -> float:
        self.env.barrier()
        t0 = time.perf_counter()
        fn()
        self.sync()
        self.env.barrier()
        return time.perf_counter() - t0

    def slowest(self, seconds: float) -> float:  # the next step's collectives wait for the slowest rank
        dist = self.torch.distributed
        if not dist.is_initialized():
            return seconds
        x = self.torch.tensor([seconds], dtype=self.torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x.item())

    def timed_per_rank(self, fn) -> float:
        """What ``fn`` costs each rank's loop, the slowest rank's: the ranks start together (a barrier), and
        no barrier follows inside the clock (``timed``'s would add its own latency, ~0.3 ms on gloo)."""
        self.env.barrier()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return self.slowest(time.perf_counter() - t0)

    def save(self, async_save: bool = False) -> None:
        self.t.cfg.checkpoint.async_save = async_save
        self.t.state.step += 1
        self.t.save_checkpoint()

    def train_one(self) -> None:  # a real step: after an async save, its optimizer step waits at the fence
        t = self.t
        ids, _, micro, micro_ids = t.next_batch()
        t.train_step(micro, micro_ids, t.lr_for(t.state.step, ids))
        self.sync()


WARMUP_TRIPLES = 4  # untimed (save, raw write, floor) triples before save_vs_raw's measured ones


def recycle_pages(path: Path, data: bytes) -> None:
    """Write ``data`` to a scratch file and unlink it unsynced, outside the clock: the next arm's page-cache
    pages are then ones the guest has just freed, whichever arm it is. On a VM whose balloon reports free
    pages to the host (virtio-balloon free page reporting, this project's machines), a page freed more than
    ~2 s before is handed back, and the next write into it faults it in again: 39 MB then took 32-81 ms to
    write, not 8-10 (docs/benchmarks/checkpoint-cost.md, 2026-12-02, afternoon). Which arm met that fell by
    chance; now no arm does. A real save, minutes after the last, pays it, and so would the raw write: the
    same cost added to both arms, which only raises the ratio. The warm ratio is the stricter one."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
    finally:
        os.close(fd)
        os.unlink(path)  # dirty pages of an unlinked file are dropped, never written


def save_vs_raw(w: Worker, reps: int) -> dict:
    torch, root, rank0 = w.torch, w.root, w.rank0
    blob = os.urandom(w.nbytes())  # incompressible, built outside the clock
    raw_path = root / "raw-write.bin"
    scratch = root / "recycled-pages.bin"
    raw_durable = []  # the raw arm's fsyncs alone (the file's and the directory's), after its last byte

    def raw_write():
        if rank0:
            fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, blob)
                t0 = time.perf_counter()
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_path(root)
            raw_durable.append(time.perf_counter() - t0)

    # the save's ceiling: whatever a saver overlaps, it serialises the files into their format (tensor files:
    # a header, the tensors' bytes as they are; torch's ``.pt``: the pickler, which holds the GIL) and then
    # waits at least one fsync after its last byte. raw seconds / (serialisation in memory + the raw arm's
    # fsyncs) bounds save_vs_raw from above on any checkpoint in this format
    from trainer import tensor_file
    from trainer.checkpoint_io import _no_zip_crc
    from trainer.checkpoint_thread import HostStage

    stage = HostStage()  # on a GPU the save first copies its device tensors to the host this way, and so does this arm

    def serialise_in_memory() -> float:
        shared, per_rank = w.t.checkpoints.state.files(shared_files=rank0)
        t0 = time.perf_counter()
        shared, per_rank = stage.stage(shared, per_rank)
        with _no_zip_crc():
            for name, obj in {**shared, **per_rank}.items():
                if name.endswith(".json"):
                    json.dumps(obj, indent=1, sort_keys=True).encode()
                elif name.endswith(tensor_file.SUFFIX):
                    tensor_file.encode(obj)
                else:
                    torch.save(obj, io.BytesIO())
        return w.slowest(time.perf_counter() - t0)

    # the floor: the same files' bytes (random, prebuilt) through the commit protocol alone (a new
    # directory, every file and the directory fsynced, the rename, the parent fsynced), with nothing
    # serialised or hashed: no checkpoint that commits a directory atomically can be faster
    layout = {p.name: os.urandom(p.stat().st_size) for p in w.newest().iterdir()}
    floor_n = 0

    def floor_commit():
        nonlocal floor_n
        if rank0:
            floor_n += 1
            tmp, final = root / f".floor-{floor_n}", root / f"floor-{floor_n}"
            tmp.mkdir()
            for name, data in layout.items():
                fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    _write_all(fd, data)
                finally:
                    os.close(fd)
            with ThreadPoolExecutor(max_workers=len(layout) + 1) as pool:  # as trainer/checkpoint.py does
                for f in [pool.submit(fsync_path, tmp / n) for n in layout] + [pool.submit(fsync_path, tmp)]:
                    f.result()
            tmp.rename(final)
            fsync_path(root)

    def triple(i: int) -> dict:
        secs = {}
        for arm in ("a", "b", "c") if i % 2 == 0 else ("c", "b", "a"):
            if rank0:  # rank 0 writes the bytes in every arm (the other ranks, a few small files of their own)
                recycle_pages(scratch, blob)
            secs[arm] = w.timed({"a": w.save, "b": raw_write, "c": floor_commit}[arm])
            w.prune()
            if rank0:
                raw_path.unlink(missing_ok=True)
                for p in root.glob("floor-*"):
                    shutil.rmtree(p)
        return secs

    # warm-up, untimed: the first saves of a process ran 2-3x slower than the rest, in its page-cache
    # writes (a probe of 2 ranks, 2026-12-02: 40-73 ms, then 20-25), whether or not it had waited 4 s first
    for i in range(WARMUP_TRIPLES):
        triple(i)
    a, b, c, ratio, floor, serial, ceiling = [], [], [], [], [], [], []
    for i in range(reps):  # three arms: a b c, c b a, ...
        secs = triple(i)
        a.append(secs["a"])
        b.append(secs["b"])
        c.append(secs["c"])
        ratio.append(secs["b"] / secs["a"])
        floor.append(secs["b"] / secs["c"])
        serial.append(serialise_in_memory())
        if rank0:  # only rank 0 runs the raw arm
            ceiling.append(secs["b"] / (serial[-1] + raw_durable[-1]))
    nbytes = w.nbytes()
    return summarise(a, b, ratio, pooled(b, a), bytes=nbytes, arms="a = save_checkpoint (sync), b = raw write + fsync, "
                     "c = the commit protocol alone on the same files' bytes (floor)",
                     save_mb_per_s=nbytes / statistics.median(a) / 1e6, raw_mb_per_s=nbytes / statistics.median(b) / 1e6,
                     floor_seconds_median=statistics.median(c), floor_files=len(layout),
                     floor_ratio_median=statistics.median(pooled(b, c)), floor_ratios=[round(r, 4) for r in floor],
                     serialise_in_memory_seconds_median=statistics.median(serial),
                     raw_fsync_seconds_median=statistics.median(raw_durable) if raw_durable else None,
                     ceiling_ratio_median=statistics.median(ceiling) if ceiling else None,
                     ceiling_ratios=[round(r, 4) for r in ceiling])


def async_stall_vs_sync(w: Worker, reps: int) -> dict:
    t, env = w.t, w.env
    a, b, ratio, in_save, fence, copy = [], [], [], [], [], []
    step_during, step_plain, slowdown = [], [], []
    w.train_one()  # warm-up
    w.save(async_save=True)  # and an async save's: a run's writer (thread or process) is up before its second save
    w.train_one()
    t.ckpt.wait()
    w.prune()
    for i in range(reps):  # a b c, c b a, ...
        secs = {}
        for arm in ("a", "b", "c") if i % 2 == 0 else ("c", "b", "a"):
            w.train_one()  # the step a save follows in Trainer.fit (untimed)
            if arm == "a":
                secs[arm] = w.timed_per_rank(w.save)
            elif arm == "b":  # each rank's own block (its save call, then its fence), the slowest rank's
                env.barrier()
                t0 = time.perf_counter()
                w.save(async_save=True)
                blocked = time.perf_counter() - t0
                w.train_one()
                step_secs = time.perf_counter() - t0 - blocked
                in_save.append(w.slowest(blocked))
                fence.append(w.slowest(t.ckpt.fence_wait_seconds))
                secs[arm] = w.slowest(blocked + t.ckpt.fence_wait_seconds)
                step_during.append(w.slowest(step_secs))
                t.ckpt.wait()
                copy.append(t.ckpt.snapshot_seconds)
            else:  # the same step with no save in flight: what the writer's share of the cores and the GIL costs
                step_plain.append(w.timed_per_rank(w.train_one))
            w.prune()
        a.append(secs["a"])
        b.append(secs["b"])
        ratio.append(secs["b"] / secs["a"])
        slowdown.append((step_during[-1] - step_plain[-1]) / secs["a"])
    t.cfg.checkpoint.async_save = False
    # what the async save's CPU snapshot holds while the writer runs: every model and optimizer tensor once
    tensors = [*t.raw_model.state_dict().values(),
               *(v for st in t.opt.state_dict()["state"].values() for v in st.values() if hasattr(v, "nbytes"))]
    return summarise(
        a, b, ratio, pooled(b, a), bytes=w.nbytes(), arms="a = sync save; b = what an async save blocks each rank's loop (the slowest "
        "rank's): save_checkpoint() plus the wait at the next step's optimizer step for the background copy (fence); "
        "c = a step with no save in flight", async_snapshot_bytes=sum(int(x.nbytes) for x in tensors),
        blocked_in_save_seconds_median=statistics.median(in_save), fence_wait_seconds_median=statistics.median(fence),
        background_copy_seconds_median=statistics.median(copy), async_priority=t.cfg.checkpoint.async_priority,
        next_step_seconds_median=statistics.median(step_during), plain_step_seconds_median=statistics.median(step_plain),
        next_step_slowdown_vs_sync_median=statistics.median(slowdown),
        next_step_slowdown_vs_sync=[round(r, 4) for r in slowdown])


def drop_from_page_cache(files) -> None:
    """Drop clean (fsynced) files from the page cache, so that the next read goes to the disk. A page
    that a mapping still holds stays: the loads' mappings this process let go are unmapped first."""
    from sentinel.contract.fsio import wait_released

    wait_released()
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def read_through(files) -> None:
    """The raw arm of a load: every file read sequentially, once, in 4 MiB reads."""
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 22):
                pass


def load_vs_raw(w: Worker, reps: int) -> dict:
    t = w.t
    step = t.state.step
    files = sorted(p for p in w.newest().rglob("*") if p.is_file())
    a, b, ratio = [], [], []

    def evict():  # both arms read from the disk, not from the page cache (the files are clean: fsynced)
        wait_released()  # every rank's last load unmapped first: a page still mapped stays in the cache
        w.env.barrier()
        if w.rank0:
            drop_from_page_cache(files)

    def raw_read():
        read_through(files)

    def load():
        assert t.load_checkpoint(step) == step

    # the parts no loader can skip, in memory (no disk): the checksum of every byte, and the parsing of the
    # files this rank restores (tensor files: the header, views of the bytes). It holds the GIL, so no other
    # core shares its time: raw read / deserialisation bounds load_vs_raw from above, whatever the reading
    # and hashing overlap
    from sentinel.contract.fsio import wait_released
    from trainer import tensor_file

    blobs = {p.name: p.read_bytes() for p in files}
    mine = [n for n in ("model.safetensors", "optim.safetensors", f"rng-rank{w.env.rank}.safetensors") if n in blobs]
    writable = {n: bytearray(blobs[n]) for n in mine}  # what a load maps: writable, copy-on-write
    hashed, deser, ceiling = [], [], []

    def in_memory(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    floor_load = _load_floor(w)
    load()  # warm-up
    arms = ("a", "b", "c") if floor_load is not None else ("a", "b")
    if floor_load is not None:
        floor_load()
    c, floor, vs_floor = [], [], []
    for i in range(reps):  # three arms: a b c, c b a, ...
        secs = {}
        for arm in arms if i % 2 == 0 else arms[::-1]:
            evict()
            secs[arm] = w.timed({"a": load, "b": raw_read, "c": floor_load}[arm])
        a.append(secs["a"])
        b.append(secs["b"])
        ratio.append(secs["b"] / secs["a"])
        if "c" in secs:
            c.append(secs["c"])
            floor.append(secs["b"] / secs["c"])
            vs_floor.append(secs["c"] / secs["a"])
        deser.append(in_memory(lambda: [tensor_file.read(writable[n]) for n in mine]))
        hashed.append(in_memory(lambda: [_checksum(x) for x in blobs.values()]))
        ceiling.append(secs["b"] / deser[-1])
    return summarise(a, b, ratio, pooled(b, a), bytes=sum(p.stat().st_size for p in files),
                     arms="a = load_checkpoint (verify + load + restore), b = raw read of the same files, "
                          "c = the checksums and one copy of the bytes into the live tensors, nothing parsed or checked (floor)",
                     floor_seconds_median=statistics.median(c) if c else None,
                     floor_ratio_median=statistics.median(pooled(b, c)) if c else None, floor_ratios=[round(r, 4) for r in floor],
                     load_vs_floor_median=statistics.median(pooled(c, a)) if c else None,
                     load_vs_floor_ratios=[round(r, 4) for r in vs_floor],
                     checksum_in_memory_seconds_median=statistics.median(hashed),
                     deserialise_in_memory_seconds_median=statistics.median(deser),
                     ceiling_ratio_median=statistics.median(ceiling), ceiling_ratios=[round(r, 4) for r in ceiling])


def _load_floor(w: Worker):  # -> the floor arm, or None (FSDP2 shards)
    """The load's floor: what any loader of this state must do, and nothing more. The checksums of this
    rank's share of the files, by the loader's own function (``fsio.checksums_match``, its files
    announced, the small ones mapped); ``train_state.json`` read (the counters); every tensor's bytes
    copied from a mapping of its file (the one its checksum was computed through, where there is one)
    into its live tensor, in one ``torch._foreach_copy_`` on the rank's share of the cores, with the
    byte positions worked out before the clock; the RNGs set; with 2 ranks, one vote. Nothing is
    parsed, checked or validated: raw seconds / floor seconds is the most a loader in Python can
    reach on this disk, whatever it overlaps. Not for the FSDP2 shards (``dcp/``)."""
    import torch

    from sentinel.contract.fsio import checksums_match, map_file
    from trainer import rng, tensor_file
    from trainer.checkpoint import checksum_share
    from trainer.dist import copy_threads, intra_op_threads
    from trainer.flat_state import tiled_base

    t, env, ck = w.t, w.env, w.newest()
    if (ck / "dcp").is_dir():
        return None
    files = json.loads((ck / "manifest.json").read_bytes())["files"]

    def positions(name: str):
        buf = bytearray((ck / name).read_bytes())
        base = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
        return tensor_file.read(buf), lambda x: x.data_ptr() - base

    obj, offset = positions("model.safetensors")
    live = t.raw_model.state_dict()
    plan = [("model.safetensors", [(offset(v), live[k]) for k, v in obj.items()])]
    obj, offset = positions("optim.safetensors")
    params = [p for g in t.opt.param_groups for p in g["params"]]
    moments = []
    for g in obj["groups"]:
        base = tiled_base([t.opt.state[params[i]][g["key"]] for i in g["params"]])
        assert base is not None and base.numel() == g["data"].numel(), "the live optimizer state is not flat"
        moments.append((offset(g["data"]), base))
    plan.append(("optim.safetensors", moments))
    names = sorted(files)
    if env.distributed and env.local_world_size > 1:
        names = checksum_share(names, [(ck / n).stat().st_size for n in names], env.local_rank, env.local_world_size)
    rng_file = ck / f"rng-rank{env.rank}.safetensors"
    threads = copy_threads(int(json.loads((ck / "manifest.json").read_bytes()).get("bytes", 0)), env)

    def floor_load() -> None:
        recorded = json.loads((ck / "manifest.json").read_bytes())["files"]
        hashed: dict = {}  # the mappings the small files were hashed through, reused as the loader does
        ok = all(checksums_match([(ck / n, recorded[n]) for n in names], hashed))
        json.loads((ck / "train_state.json").read_bytes())
        assert env.all_ok(ok)
        srcs, dsts = [], []
        for name, tensors in plan:
            mapped = hashed.get(ck / name) or map_file(ck / name)
            for at, dst in tensors:
                srcs.append(torch.frombuffer(mapped, dtype=dst.dtype, count=dst.numel(), offset=at).view(dst.shape))
                dsts.append(dst)
        with torch.no_grad(), intra_op_threads(threads, exact=True):  # on the threads the loader copies with
            torch._foreach_copy_(dsts, srcs)
        rng.restore(tensor_file.load(rng_file, mapped=True, mapping=hashed.get(rng_file)))

    return floor_load


def measure(t, env, reps: int, load_reps: int, save_reps: int,
            figures: tuple[str, ...] = ("save_vs_raw", "async_stall_vs_sync", "load_vs_raw")) -> dict:
    """The in-process figures asked for, in this order (the load arm reads the newest checkpoint there is)."""
    w = Worker(t, env)
    arms = {"save_vs_raw": lambda: save_vs_raw(w, save_reps), "async_stall_vs_sync": lambda: async_stall_vs_sync(w, save_reps),
            "load_vs_raw": lambda: load_vs_raw(w, load_reps)}
    return {k: arm() for k, arm in arms.items() if k in figures}
