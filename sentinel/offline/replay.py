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

import json
import math
import unicodedata
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from sentinel.offline import CUDA_ATOL, CUDA_RTOL, OfflineError, ProgressFn, same, tolerance_text

SNIPPET_CHARS = 80


# ------------------------------------------------------------------------------------ session


def local_env(device_pref: str = "auto"):
    """A single-process DistEnv (no process group), whatever WORLD_SIZE says."""
    from trainer.dist import DistEnv

    use_cuda = torch.cuda.is_available() if device_pref == "auto" else device_pref == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise OfflineError("the run was configured for CUDA but no GPU is available here")
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    return DistEnv(rank=0, local_rank=0, world_size=1, device=device)


def build_trainer(run_dir: Path, env=None, *, warn=None):
    """The run's model/optimizer/data/guard, built offline (no side effects on the run dir).
    Deterministic algorithms are switched on exactly as ``python -m trainer`` does."""
    from trainer.config import load_run_config
    from trainer.train import Trainer

    cfg = load_run_config(run_dir)
    if env is None:
        env = local_env(cfg.device)
    if cfg.deterministic:
        from trainer.determinism import make_deterministic

        make_deterministic(env.device.type)
    tr = Trainer(cfg, Path(run_dir), env, offline=True)
    tr.ckpt.log = warn or _stderr
    return tr


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def restore(tr, step: int) -> None:
    """Load exactly checkpoint ``step`` with the skip list it had (not the run dir's current one,
    which may have grown since): the state S_step as the run had it."""
    from trainer.data import SkipList

    tr.skip = SkipList(tr.cfg.data.skip)
    tr.load_checkpoint(step, restore_skiplist=True)


def param_digest(tr) -> str:
    """The param digest exactly as the trainer records it (``StepRecord.param_digest``)."""
    from trainer.telemetry.digest import digest_hex, param_digest_tensor

    d = param_digest_tensor(tr.raw_model.parameters())
    if tr.cfg.parallelism == "fsdp" and tr.env.distributed:
        dist.all_reduce(d)
    return digest_hex(d.tolist())


def gather(env, obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    out: list = [None] * env.world_size
    dist.all_gather_object(out, obj, group=env.control_group)
    return out


def device_kind(tr) -> str:
    return tr.env.device.type


def checkpoint_problem(e: Exception) -> str:
    """A CheckpointError as one line that says it is about a checkpoint."""
    msg = str(e)
    return msg if msg.startswith("no checkpoint") else f"checkpoint {msg}"


def check_ids(rec, step: int) -> list[int]:
    from trainer.data import batch_fingerprint

    ids = list(rec.sample_ids)
    if not ids:
        raise OfflineError(f"step {step} in the log has no sample_ids: this run's log cannot be replayed")
    if batch_fingerprint(ids) != rec.batch_fingerprint:
        raise OfflineError(
            f"step {step}: the recorded sample_ids do not match the recorded batch fingerprint "
            f"({batch_fingerprint(ids)} != {rec.batch_fingerprint}); the log is inconsistent"
        )
    return ids


def run_step(tr, ids: list[int], *, apply: bool) -> dict:
    """One optimizer step over global batch ``ids`` at the trainer's current step; host values."""
    micro, micro_ids = tr.micro_batches(ids)
    lr = tr.lr_for(tr.state.step, ids)
    loss, ranks, gnorm, factor, reason = tr.train_step(micro, micro_ids, lr, apply=apply)
    if apply:
        tr.state.step += 1
    return {"loss": float(loss.item()), "rank_losses": [float(x) for x in ranks.tolist()],
            "grad_norm": float(gnorm.item()), "lr": lr, "skipped": float(factor.item()) == 0.0,
            "reason": int(reason.item())}


# ------------------------------------------------------------------------------------ branches
#
# After a rollback (or a resume) the steps after the restored checkpoint are trained again on a new
# timeline, so one step number can have a record on an abandoned branch (often the damaged one the
# on-call engineer asks about) and another on the surviving branch. Each timeline's view of the run
# is its own lineage: the records of the timeline before it up to the step it restored, then its own.
# This is the same reading as ``authoritative_steps`` (a timeline record supersedes every later step
# of the timeline before it); the surviving branch is the last timeline of the log.


@dataclass
class Branch:
    """One timeline and the records its weights went through, step by step."""

    timeline: int
    kind: str  # start | resume | rollback (how the timeline began)
    parent: int | None  # the timeline whose state it restored; None for a fresh start
    from_step: int  # the checkpoint step it restored (0 for a fresh start)
    records: dict = field(default_factory=dict)  # step -> StepRecord: the ancestors' up to from_step, then its own (kept steps)
    first: int | None = None  # the branch's first and last step, kept or not
    last: int | None = None

    def trained(self, step: int) -> bool:
        """Did this timeline train ``step`` itself (rather than inherit the record of its parent)?"""
        return step in self.records and (self.parent is None or step > self.from_step)

    def span(self) -> str:
        return f"steps {self.first}..{self.last}" if self.last is not None else "no steps"


def branches(lines, keep=lambda step: True) -> dict[int, Branch]:
    """Every timeline of a steps.jsonl record sequence, in log order (the last one survives). Only
    the records of the steps ``keep`` says yes to are held (a long run's log is millions); the
    branches' structure and spans are the whole log's."""
    from sentinel.protocol import StepRecord, TimelineRecord

    out: dict[int, Branch] = {}
    cur: Branch | None = None
    for r in lines:
        if isinstance(r, TimelineRecord):
            parent = cur if r.kind != "start" else None  # a fresh start inherits no state
            prefix = {s: x for s, x in parent.records.items() if s <= r.from_step} if parent else {}
            cur = Branch(r.timeline, r.kind, parent.timeline if parent else None, r.from_step, prefix)
            if parent is not None and parent.first is not None and parent.first <= r.from_step:
                cur.first, cur.last = parent.first, min(parent.last, r.from_step)
            out.pop(r.timeline, None)  # keep log order if a timeline number is reused
            out[r.timeline] = cur
        elif isinstance(r, StepRecord):
            if cur is None:  # a log that does not begin with a timeline record
                cur = out[r.timeline] = Branch(r.timeline, "start", None, 0)
            if keep(r.step):
                cur.records[r.step] = r
            if cur.first is None:
                cur.first = r.step
            cur.last = r.step
    return out


def owner(views: dict[int, Branch], timeline: int, step: int) -> int | None:
    """The timeline whose training produced the state after ``step`` on ``timeline``'s branch (its
    checkpoint at ``step`` is that timeline's); None for a timeline the log does not know."""
    b = views.get(timeline)
    while b is not None and b.parent is not None and step <= b.from_step:
        b = views.get(b.parent)
    return None if b is None else b.timeline


def manifest_timeline(path: Path) -> int | None:
    """The timeline a checkpoint says it was written on (its manifest; verified later), or None."""
    try:
        t = json.loads((path / "manifest.json").read_bytes()).get("timeline")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return t if isinstance(t, int) and not isinstance(t, bool) else None


def on_branch(views: dict[int, Branch], timeline: int, ck_step: int, ck_timeline: int | None) -> bool:
    """Is checkpoint ``ck_step``, written on ``ck_timeline``, a state of ``timeline``'s branch? Yes when
    both lineages got the state after ``ck_step`` from the same timeline: the checkpoint a rollback
    restored is the common ancestor of both branches, one saved after the fork belongs to one only
    (a later timeline re-saving a step overwrites the abandoned branch's checkpoint). A checkpoint
    that names no timeline (older trainers) is taken for the surviving branch's, the last writer."""
    if ck_timeline is None:
        ck_timeline = next(reversed(views)) if views else timeline
    mine = owner(views, timeline, ck_step)
    return mine is not None and owner(views, ck_timeline, ck_step) == mine


def newest_on_branch(tr, at_or_before: int, fits) -> tuple:
    """``Checkpointer.newest_valid`` restricted to the checkpoints ``fits(step, timeline)`` accepts:
    (the newest valid one or None, "step (timeline T)" of each one passed over for its lineage).
    The lineage is read from the manifest before any sha256 is computed."""
    from trainer.checkpoint import CheckpointError, ValidCheckpoint, list_checkpoints, verify

    foreign: list[str] = []
    for s, path in list_checkpoints(tr.ckpt.root):
        if s > at_or_before:
            continue
        t = manifest_timeline(path)
        if not fits(s, t):
            foreign.append(f"{s} (timeline {t if t is not None else 'unnamed'})")
            continue
        try:
            return ValidCheckpoint(s, path, verify(path)), foreign
        except CheckpointError as e:
            if tr.env.is_main:
                tr.ckpt.log(f"warning: checkpoint {e}; falling back to the previous one")
    return None, foreign


def and_list(items) -> str:
    items = [str(x) for x in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def abandoned_by(views: dict[int, Branch], timeline: int, step: int) -> Branch | None:
    """The timeline that abandoned ``timeline``'s record of ``step``: the first later one that
    restored a checkpoint before the step (each timeline continues the one before it in the log)."""
    order = list(views)
    for b in (views[t] for t in order[order.index(timeline) + 1:]):
        if b.from_step < step:
            return b
    return None


def pick_branch(views: dict[int, Branch], run_dir: Path, step: int, timeline: int | None) -> tuple[int, dict]:
    """(branch, its records) to replay ``step`` on: ``timeline``'s, or by default the surviving one's.
    A step the chosen branch never reached is a one-line OfflineError that names where it is."""
    if not views:
        raise OfflineError(f"step {step} is not in the step log of {run_dir} (no steps)")
    elsewhere = [t for t, b in views.items() if b.trained(step)]
    if timeline is None:
        timeline = next(reversed(views))
        if step not in views[timeline].records:
            span = views[timeline].span()
            if elsewhere:
                ts = " or ".join(f"--timeline {t}" for t in elsewhere)
                raise OfflineError(f"step {step} is not on the surviving timeline {timeline} ({span}); it was trained "
                                   f"on abandoned timeline(s) {and_list(elsewhere)}: pass {ts} to replay it")
            raise OfflineError(f"step {step} is not in the step log of {run_dir} ({span})")
    elif timeline not in views:
        raise OfflineError(f"timeline {timeline} is not in the step log of {run_dir} (timelines {and_list(views)})")
    recs = views[timeline].records
    if step not in recs:
        where = f"; it was trained on timeline(s) {and_list(elsewhere)}" if elsewhere else ""
        raise OfflineError(f"step {step} is not on timeline {timeline} ({views[timeline].span()}){where}")
    return timeline, recs


def branch_warning(views: dict[int, Branch], step: int, timeline: int) -> str | None:
    """One line when ``step`` was trained on more than one timeline: which ones, which record is
    replayed, and how to replay the others. An abandoned record outside its own branch's loss band
    (or dropped by the guard) is called anomalous: that is the batch someone asking about a spike
    wants, and the default replays the surviving, usually healthy, one."""
    trained = [t for t, b in views.items() if b.trained(step)]
    if len(trained) < 2:
        return None
    rec = views[timeline].records[step]
    mine = rec.timeline if rec.timeline in trained else timeline
    surviving = views[next(reversed(views))].records.get(step)
    which = "the surviving" if surviving is rec else "the abandoned"
    head = (f"warning: step {step} was trained on timelines {and_list(trained)}: replaying {which} timeline {mine}'s "
            f"record (loss {rec.loss:.4g})")
    others = []
    for t in (t for t in trained if t != mine):
        r, by = views[t].records[step], abandoned_by(views, t, step)
        if r is surviving or by is None:
            others.append(f"timeline {t}'s is the surviving record (loss {r.loss:.4g}; replayed without --timeline)")
            continue
        odd = abnormal(r, loss_band(views[t].records, step))
        state = f"{'anomalous: ' if odd else ''}loss {r.loss:.4g}{', dropped by the guard' if r.skipped else ''}"
        others.append(f"timeline {t}'s was abandoned by a {by.kind} to step {by.from_step} ({state}): "
                      f"pass --timeline {t} to replay it")
    return head + "; " + "; ".join(others)


# ------------------------------------------------------------------------------------ culprits


def sanitize(text: str, limit: int = SNIPPET_CHARS) -> str:
    """A terminal-safe one-line snippet: newlines shown as a symbol, control characters replaced."""
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\u23ce")
        elif ch in "\t\r":
            out.append(" ")
        elif ch.isprintable() and not unicodedata.category(ch).startswith("M"):  # no combining marks
            out.append(ch)
        else:
            out.append("\u00b7")
    s = "".join(out)
    return s[:limit] + ("\u2026" if len(s) > limit else "")


def per_sample(tr, micro: list[torch.Tensor], micro_ids: list[list[int]], rng_state: dict) -> list[dict]:
    """This rank's per-sample mean token loss and gradient norm, under the RNG state of the step.

    The model runs unwrapped (no DDP hooks, no collectives): each sample's gradient is its own.
    Under FSDP the parameters are sharded, so only the losses are computed (grad_norm None).
    """
    from trainer import faults as drills
    from trainer import rng

    rng.restore(rng_state)
    model = tr.raw_model
    model.train()
    fsdp = tr.cfg.parallelism == "fsdp" and tr.env.distributed
    params = [p for p in model.parameters() if p.requires_grad]
    out: list[dict] = []
    for toks, mids in zip(micro, micro_ids):
        x, y = toks[:, :-1], toks[:, 1:]
        with torch.set_grad_enabled(not fsdp):
            with tr.autocast:
                _, tok_loss = model(x, y, reduction="none")
            # one row per sample id: under a seq_len schedule an id's window is several sequences (rows)
            per = tok_loss.float().view(len(mids), -1).mean(1)
            for r, sid in enumerate(mids):
                gn = None
                if not fsdp:
                    grads = torch.autograd.grad(per[r], params, retain_graph=r < len(mids) - 1, allow_unused=True)
                    norms = [torch.linalg.vector_norm(g.float()) for g in grads if g is not None]
                    gn = float(torch.linalg.vector_norm(torch.stack(norms)).item()) if norms else 0.0
                loss = float(per[r].item())
                if drills.poisons_loss(tr.cfg.faults, [sid]):
                    loss, gn = math.nan, (math.nan if gn is not None else None)
                out.append({"id": int(sid), "loss": loss, "grad_norm": gn, "rank": tr.env.rank})
        del per, tok_loss
    model.zero_grad(set_to_none=True)
    return out


RANK_BY = ("loss", "grad_norm")


def rank_culprits(samples: list[dict], by: str = "loss") -> list[dict]:
    """Order samples worst first by ``by`` (per-sample loss, or per-sample gradient norm); a
    non-finite value ranks first. ``score`` is the value over the batch median of that measure."""
    if by not in RANK_BY:
        raise OfflineError(f"cannot rank culprits by {by!r}; choose from {', '.join(RANK_BY)}")
    vals = sorted(s[by] for s in samples if s[by] is not None and math.isfinite(s[by]))
    med = (vals[(len(vals) - 1) // 2] + vals[len(vals) // 2]) / 2 if vals else 0.0
    for s in samples:
        v = s[by]
        if v is None:
            s["score"] = 0.0
        elif not math.isfinite(v):
            s["score"] = math.inf
        else:
            s["score"] = v / med if med else 0.0
    return sorted(samples, key=lambda s: (-s["score"], s["id"]))


def describe_sample(tr, sid: int, step: int) -> dict:
    """Where a sample lives, which data source (slice) it comes from, and what it says (the tokens
    as trained at ``step``: drills applied)."""
    from trainer import faults as drills

    seq = tr.cfg.model.seq_len
    shard, offset = tr.ds.locate(sid, seq)
    source = tr.ds.source_of(sid, seq)
    toks = tr.ds.get_many([sid], seq)
    toks = drills.corrupt_tokens(tr.cfg.faults, [sid], toks, tr.cfg.model.vocab_size)
    toks = drills.corrupt_source_tokens(tr.cfg.source_faults, step, [sid], [source], toks, tr.cfg.model.vocab_size)
    try:
        text = tr.ds.decode(toks[0])
    except Exception as e:  # a missing/odd tokenizer must not sink the report
        text = f"<undecodable: {e.__class__.__name__}>"
    return {"source": source, "shard": shard, "offset": int(offset), "text": sanitize(text)}


# ------------------------------------------------------------------------------------ the run's loss band

BAND_WINDOW = 10  # healthy steps the band is fitted on
BAND_SIGMAS = 4.0  # how far above the trend a loss must be to count as abnormal
BAND_MIN_REL = 0.10  # ... and never closer than 10% of the trend (a smooth stretch underestimates the noise)
ONSET_LOOKBACK = 50


def loss_band(records: dict, before: int, window: int = BAND_WINDOW) -> dict | None:
    """The run's loss band just before step ``before``: a least-squares line through the last
    ``window`` healthy losses (finite, not skipped; early training trends down) and a robust
    residual scale (1.4826 MAD). High outliers (an earlier spike) are dropped and the line refitted,
    so a spike does not widen the band it is judged by. None with fewer than 4 healthy steps."""
    pool = [(s, records[s].loss) for s in range(max(1, before - 4 * window), before)
            if s in records and not records[s].skipped and math.isfinite(records[s].loss)]
    band = None
    for _ in range(3):
        pts = pool[-window:]
        if len(pts) < 4:
            return band
        band = _fit(pts)
        high = {s for s, v in pts if v > band_at(band, s)[1]}
        if not high:
            return band
        pool = [p for p in pool if p[0] not in high]
    return band


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def _fit(pts: list[tuple[int, float]]) -> dict:
    """Theil-Sen line (median of pairwise slopes, median intercept): one spike in the window moves
    neither the trend nor the residual scale."""
    slopes = [(v2 - v1) / (s2 - s1) for i, (s1, v1) in enumerate(pts) for s2, v2 in pts[i + 1:] if s2 != s1]
    slope = _median(slopes) if slopes else 0.0
    mx = _median([s for s, _ in pts])
    my = _median([v - slope * (s - mx) for s, v in pts])
    resid = [v - (my + slope * (s - mx)) for s, v in pts]
    sigma = 1.4826 * _median([abs(r) for r in resid])
    return {"first": pts[0][0], "last": pts[-1][0], "n": len(pts), "mean_step": mx, "mean_loss": my, "slope": slope,
            "sigma": sigma}


def band_at(band: dict, step: int) -> tuple[float, float]:
    """(low, high) of the band at ``step`` (extrapolated at most one step past the fitted ones)."""
    x = min(step, band["last"] + 1)
    pred = band["mean_loss"] + band["slope"] * (x - band["mean_step"])
    width = max(BAND_SIGMAS * band["sigma"], BAND_MIN_REL * abs(pred))
    return pred - width, pred + width


def abnormal(rec, band: dict | None) -> bool:
    """Outside the band on the high side, non-finite, or dropped by the in-process guard."""
    if rec.skipped or not math.isfinite(rec.loss):
        return True
    return band is not None and rec.loss > band_at(band, rec.step)[1]


def find_onset(records: dict, step: int) -> int:
    """The first step of the anomaly that ``step`` belongs to (``step`` itself if the one before is
    normal): walk back while each earlier step is abnormal against the band before it."""
    onset = step
    while onset - 1 in records and step - onset < ONSET_LOOKBACK and \
            abnormal(records[onset - 1], loss_band(records, onset - 1)):
        onset -= 1
    return onset


def batch_on_weights(tr, ck_step: int, micro, micro_ids, lr) -> float:
    """The loss of one recorded batch on the weights of checkpoint ``ck_step`` (no update)."""
    restore(tr, ck_step)
    loss, _r, _g, _f, _reason = tr.train_step(micro, micro_ids, lr, apply=False)
    return float(loss.item())


# ------------------------------------------------------------------------------------ replay


# steps before the replayed one that its verdict reads: the onset walk-back and the loss band before it
CONTEXT_STEPS = ONSET_LOOKBACK + 4 * BAND_WINDOW + 2


def _window_start(run_dir: Path, step: int, checkpoint: int | None) -> int:
    """The first step whose record a replay of ``step`` may read: the checkpoint it restores
    (given, or the newest saved before the step; ``replay`` reads further back if that one is
    passed over), or the context of the verdict, whichever is earlier."""
    from sentinel.rundir import checkpoint_steps

    if checkpoint is None:
        checkpoint = next((s for s, _ in checkpoint_steps(run_dir) if s < step), 0)
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
        ck, foreign = newest_on_branch(tr, step - 1, fits)
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
    from trainer import rng
    from sentinel.client.steplog import read

    run_dir = Path(run_dir)
    if step < 1:
        raise OfflineError("steps are numbered from 1")
    lo = _window_start(run_dir, step, checkpoint)
    views = branches(read(run_dir / "steps.jsonl", rejected=[]), keep=lambda s: lo <= s <= step)  # skipped as open_run did
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
        views = branches(read(run_dir / "steps.jsonl", rejected=[]), keep=lambda s: lo <= s <= step)  # skipped as open_run did
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
    loss, ranks, gnorm, factor, reason = tr.train_step(micro, micro_ids, lr, apply=False)
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
        pre, _ = newest_on_branch(tr, onset - 2, fits)  # the same convention as rollback --before-step
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

    path = Path(run_dir) / "skiplist.json"
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
