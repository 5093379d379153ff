"""``sentinel replay-batch``: reproduce exactly the batch a run trained on at step N, offline.

Procedure (the spirit of Megatron's rerun machinery, done from a checkpoint):

0. Pick the branch: after a rollback a step can exist on an abandoned timeline and on the surviving
   one. The default is the surviving record (``authoritative_steps``); ``timeline`` picks another,
   and a warning names every timeline that trained the step (see "branches" below).
1. Restore the newest valid checkpoint C <= N-1 of that branch's own lineage (or the one asked
   for) into an offline :class:`trainer.train.Trainer` with the run's own config and world size;
   the checkpoint brings that branch's data cursor, skip list, guard and RNG state.
2. Fast-forward C+1 .. N-1 with the **recorded** sample ids of each step (that branch's records in
   steps.jsonl), checking every step's batch fingerprint, LR, loss, grad norm and guard verdict
   against the log, with ``train_step(apply=True)``.
3. Run step N's forward and backward with ``apply=False`` and compare loss and grad norm with the
   record: bitwise on CPU, within CUDA_RTOL on CUDA. Equal: *reproduced*, the cause is in the data
   plus the state. Different: *not reproduced*, a transient or hardware fault is suspected.
4. Culprits: re-seed every rank's RNG to its state just before step N (so dropout draws the same
   masks as the exact replay, which already happened and is unaffected), forward each micro-batch
   once with per-token losses, and take per sample the mean token loss and the L2 norm of the
   gradient of that sample's loss alone (one ``autograd.grad`` per sample). Each culprit carries
   its data source (the mixture slice it was drawn from), so a bad bucket shows as one name.

Every function here runs on every rank of a process group (or on a single in-process "rank") and
makes the same collective calls on each; results are gathered so every rank returns the same dict.
"""


from __future__ import annotations

import math
import os
from pathlib import Path

from sentinel.contract.rundir import SKIPLIST, STEPS
from sentinel.contract.targets import rollback_target
from sentinel.offline import CUDA_ATOL, CUDA_RTOL, OfflineError, ProgressFn, same, tolerance_text
from sentinel.offline.branches import (  # noqa: F401  (re-exported: replay's API)
    Branch,
    abandoned_by,
    and_list,
    branch_warning,
    branches,
    manifest_timeline,
    newest_on_branch,
    on_branch,
    owner,
    pick_branch,
)
from sentinel.offline.culprits import RANK_BY, describe_sample, per_sample, rank_culprits, sanitize  # noqa: F401
from sentinel.offline.loss_band import (  # noqa: F401
    BAND_MIN_REL,
    BAND_SIGMAS,
    BAND_WINDOW,
    ONSET_LOOKBACK,
    abnormal,
    band_at,
    batch_on_weights,
    find_onset,
    loss_band,
)
from sentinel.offline.session import (  # noqa: F401  (re-exported: verify and the CLI use them here)
    _stderr,
    build_trainer,
    check_ids,
    checkpoint_problem,
    device_kind,
    gather,
    local_env,
    param_digest,
    restore,
    run_step,
)

# ------------------------------------------------------------------------------------ replay


# steps before the replayed one that its verdict reads: the onset walk-back and the loss band before it
CONTEXT_STEPS = ONSET_LOOKBACK + 4 * BAND_WINDOW + 2


def _window_start(run_dir: Path, step: int, checkpoint: int | None) -> int:
    """The first step whose record a replay of ``step`` may read: the checkpoint it restores
    (given, or the newest saved before the step; ``replay`` reads further back if that one is
    passed over), or the context of the verdict, whichever is earlier."""
    from sentinel.rundir import checkpoint_steps

    if checkpoint is None:
        checkpoint = rollback_target([s for s, _ in checkpoint_steps(run_dir)], step, suspect_updates=1) or 0
    return max(0, min(checkpoint, step - CONTEXT_STEPS))


def pick_checkpoint(tr, views: dict[int, Branch], timeline: int, step: int, checkpoint: int | None, fits, note) -> int:
    """The checkpoint to restore: ``checkpoint`` if given, else the newest valid one before ``step``,
    either way one of ``timeline``'s branch. A checkpoint the surviving branch saved after a fork
    holds none of the abandoned branch's updates: fast-forwarding the abandoned records from it would
    replay a batch on weights that never trained it."""
    from trainer.checkpoint import CheckpointError

    if checkpoint is None:
        passed_over: list[str] = []
        tr.ckpt.log = passed_over.append
        ck, foreign = newest_on_branch(tr, step, fits, suspect_updates=1)  # the state step trained from
        tr.ckpt.log = note
        if ck is None:
            why = [m.removeprefix("warning: checkpoint ").split(";")[0] for m in passed_over]
            if foreign:
                why.append(f"{and_list(foreign)} not on timeline {timeline}'s branch")
            branch = f" of timeline {timeline}'s branch" if len(views) > 1 else ""
            raise OfflineError(f"no valid checkpoint{branch} at or before step {step - 1} in {tr.ckpt.root}"
                               + (f" ({'; '.join(why)})" if why else ""))
        for m in passed_over:
            note(m)
        if foreign:
            note(f"note: checkpoint(s) {and_list(foreign)} passed over: saved on another branch after it forked from "
                 f"timeline {timeline}'s; replaying from checkpoint {ck.step}")
        return ck.step
    if checkpoint >= step:
        raise OfflineError(f"checkpoint {checkpoint} is not before step {step}: replay needs the state before the step")
    try:
        ck = tr.ckpt.exact(checkpoint)
    except CheckpointError as e:
        raise OfflineError(checkpoint_problem(e)) from None
    t = manifest_timeline(ck.path)
    if not fits(ck.step, t):
        raise OfflineError(f"checkpoint {ck.step} was saved on timeline {t}, not on timeline {timeline}'s branch (a "
                           f"later save after the fork replaced it): it does not hold the state timeline {timeline} "
                           f"trained step {step} from")
    return ck.step


def replay(env, run_dir: Path, step: int, *, checkpoint: int | None = None, timeline: int | None = None,
           top_k: int = 5, rank_by: str = "loss", progress: ProgressFn | None = None, warn=None) -> dict:
    """Replay step ``step`` of the run in ``run_dir`` (see the module docstring); every rank returns
    the same result dict. ``timeline`` picks the branch whose record of the step is replayed (default:
    the surviving one); the checkpoint and the fast-forward come from that branch's own lineage."""
    from sentinel.client.steplog import read
    from trainer import rng

    run_dir = Path(run_dir)
    if step < 1:
        raise OfflineError("steps are numbered from 1")
    lo = _window_start(run_dir, step, checkpoint)
    views = branches(read(run_dir / STEPS, rejected=[]), keep=lambda s: lo <= s <= step)  # skipped as open_run did
    timeline, records = pick_branch(views, run_dir, step, timeline)
    rec = records[step]
    warnings: list[str] = []

    def note(msg: str) -> None:
        warnings.append(msg)
        if env.is_main:
            (warn or _stderr)(msg)

    def fits(ck_step: int, ck_timeline: int | None) -> bool:
        return on_branch(views, timeline, ck_step, ck_timeline)

    tr = build_trainer(run_dir, env, warn=note)
    if tr.global_batch != len(rec.sample_ids):
        raise OfflineError(f"step {step} trained {len(rec.sample_ids)} samples, but the run's config gives a global batch "
                           f"of {tr.global_batch} on {env.world_size} rank(s)")
    held: list[str] = []  # said once the checkpoint is settled: an error comes alone, as one line
    c = pick_checkpoint(tr, views, timeline, step, checkpoint, fits, held.append)
    if c < lo:  # newer checkpoints were invalid or on another branch: read the steps from this one too
        lo = c
        views = branches(read(run_dir / STEPS, rejected=[]), keep=lambda s: lo <= s <= step)  # skipped as open_run did
        timeline, records = pick_branch(views, run_dir, step, timeline)
        rec = records[step]
    tr.ckpt.log = note
    for m in filter(None, [branch_warning(views, step, timeline), *held]):
        note(m)
    missing = [s for s in range(c + 1, step) if s not in records]
    if missing:
        raise OfflineError(f"cannot fast-forward from checkpoint {c}: step {missing[0]} is missing from the step log")
    restore(tr, c)
    dev = device_kind(tr)
    ckpt_digest_ok = None
    if c in records and records[c].param_digest:
        ckpt_digest_ok = param_digest(tr) == records[c].param_digest
        if not ckpt_digest_ok:
            note(f"warning: checkpoint {c}'s parameters do not match the param digest the log recorded at step {c} "
                 "(a different checkpoint, or a log written with another digest function)")

    # --- fast-forward with the recorded batches
    ff_first_bad: dict | None = None
    total = step - c
    if progress:
        progress(0, total, f"fast-forward from checkpoint {c}")
    for s in range(c + 1, step):
        r = records[s]
        ids = check_ids(r, s)
        got = run_step(tr, ids, apply=True)
        bad = [k for k, want in (("loss", r.loss), ("grad_norm", r.grad_norm)) if not same(got[k], want, dev)]
        if got["lr"] != r.lr:
            bad.append("lr")
        if got["skipped"] != r.skipped:
            bad.append("skipped")
        if bad and ff_first_bad is None:
            ff_first_bad = {"step": s, "fields": bad, "replayed": {k: got[k] for k in ("loss", "grad_norm", "lr", "skipped")},
                            "recorded": {"loss": r.loss, "grad_norm": r.grad_norm, "lr": r.lr, "skipped": r.skipped}}
            note(f"warning: fast-forward diverged from the log at step {s} ({', '.join(bad)})")
        if progress:
            progress(s - c, total, f"fast-forward step {s}")

    # --- step N, exactly, without the update
    ids = check_ids(rec, step)
    rng_before = rng.capture()
    micro, micro_ids = tr.micro_batches(ids)
    lr = tr.lr_for(tr.state.step, ids)
    loss, ranks, gnorm, factor, _reason = tr.train_step(micro, micro_ids, lr, apply=False)
    replayed = {"loss": float(loss.item()), "grad_norm": float(gnorm.item()),
                "rank_losses": [float(x) for x in ranks.tolist()], "lr": lr,
                "skipped": float(factor.item()) == 0.0}
    if progress:
        progress(total, total, f"replayed step {step}")
    loss_ok = same(replayed["loss"], rec.loss, dev)
    gn_ok = same(replayed["grad_norm"], rec.grad_norm, dev)
    reproduced = bool(loss_ok and gn_ok and ff_first_bad is None)

    # --- is the batch the cause? A normal step has no culprits; an abnormal one is replayed on the
    # pre-onset weights: a normal loss there means the weights (an LR spike, a bad update) are to blame
    band = loss_band(records, step)
    batch = {"band": None, "normal": None, "onset": None, "pre_onset_checkpoint": None, "pre_onset_loss": None,
             "pre_onset_band": None, "is_cause": None}
    if band is not None:
        batch["band"] = [*band_at(band, step)]
        batch["normal"] = not abnormal(rec, band)
    culprits = []
    if batch["normal"] is not True:
        # culprits (after the exact replay; same RNG state as the replay had)
        mine = per_sample(tr, micro, micro_ids, rng_before)
        samples = [s for part in gather(env, mine) for s in part]
        ranked = rank_culprits(samples, rank_by)
        for s in ranked[:max(0, top_k)]:
            culprits.append({"id": s["id"], "loss": s["loss"], "grad_norm": s["grad_norm"], "score": s["score"],
                             "rank": s["rank"], **describe_sample(tr, s["id"], step)})
    if batch["normal"] is False:
        onset = find_onset(records, step)
        batch["onset"] = onset
        pre, _ = newest_on_branch(tr, onset, fits)  # the rule of rollback --before-step
        pre_band = loss_band(records, onset)
        if pre is not None and pre_band is not None:
            rng.restore(rng_before)
            pre_loss = batch_on_weights(tr, pre.step, micro, micro_ids, lr)
            lo, hi = band_at(pre_band, pre.step + 1)  # what a batch scored on those weights at the time
            batch.update(pre_onset_checkpoint=pre.step, pre_onset_loss=pre_loss, pre_onset_band=[lo, hi],
                         is_cause=bool(not math.isfinite(pre_loss) or pre_loss > hi))
            if not batch["is_cause"]:
                culprits = []

    if reproduced and batch["normal"] is True:
        verdict = (f"reproduced, and the batch is normal, no culprits: loss {rec.loss:.4g} is within the run's band "
                   f"(up to {batch['band'][1]:.4g})")
    elif reproduced and batch["is_cause"] is False:
        verdict = (f"reproduced, but the batch is not the cause: on the pre-onset weights (checkpoint "
                   f"{batch['pre_onset_checkpoint']}, before onset step {batch['onset']}) it gives a normal loss "
                   f"{batch['pre_onset_loss']:.4g} (band up to {batch['pre_onset_band'][1]:.4g}); the weights were "
                   f"damaged earlier: look at the LR and updates from step {batch['onset'] - 1} on")
    elif reproduced:
        verdict = ("reproduced: the recorded batch replayed from the checkpoint gives the same loss and grad norm; "
                   "the cause is in the data plus the training state (see the culprits)")
    elif ff_first_bad is not None:
        verdict = (f"not reproduced: the fast-forward already diverged from the log at step {ff_first_bad['step']}; "
                   "a transient or hardware fault (or a log/checkpoint mismatch) is suspected")
    else:
        verdict = ("not reproduced: the same data and state give a different loss/grad norm; "
                   "a transient or hardware fault is suspected")
    return {
        "run": rec.run,
        "step": step,
        "timeline": rec.timeline,
        "timelines": [t for t, b in views.items() if b.trained(step)],
        "checkpoint": c,
        "world_size": env.world_size,
        "device": dev,
        "tolerance": tolerance_text(dev),
        "rtol": CUDA_RTOL if dev == "cuda" else 0.0,
        "atol": CUDA_ATOL if dev == "cuda" else 0.0,
        "batch_fingerprint": rec.batch_fingerprint,
        "batch_size": len(ids),
        "recorded": {"loss": rec.loss, "grad_norm": rec.grad_norm, "lr": rec.lr, "skipped": rec.skipped,
                     "rank_losses": rec.rank_losses},
        "replayed": replayed,
        "match": {"loss": loss_ok, "grad_norm": gn_ok, "lr": lr == rec.lr, "skipped": replayed["skipped"] == rec.skipped},
        "fast_forward": {"steps": step - c - 1, "matched": ff_first_bad is None, "first_mismatch": ff_first_bad,
                         "checkpoint_matches_log": ckpt_digest_ok},
        "reproduced": reproduced,
        "verdict": verdict,
        "ranked_by": rank_by,
        "batch": batch,
        "lr_note": lr_note(records, step),
        "culprits": culprits,
        "warnings": warnings,
    }


def lr_note(records: dict, step: int) -> str | None:
    """Say so when the LR of ``step`` or the step before jumps against its neighbours (an LR spike
    damages the weights in its own update and shows in the loss one step later)."""
    for s in (step - 1, step):
        r, prev = records.get(s), records.get(s - 1)
        if r is None or prev is None or not prev.lr:
            continue
        ratio = r.lr / prev.lr
        if ratio > 1.5:
            return f"the LR of step {s} was {ratio:.3g}x the step before ({r.lr:.3g} vs {prev.lr:.3g})"
    return None


def add_to_skiplist(run_dir: Path, ids: list[int]) -> tuple[list[tuple[int, int]], int]:
    """Merge ``ids`` into RUN_DIR/skiplist.json; returns (ranges added, ids newly covered)."""
    from sentinel.protocol import ids_to_ranges
    from trainer.data import SkipList

    path = Path(run_dir) / SKIPLIST
    sl = SkipList.load(path)
    before = len(sl)
    ranges = ids_to_ranges(ids)
    sl.add(ranges)
    sl.save(path)
    return ranges, len(sl) - before


def send_skip_directive(run_dir: Path, run_id: str, ranges, *, reason: str) -> str:
    """If the run has a control bus (RUN_DIR/bus/url) and it answers, send a signed skip-samples
    Directive; returns a one-line status (never raises: the skip-list file is the must-have)."""
    url_file = Path(run_dir) / "bus" / "url"
    if not url_file.is_file() and not os.environ.get("SENTINEL_REDIS_URL"):
        return "no control bus for this run: skip list file updated only"
    try:
        from sentinel.bus import connect, load_secret, publish, resolve_url
        from sentinel.protocol import Directive, Keys

        url = resolve_url(run_dir)
        r = connect(url, timeout=1.0, retries=0)
        secret = load_secret(run_dir)
        d = Directive(run=run_id, kind="skip-samples", ranges=list(ranges), reason=reason,
                      issuer="sentinel replay-batch").signed(secret)
        publish(r, Keys(run_id).directives, d)
        return f"sent signed skip-samples directive {d.id[:8]} on the control bus"
    except Exception as e:  # the bus is optional here
        return f"control bus unreachable ({e.__class__.__name__}): skip list file updated only"
