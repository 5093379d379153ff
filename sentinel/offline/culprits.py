"""Per-sample culprits of a replayed step: each sample's loss and gradient norm alone, ranked, and
described (its source and a printable snippet of its text)."""

from __future__ import annotations

import math
import unicodedata

import torch

from sentinel.offline import OfflineError

SNIPPET_CHARS = 80


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
