"""On CUDA, a training step adds no host-device sync (docs/metrics.md, "Host-device syncs per step").

``torch.cuda.set_sync_debug_mode("error")`` turns every synchronizing CUDA call (``.item()``,
``.cpu()``, a blocking copy, ``torch.cuda.synchronize``) into an exception. After a few warm-up
steps (allocator, cuBLAS handles, pinned-memory pool, the first lagged readback), steps run under
it: telemetry and the step log must come from the one-step-lagged pinned copies.

Needs a CUDA device: on CPU-only machines there is no device queue to sync with, so it is skipped.
Run it on a GPU machine with ``pytest tests/trainer/test_cuda_sync.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (no host-device syncs to count on CPU)")


def _mixture(root):
    """Three small sources: the per-source loss path (one-hot upload, [sources] sums in the gather)."""
    from trainer.data import parse_source, prepare_dataset

    specs = []
    for k, letters in enumerate(("abcdefgh", "mnopqrst", "0123456789")):
        d = root / f"src{k}"
        d.mkdir(parents=True)
        (d / "doc.txt").write_text((" ".join(letters[i % len(letters)] * (1 + i % 5) for i in range(4000)) + "\n") * 4)
        specs.append(parse_source(f"s{k}={d}:1"))
    prepare_dataset(root / "mix", sources=specs)
    return root / "mix"


@pytest.mark.parametrize("telemetry,mixture", [(False, False), (True, False), (True, True)])
def test_training_steps_do_not_sync(tmp_path, telemetry, mixture):
    from trainer import dist as tdist
    from trainer.config import resolve
    from trainer.data import ensure_prepared
    from trainer.train import Trainer

    data = _mixture(tmp_path) if mixture else ensure_prepared(tmp_path / "data")
    cfg = resolve(preset="tiny", overrides={
        "data.dir": str(data), "max_steps": 20, "checkpoint.every": 0, "eval.every": 0,
        "telemetry.enabled": telemetry, "telemetry.peak_flops": 1e12, "device": "cuda",
    })
    tr = Trainer(cfg, tmp_path / "run", tdist.init("cuda"))
    tr.start()
    tr.model.train()
    for _ in range(4):  # warm-up
        tr._one_step(0.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            tr._one_step(0.0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tr._flush_readback()
    from sentinel.client.steplog import authoritative

    steps = authoritative(tmp_path / "run" / "steps.jsonl")
    assert sorted(steps)[-1] == 12 and all(r.loss == r.loss for r in steps.values())
    if mixture:
        assert all(r.source_loss and set(r.source_loss) <= {"s0", "s1", "s2"} for r in steps.values())
