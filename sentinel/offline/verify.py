"""``sentinel verify-resume``: prove that resuming from checkpoint C reproduces the run.

The full state at a step boundary is S_t = (params, Adam moments + step counts, scheduler step,
RNG of every rank, data cursor, grad-accumulation position, skip list, guard statistics). A resume
is *equivalent* when, under the same input and random state, the K steps after it match the
uninterrupted run in batch, loss, gradient norm and update (param digest).

1. Restore checkpoint C exactly (error if missing or corrupt), with the recorded world size.
2. Save->load->save round trip: re-save every component of the loaded state (model, optimizer,
   train_state, RNG) to a temp dir, load it back, and compare a sha256 over a canonical
   serialisation of its tensors/values with the original files' contents.
3. Run K steps with the trainer's own sampler (this tests the data cursor) and
   ``train_step(apply=True)``; compare each with the reference: the authoritative step log, or
   with ``drill`` an in-memory uninterrupted run from an earlier checkpoint past C+K.
4. Diagnose the first divergence: batch fingerprint -> data cursor; LR -> scheduler; loss/grad at
   C+1 -> params (checked directly against the digest recorded at C), else RNG when the model has
   dropout, else data/numerics; only the digest after an update -> optimizer moments (or step
   counts, checked directly); guard verdict -> guard statistics.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

from sentinel.contract.rundir import CKPT_DIR, STEPS, VERIFIED
from sentinel.offline import OfflineError, ProgressFn, same, tolerance_text
from sentinel.offline.replay import _stderr, build_trainer, checkpoint_problem, gather, param_digest, restore

FIELDS = ("batch_fingerprint", "lr", "loss", "grad_norm", "skipped", "param_digest")
# train_state keys that legitimately differ after a reload: the run id follows the run dir's name,
# the timeline is bumped by every resume, and the save time is the time of the save
VOLATILE_TRAIN_STATE = ("run", "timeline", "last_checkpoint_time")

COMPONENTS = {
    "data_cursor": "data cursor (sampler epoch/position, or the skip list)",
    "scheduler": "LR scheduler (step counter)",
    "params": "model parameters",
    "rng": "RNG state (dropout masks)",
    "data": "data content or non-deterministic numerics (params, cursor and RNG check out)",
    "optimizer": "optimizer moments (exp_avg / exp_avg_sq)",
    "optimizer_step": "optimizer step counts (Adam bias correction)",
    "guard": "step-guard statistics (the in-process skip decision)",
    "train_state": "the saved train state itself (train_state.json passes its checksum but not its schema)",
}


# ------------------------------------------------------------------------------------ digests


def canonical_digest(obj) -> str:
    """sha256 over a canonical serialisation: dict keys sorted, tensors as dtype + shape + raw
    bytes, scalars by type and repr. Equal for equal state, whatever the file bytes."""
    h = hashlib.sha256()

    def feed(o):
        if isinstance(o, torch.Tensor):
            t = o.detach().to("cpu").contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(o.shape)}:".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(o, dict):
            h.update(f"D{len(o)}:".encode())
            for k in sorted(o, key=lambda k: (type(k).__name__, str(k))):
                feed(k)
                feed(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(f"L{len(o)}:".encode())
            for x in o:
                feed(x)
        elif isinstance(o, float):
            h.update(f"f{o!r};".encode())
        elif isinstance(o, (bool, int, str, type(None))):
            h.update(f"{type(o).__name__}{o!r};".encode())
        else:
            h.update(f"{type(o).__name__}{o!r};".encode())

    feed(obj)
    return h.hexdigest()


def _components_now(tr) -> dict:
    """The loaded state, file by file, as the trainer would save it (its checkpoint pieces,
    ``trainer/state.py``); FSDP2 shards are not compared (DCP checks its own)."""
    shared, per_rank = tr.checkpoints.state.files()
    out = dict(shared) if tr.env.is_main else {}
    if "train_state.json" in out:
        out["train_state.json"] = {k: v for k, v in out["train_state.json"].items() if k not in VOLATILE_TRAIN_STATE}
    return {**out, **per_rank}


def round_trip(tr, ck_path: Path) -> dict:
    """Re-save each component of the state just loaded from ``ck_path`` to a temp dir, load it
    back, and compare its canonical digest with the original file's. Call right after loading."""
    from trainer.checkpoint_io import write_file
    from trainer.piece_files import load_file, piece_path

    now = _components_now(tr)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="sentinel-roundtrip-") as tmp:
        for name, obj in now.items():
            dst = Path(tmp) / name
            write_file(dst, obj)
            if name.endswith(".json"):
                again = json.loads(dst.read_text())
                orig = json.loads((ck_path / name).read_text())
                orig = {k: v for k, v in orig.items() if k not in VOLATILE_TRAIN_STATE}
            else:  # a checkpoint written before tensor files holds the same piece as torch's .pt
                again, orig = load_file(dst), load_file(piece_path(ck_path, name))
            a, b = canonical_digest(orig), canonical_digest(again)
            rows[name] = {"original": a[:16], "resaved": b[:16], "identical": a == b}
            if a != b and isinstance(orig, dict) and isinstance(again, dict):
                rows[name]["differs"] = sorted(
                    str(key) for key in set(orig) | set(again)
                    if key not in orig or key not in again or canonical_digest(orig[key]) != canonical_digest(again[key])
                )
    merged: dict = {}
    for part in gather(tr.env, rows):
        merged.update(part)
    return {"components": dict(sorted(merged.items())), "identical": all(r["identical"] for r in merged.values()),
            "ignored_train_state_keys": list(VOLATILE_TRAIN_STATE)}


# ------------------------------------------------------------------------------------ stepping


def _step(tr, number: int) -> dict:
    """One optimizer step exactly as ``Trainer._one_step`` does it (own sampler), host values.
    ``number`` is the step this should be (the trainer's own counter is what is being tested)."""
    from trainer.data import batch_fingerprint

    ids, _n_skipped, micro, micro_ids = tr.next_batch()
    lr = tr.lr_for(tr.state.step, ids)
    loss, _ranks, gnorm, factor, _reason = tr.train_step(micro, micro_ids, lr)
    tr.state.step += 1
    return {"step": number, "batch_fingerprint": batch_fingerprint(ids), "lr": lr,
            "loss": float(loss.item()), "grad_norm": float(gnorm.item()),
            "skipped": float(factor.item()) == 0.0, "param_digest": param_digest(tr), "sample_ids": ids}


def _skipped_since(run_dir: Path, tr):
    """The ids the run skips now (``skiplist.json``) that checkpoint C's skip list (loaded in ``tr``)
    does not: what a rollback or a skip directive added after C. The log's steps after such an
    addition trained without those samples, so it is no reference for a plain resume from C. None
    when the file cannot be read (then nothing is ruled out)."""
    from sentinel.rundir import RunDirError, read_skiplist
    from trainer.data import SkipList

    try:
        later = SkipList(read_skiplist(run_dir))
    except (OSError, RunDirError):
        return None
    later.remove(tr.skip.ranges)
    return later if len(later) else None


def _digests_incomparable(tr, records: dict, c: int) -> bool:
    """True when other checkpoints' parameters don't match their recorded digests either: then
    the digest function changed (not the parameters of checkpoint C). Loads model weights into
    ``tr``; the caller restores C afterwards."""
    from trainer.checkpoint import CheckpointError, list_checkpoints, verify
    from trainer.piece_files import load_file, piece_path

    if tr.cfg.parallelism == "fsdp" and tr.env.distributed:
        return False
    checked = 0
    for s, path in list_checkpoints(tr.ckpt.root):
        if s == c or s not in records or not records[s].param_digest or checked >= 2:
            continue
        try:
            verify(path)
            tr.raw_model.load_state_dict(load_file(piece_path(path, "model.safetensors")))
        except (CheckpointError, OSError, RuntimeError):
            continue
        checked += 1
        if param_digest(tr) == records[s].param_digest:
            return False
    return checked > 0


def _opt_step_count(tr) -> float | None:
    if tr.cfg.parallelism == "fsdp" and tr.env.distributed:
        return None
    for st in tr.opt.state.values():
        if "step" in st:
            return float(st["step"])
    return None


def _compare(got: dict, ref: dict, dev: str) -> list[str]:
    bad = []
    for k in FIELDS:
        want = ref.get(k)
        if want is None and k == "param_digest":
            continue  # not recorded at this step (param_digest_every)
        if k in ("loss", "grad_norm"):
            ok = same(got[k], want, dev)
        else:
            ok = got[k] == want
        if not ok:
            bad.append(k)
    return bad


# which component a differing key of a re-saved file points at (see round_trip)
_ROUND_TRIP_COMPONENT = {"scheduler": "scheduler", "step": "scheduler", "sampler": "data_cursor",
                         "skiplist": "data_cursor", "grad_accum_pos": "data_cursor", "guard": "guard",
                         "tokens": "data_cursor"}


def round_trip_divergence(rt: dict, c: int) -> dict:
    """The steps matched, but some saved state does not survive save->load->save: the checkpoint
    holds something the trainer ignores or rewrites on load (a tampered or inconsistent field).
    Name the component it belongs to."""
    for name, row in rt["components"].items():
        if row["identical"]:
            continue
        keys = row.get("differs") or []
        if name == "train_state.json":
            comp = next((_ROUND_TRIP_COMPONENT[k] for k in keys if k in _ROUND_TRIP_COMPONENT), "data_cursor")
        elif name.startswith("optim."):
            comp = "optimizer"
        elif name.startswith("rng-"):
            comp = "rng"
        else:
            comp = "params"
        where = f" ({', '.join(keys)})" if keys else ""
        return {"step": c, "fields": [f"{name}{where}"], "component": comp, "suspect": COMPONENTS[comp],
                "reason": f"{name}{where} of checkpoint {c} does not survive save->load->save: the trainer "
                          "ignores or rewrites what the file says, so a resume would not continue the run it recorded"}
    raise AssertionError("round_trip_divergence called on an identical round trip")


def diagnose(rows: list[dict], c: int, *, params_ok: bool | None, opt_step_ok: bool | None, dropout: float,
             sched_step: int | None = None) -> dict | None:
    """Name the state component behind the first divergence (None when every step matched)."""
    first = next((r for r in rows if r["mismatch"]), None)
    if first is None:
        return None
    s, bad = first["step"], set(first["mismatch"])
    if "batch_fingerprint" in bad:
        comp, why = "data_cursor", f"step {s} trained a different batch than the run did"
    elif "lr" in bad:
        comp, why = "scheduler", f"step {s} used LR {first['replayed']['lr']!r}, the run used {first['reference']['lr']!r}"
        if sched_step is not None and sched_step != c:
            why += f"; the checkpoint's step counter says {sched_step}, not {c}"
    elif bad & {"loss", "grad_norm"} and s == c + 1:
        if params_ok is False:
            comp, why = "params", f"the loaded parameters differ from the run's at step {c} (param digest)"
        elif dropout > 0:
            comp, why = "rng", (f"step {s} saw the same batch with the same parameters{' (digest verified)' if params_ok else ''}, "
                                f"yet its loss differs; the model has dropout {dropout}, so the random state differs")
        elif params_ok:
            comp, why = "data", f"same batch ids and verified parameters, yet step {s}'s loss differs (token content or numerics)"
        else:
            comp, why = "params", f"step {s} (the first after the resume) already differs in loss/grad norm with the same batch"
    elif bad & {"loss", "grad_norm"}:
        prev = next((r for r in rows if r["step"] == s - 1), None)
        if prev is not None and prev.get("reference", {}).get("param_digest") is None:
            # no digest to separate the update from the forward: the update before s is the suspect
            comp = "optimizer_step" if opt_step_ok is False else "optimizer"
            why = f"step {s - 1} matched but step {s} differs: the update of step {s - 1} differed (LR matched, so not the scheduler)"
        elif dropout > 0:
            comp, why = "rng", f"parameters matched after step {s - 1}, yet step {s}'s loss differs (model has dropout {dropout})"
        else:
            comp, why = "data", f"parameters matched after step {s - 1}, yet step {s}'s loss differs"
    elif "skipped" in bad:
        comp, why = "guard", f"the step guard decided differently at step {s} on the same loss and grad norm"
    elif "param_digest" in bad:
        comp = "optimizer_step" if opt_step_ok is False else "optimizer"
        why = (f"step {s}'s loss and grad norm match, but the parameters after its update differ "
               f"(LR matched, so not the scheduler)")
        if opt_step_ok is False:
            why += "; the optimizer's step counts disagree with the number of applied steps in the log"
    else:  # pragma: no cover - every field is handled above
        comp, why = "params", f"step {s} differs in {', '.join(sorted(bad))}"
    return {"step": s, "fields": sorted(bad), "component": comp, "suspect": COMPONENTS[comp], "reason": why}


def verify_resume(env, run_dir: Path, from_step: int, *, steps: int = 5, drill: bool = False,
                  progress: ProgressFn | None = None, warn=None) -> dict:
    """Verify the resume from checkpoint ``from_step``; every rank returns the same result dict."""
    from sentinel.client.steplog import scan
    from sentinel.rundir import checkpoint_steps
    from trainer.checkpoint import CheckpointError

    run_dir = Path(run_dir)
    c = int(from_step)
    if steps < 1:
        raise OfflineError("--steps must be at least 1")
    # the steps compared and the checkpoints' recorded digests; the rest of a long log is only counted
    saved = {s for s, _ in checkpoint_steps(run_dir)}
    # unreadable lines are skipped, as open_run skipped them (the CLI said so)
    log = scan(run_dir / STEPS, keep=lambda s: c <= s <= c + steps + 1 or s in saved, applied_upto=c, rejected=[])
    records = log.records
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        if env.is_main:
            (warn or _stderr)(msg)

    tr = build_trainer(run_dir, env, warn=note)
    try:
        ck = tr.ckpt.exact(c)
    except CheckpointError as e:
        if STATE_INCONSISTENT.search(str(e)):  # checksums fine, the saved state contradicts itself: not a resume
            return unresumable(tr, env, c, str(e), notes)
        raise OfflineError(checkpoint_problem(e)) from None
    dev = tr.env.device.type
    dropout = float(tr.cfg.model.dropout)

    # ---------------------------------------------------------------- the reference trajectory
    ref: dict[int, dict] = {}
    ref_digest_c: str | None = records[c].param_digest if c in records else None
    k = steps
    if not drill:
        k = 0
        while k < steps and (c + k + 1) in records:
            k += 1
        if k == 0:
            raise OfflineError(f"the step log has no steps after checkpoint {c}; use --drill to make a reference in memory")
        for s in range(c + 1, c + k + 1):
            r = records[s]
            ref[s] = {"batch_fingerprint": r.batch_fingerprint, "lr": r.lr, "loss": r.loss, "grad_norm": r.grad_norm,
                      "skipped": r.skipped, "param_digest": r.param_digest}
        if k < steps:
            note(f"note: the log has only {k} step(s) after checkpoint {c}; verifying {k}")
        reference = "log"
        if (c + 1) in records and c in records and records[c + 1].timeline != records[c].timeline:
            reference = "log (itself written after a restart at this checkpoint)"
    else:
        older = tr.ckpt.newest_valid(at_or_before=c - 1) if c > 0 else None
        start = older.step if older is not None else 0
        if older is not None:
            restore(tr, start)
        else:
            from trainer.data import SkipList

            tr.skip = SkipList(tr.cfg.data.skip)  # the initial state, exactly as a fresh start
        total = c + k - start
        if progress:
            progress(0, total, f"drill: uninterrupted run from {'checkpoint ' + str(start) if start else 'the initial state'}")
        for i in range(total):
            got = _step(tr, start + i + 1)
            if got["step"] == c:
                ref_digest_c = got["param_digest"]
            if got["step"] > c:
                ref[got["step"]] = {key: got[key] for key in FIELDS}
            if progress:
                progress(i + 1, total, f"drill: reference step {got['step']}")
        reference = f"in-memory uninterrupted run from {'checkpoint ' + str(start) if start else 'step 0'}"

    # ---------------------------------------------------------------- resume from C
    restore(tr, c)
    rt = round_trip(tr, ck.path)
    params_ok = (param_digest(tr) == ref_digest_c) if ref_digest_c else None
    if params_ok is False and not drill and _digests_incomparable(tr, records, c):
        note("note: no checkpoint of this run matches the param digest its log recorded: the log was written "
             "with a different digest function, so updates are compared through losses and grad norms only")
        params_ok = None
        for r in ref.values():
            r["param_digest"] = None
        restore(tr, c)
    opt_steps = _opt_step_count(tr)
    opt_step_ok = None
    applied = log.applied()  # None when a step up to C has no record
    if opt_steps is not None and not drill and applied is not None:
        opt_step_ok = opt_steps == float(applied)
    loaded_step = tr.state.step
    sched_ok = loaded_step == c

    rows = []
    later = None if drill else _skipped_since(run_dir, tr)
    if progress:
        progress(0, k, f"resume from checkpoint {c}")
    for i in range(k):
        got = _step(tr, c + i + 1)
        ids = got.pop("sample_ids")  # not part of the report (a batch's worth of ids per row)
        want = ref[got["step"]]
        mismatch = _compare(got, want, dev)
        if "batch_fingerprint" in mismatch and later is not None and later.contains_many(ids).any():
            if not rows:
                raise OfflineError(f"step {got['step']} of the log did not train samples that were added to the run's "
                                   f"skip list after checkpoint {c} (by a rollback or a skip directive): the log is no "
                                   "reference for a plain resume from it; use --drill")
            note(f"note: from step {got['step']} on, the log did not train samples that were added to the run's skip "
                 f"list after checkpoint {c} (by a rollback or a skip directive): verifying the {len(rows)} step(s) before")
            break
        rows.append({"step": got["step"], "replayed": got, "reference": want, "mismatch": mismatch})
        if progress:
            progress(i + 1, k, f"resumed step {got['step']}")
    k = len(rows)
    first = diagnose(rows, c, params_ok=params_ok, opt_step_ok=opt_step_ok, dropout=dropout, sched_step=loaded_step)
    if first is not None and dev == "cuda" and not tr.cfg.deterministic:
        first["reason"] += ("; this run has deterministic: false, so its CUDA kernels (the fused attention's "
                            "backward) do not repeat bit for bit and no resume can match its parameter digests: "
                            "set deterministic: true for bitwise resumes (slower: docs/benchmarks.md, 'On an H100')")
    if first is None and params_ok is False:
        first = {"step": c, "fields": ["param_digest"], "component": "params", "suspect": COMPONENTS["params"],
                 "reason": f"the loaded parameters differ from the digest recorded at step {c}"}
    if first is None and not sched_ok:
        # e.g. in a constant-LR phase a wrong step counter gives the same LRs for a while: still not a resume
        first = {"step": c, "fields": ["step"], "component": "scheduler", "suspect": COMPONENTS["scheduler"],
                 "reason": f"the checkpoint's step counter says {loaded_step}, not {c} (LRs and step numbers "
                           "after the resume would be off)"}
    if first is None and not rt["identical"]:
        first = round_trip_divergence(rt, c)
    equivalent = first is None
    return {
        "run": tr.run_id,
        "from_step": c,
        "steps": k,
        "world_size": env.world_size,
        "device": dev,
        "tolerance": tolerance_text(dev),
        "reference": reference,
        "drill": drill,
        "equivalent": equivalent,
        "round_trip": rt,
        "ok": equivalent,
        "first_divergence": first,
        "checks": {"params_match_log_at_checkpoint": params_ok, "optimizer_step_count_ok": opt_step_ok,
                   "scheduler_step_ok": sched_ok, "model_dropout": dropout},
        "rows": [{"step": r["step"], "mismatch": r["mismatch"],
                  **{f"{f}": r["replayed"][f] for f in FIELDS},
                  **{f"ref_{f}": r["reference"].get(f) for f in FIELDS}} for r in rows],
        "notes": notes,
    }


# the loader's one-line verdicts on a checksum-valid checkpoint whose state does not hold together
STATE_INCONSISTENT = re.compile(r"train_state\.json (is malformed|says step)")
_STATE_KEYWORDS = (("scheduler", "scheduler"), ("says step", "scheduler"), ("sampler", "data_cursor"),
                   ("cursor", "data_cursor"), ("skiplist", "data_cursor"), ("guard", "guard"), ("optim", "optimizer"))


def unresumable(tr, env, c: int, problem: str, notes: list[str]) -> dict:
    """The verdict for a checkpoint the trainer refuses to load because its saved state is
    inconsistent (e.g. a scheduler step that disagrees with the step counter): NOT equivalent, with
    the component named, rather than a bad-input error: the checkpoint exists and verifies, but a
    resume from it cannot continue the run."""
    comp = next((c_ for kw, c_ in _STATE_KEYWORDS if kw in problem), "train_state")
    first = {"step": c, "fields": ["train_state.json"], "component": comp, "suspect": COMPONENTS[comp],
             "reason": f"the trainer refuses to resume from it: {problem}"}
    return {"run": tr.run_id, "from_step": c, "steps": 0, "world_size": env.world_size, "device": tr.env.device.type,
            "tolerance": tolerance_text(tr.env.device.type), "reference": "none (the checkpoint does not load)",
            "drill": False, "equivalent": False, "ok": False, "first_divergence": first,
            "round_trip": {"components": {}, "identical": False, "ignored_train_state_keys": list(VOLATILE_TRAIN_STATE)},
            "checks": {"params_match_log_at_checkpoint": None, "optimizer_step_count_ok": None,
                       "scheduler_step_ok": None, "model_dropout": float(tr.cfg.model.dropout)},
            "rows": [], "notes": notes}


def mark_verified(run_dir: Path, step: int, ok: bool, extra: dict | None = None) -> Path:
    """Record the outcome in RUN_DIR/checkpoints/verified.json ({step: {"verified", "time", ...}})."""
    path = Path(run_dir) / CKPT_DIR / VERIFIED
    data: dict = {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[str(int(step))] = {"verified": "resume_verified" if ok else "failed", "time": time.time(), **(extra or {})}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return path

