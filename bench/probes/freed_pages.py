"""Does this machine make a write into page-cache pages freed a while ago slow?

On a VM whose balloon reports free pages to the host (virtio-balloon free page reporting), a page the
guest freed more than ~2 s before is handed back, and the next write into it faults it in again. This
writes a file of ``--mb`` MB (no fsync inside the clock), fsyncs and unlinks it, ``--writes`` times
after each pause of ``--gaps`` seconds; then again after the longest pause, with the same bytes written
to a scratch file and unlinked just before (``bench/checkpoint_arms.recycle_pages``, what
``bench/checkpoint_cost.py`` does before every save arm). Finding: docs/benchmarks/checkpoint-cost.md,
"2026-12-02, afternoon".

    python bench/probes/freed_pages.py [--mb 39] [--gaps 0,0.5,1,3] [--writes 8] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoint_arms import _write_all, recycle_pages  # bench/checkpoint_arms.py


def one(path: Path, blob: bytes) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        _write_all(fd, blob)
        took = time.perf_counter() - t0
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(path)
    return took * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=39, help="MB a write (default 39: `small`'s checkpoint)")
    ap.add_argument("--gaps", default="0,0.5,1,3", help="pauses before each write, seconds (default 0,0.5,1,3)")
    ap.add_argument("--writes", type=int, default=8, help="writes after each pause (default 8)")
    ap.add_argument("--dir", help="directory on the disk to probe (default: a temporary directory)")
    args = ap.parse_args()
    try:
        gaps = [float(g) for g in args.gaps.split(",") if g]
    except ValueError:
        ap.error(f"--gaps: not a list of seconds: {args.gaps!r}")
    if not gaps or min(gaps) < 0 or args.mb < 1 or args.writes < 1:
        ap.error("need --mb >= 1, --writes >= 1 and --gaps of seconds >= 0")
    blob = os.urandom(args.mb << 20)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path, scratch = Path(d) / "write.bin", Path(d) / "scratch.bin"
        rows = [(f"{g:g} s", g, False) for g in gaps] + [(f"{max(gaps):g} s, pages recycled first", max(gaps), True)]
        for label, gap, recycle in rows:
            ms = []
            for _ in range(args.writes):
                time.sleep(gap)
                if recycle:
                    recycle_pages(scratch, blob)
                ms.append(one(path, blob))
            print(f"pause {label}: write median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms "
                  f"({', '.join(f'{x:.0f}' for x in ms)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
