"""Random step logs with rollbacks, resumes and guard skips."""

from __future__ import annotations

import random

from sentinel.protocol import StepRecord, TimelineRecord


def random_log(rng: random.Random, path):
    recs, step, timeline = [TimelineRecord(kind="start", run="r", from_step=0, timeline=0, time=1.0)], 0, 0
    for _ in range(rng.randint(1, 8)):
        for _ in range(rng.randint(0, 60)):
            step += 1
            recs.append(StepRecord(run="r", step=step, timeline=timeline, loss=3.0 + rng.random(), loss_max_rank=3.5, grad_norm=1.0,
                                   lr=1e-3, tokens=step, batch_fingerprint="ab", skipped=rng.random() < 0.1, time=float(step),
                                   world_size=rng.choice([1, 2])))
        if step and rng.random() < 0.8:
            timeline += 1
            step = rng.randint(0, step)
            recs.append(TimelineRecord(kind=rng.choice(["rollback", "resume"]), run="r", from_step=step, timeline=timeline,
                                       time=float(step)))
    path.write_text("".join(r.to_json() + "\n" for r in recs))
    return recs
