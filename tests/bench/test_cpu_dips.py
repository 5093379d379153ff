"""bench/cpu_dips.py: the noisy machine on demand that ``bench/daemon_scale.py --cpu-dips`` runs a fleet in.

The spec's parsing on a table of good and hostile input, the quota's arithmetic, and one real cgroup:
this process is throttled inside it and leaves it as it was. The real part needs root and a cgroup CPU
controller (v1 or v2): it skips without them, and fails under CI (the project's CI machine has both).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from cpu_dips import PERIOD_US, CpuDips, DipError, DipSpec


@pytest.mark.parametrize(("text", "want"), [
    ("25:80:1.5", DipSpec(25.0, 80.0, 1.5)),
    ("1:10:0.02", DipSpec(1.0, 10.0, 0.02)),
    ("99:10000:600", DipSpec(99.0, 10000.0, 600.0)),
])
def test_a_spec_reads_duty_length_and_period(text, want):
    assert DipSpec.parse(text) == want


@pytest.mark.parametrize(("text", "says"), [
    ("25:80", "want DUTY:MS:EVERY"),
    ("25:80:1.5:9", "want DUTY:MS:EVERY"),
    ("x:80:1.5", "want DUTY:MS:EVERY"),
    ("", "want DUTY:MS:EVERY"),
    ("0:80:1.5", "the duty must be 1 to 99"),
    ("100:80:1.5", "the duty must be 1 to 99"),
    ("nan:80:1.5", "the duty must be 1 to 99"),
    ("25:5:1.5", "a dip must last 10 ms to 10 s"),
    ("25:20000:60", "a dip must last 10 ms to 10 s"),
    ("25:80:0.08", "come back after it ends"),
    ("25:80:inf", "a dip must last"),
])
def test_a_bad_spec_is_refused_in_one_line(text, says):
    with pytest.raises(ValueError, match=says) as e:
        DipSpec.parse(text)
    assert "\n" not in str(e.value)


def test_the_quota_is_the_duty_of_every_cpu_with_the_kernels_floor():
    assert DipSpec(25, 80, 1.5).quota_us(2) == 2 * PERIOD_US // 4
    assert DipSpec(50, 80, 1.5).quota_us(16) == 8 * PERIOD_US
    assert DipSpec(1, 80, 1.5).quota_us(1) == 1000  # 100 µs asked; the kernel takes 1 ms at least


def _cpu_group() -> str:
    return next(line for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.startswith("0::") or "cpu" in line.split(":")[1].split(","))


def test_inside_this_process_is_throttled_and_leaving_puts_everything_back():
    home = _cpu_group()
    try:
        dips = CpuDips(DipSpec(10, 300, 0.35))
        dips.__enter__()
    except DipError as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(str(e))
    group = dips._group.path
    try:
        assert str(os.getpid()) in (group / "cgroup.procs").read_text().split()
        spun, t = 0, time.monotonic()
        while time.monotonic() - t < 0.7:  # two dips' worth of the toggler's cycle, at full demand
            spun += 1
        stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
        assert int(stat["nr_throttled"]) > 0
    finally:
        dips.__exit__(None, None, None)
    assert not group.exists()
    assert _cpu_group() == home
    assert not dips._toggler.is_alive()
