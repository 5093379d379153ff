"""Run the trainer on a really full disk: a small tmpfs, in a private user + mount namespace.

    unshare -rm python tests/helpers/diskfull.py --size 2m --out OUT [--fill-at N --free-after S] -- TRAINER ARGS...

No root needed (tmpfs is mountable inside a user namespace) and nothing outside sees the mount.
The run dir is the tmpfs itself; when the trainer exits, its contents are copied to OUT (normal
disk) and a ``driver.json`` records the exit code, the output, and when the disk was filled and
freed. ``--fill-at N``: once N step records are on disk, fill the tmpfs to the last byte with a
filler file; ``--free-after S``: delete the filler S seconds later. Used by tests/trainer/test_faults.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _fill(path: Path) -> int:
    written = 0
    block = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n = f.write(block)
            except OSError:
                break
            written += n
            if n < len(block):
                block = block[: max(1, len(block) // 2)]
    return written


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", required=True)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--fill-at", type=int, default=0)
    p.add_argument("--free-after", type=float, default=0.0)
    p.add_argument("trainer_args", nargs=argparse.REMAINDER)
    a = p.parse_args()
    args = [x for x in a.trainer_args if x != "--"]
    mnt = Path(f"/tmp/chaos-diskfull-{os.getpid()}")
    mnt.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={a.size}", "tmpfs", str(mnt)], check=True)
    info: dict = {"size": a.size}
    try:
        cmd = [sys.executable, "-m", "trainer", "--run-dir", str(mnt), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if a.fill_at:
            filler = mnt / "filler"
            while proc.poll() is None and _lines(mnt / "steps.jsonl") < a.fill_at:
                time.sleep(0.01)
            info["filled_at_lines"] = _lines(mnt / "steps.jsonl")
            info["filler_bytes"] = _fill(filler)
            time.sleep(a.free_after)
            info["lines_while_full"] = _lines(mnt / "steps.jsonl")
            filler.unlink()
        out, err = proc.communicate(timeout=300)
        info.update(rc=proc.returncode, stdout=out, stderr=err)
    finally:
        a.out.mkdir(parents=True, exist_ok=True)
        shutil.copytree(mnt, a.out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("filler"))
        if subprocess.run(["umount", str(mnt)], check=False).returncode == 0:
            mnt.rmdir()  # the empty mount point (one per run: /tmp filled up with them)
        (a.out / "driver.json").write_text(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
