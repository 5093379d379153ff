"""Checkpoint save and verify+load, this tree's ``trainer/checkpoint.py`` (and ``checkpoint_io.py``) against an older revision's,
ABBA-interleaved in one process on the same state (the before/after of a change to that module).

    python bench/probes/checkpoint_ab.py [--before REV] [--preset small] [--pairs 8] [--dir DIR]

A real checkpoint is made first (``python -m trainer --preset P --max-steps 1``); its tensors and
train state are what both versions save. Save: ``Checkpointer.save`` (sync, one rank), retention
kept out of the clock. Load: ``verify`` + the load of every piece file (each revision's own), with the files
dropped from the page cache before each arm (``posix_fadvise(DONTNEED)``). Printed: the median
seconds of each arm and the median of the per-pair ratios after/before.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def load_module(name: str, source: str, where: Path):
    path = where / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="9c68c67", help="git revision of the 'before' trainer/checkpoint.py")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--dir", help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-ab-", dir=args.dir))
    try:
        def show(path: str) -> str | None:
            out = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before}:{path}"], capture_output=True, text=True)
            return out.stdout if out.returncode == 0 else None

        old_src = show("trainer/checkpoint.py")
        if old_src is None:
            raise SystemExit(f"error: {args.before} has no trainer/checkpoint.py")
        old_io = show("trainer/checkpoint_io.py")  # the files' writer (since 2026-11-29): the revision's own, too
        if old_io is not None:
            load_module("checkpoint_io_before", old_io, work)
            old_src = old_src.replace("from trainer.checkpoint_io import", "from checkpoint_io_before import")
        old = load_module("checkpoint_before", old_src, work)
        import trainer.checkpoint as new
        from trainer.piece_files import legacy_name, load_file

        run = work / "run"
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        subprocess.run([sys.executable, "-m", "trainer", "--preset", args.preset, "--run-dir", str(run), "--max-steps", "1",
                        "--ckpt-every", "1", "--telemetry", "off", "--eval-every", "0"], env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        src = run / "checkpoints" / "step-00000001"
        pieces = {n: load_file(src / n, mapped=False) for n in ("model.safetensors", "optim.safetensors", "rng-rank0.safetensors")}
        train_state = json.loads((src / "train_state.json").read_text())
        # each arm writes the pieces under the names its revision gives them (tensor files, or torch's .pt before)
        names = {"after": list(pieces), "before": [n if hasattr(old, "write_file") else legacy_name(n) for n in pieces]}
        loader = {"after": load_file, "before": getattr(old, "load_torch", load_file)}
        arms = {"before": old, "after": new}
        from trainer.checkpoint_io import HASH_THREAD_MIN_CORES
        from trainer.dist import usable_cpus

        hash_thread = usable_cpus() >= HASH_THREAD_MIN_CORES
        secs: dict[str, dict[str, list[float]]] = {"save": {a: [] for a in arms}, "load": {a: [] for a in arms}}
        for i in range(args.pairs):
            order = ("before", "after") if i % 2 == 0 else ("after", "before")
            for arm in order:
                mod = arms[arm]
                d = work / arm
                # as the trainer makes it for one rank here: a hashing thread only with cores to spare
                kw = {"hash_thread": hash_thread} if "hash_thread" in inspect.signature(mod.Checkpointer).parameters else {}
                ck = mod.Checkpointer(d, rank=0, world_size=1, keep_last=100, keep_every=0, barrier=lambda: None,
                                      all_ok=lambda ok: ok, log=lambda m: None, **kw)
                step = i + 1
                train_state["step"] = train_state["scheduler"]["step"] = step
                t0 = time.perf_counter()
                files = dict(zip(names[arm], pieces.values()))
                rng_name = names[arm][2]
                shared = {**{n: files[n] for n in names[arm][:2]}, "train_state.json": train_state}
                ck.save(step, shared=shared, per_rank={rng_name: files[rng_name]}, meta={"run": "ab"})
                secs["save"][arm].append(time.perf_counter() - t0)
                path = ck.root / f"step-{step:08d}"
                for p in path.iterdir():
                    fd = os.open(p, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                t0 = time.perf_counter()
                mod.verify(path)
                for name in names[arm]:
                    loader[arm](path / name)
                secs["load"][arm].append(time.perf_counter() - t0)
                shutil.rmtree(path)
        for what, by in secs.items():
            ratios = [a / b for a, b in zip(by["after"], by["before"])]
            print(f"{what}: before median {statistics.median(by['before']) * 1000:.1f} ms, after "
                  f"{statistics.median(by['after']) * 1000:.1f} ms; after/before per pair: median "
                  f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}), {args.pairs} ABBA pairs")
        print(f"bytes: {sum(p.stat().st_size for p in src.iterdir()):,} ({args.preset}), before = {args.before}, "
              f"hash_thread {hash_thread}, load avg {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
