"""Plain-text training logs: the lines a trainer prints, read as trace lines.

Most runs leave a text log before anything else: the stdout of ``torchrun`` or a Slurm job. This
finds the training steps in it, so ``sentinel backtest train.log`` needs no export first:

- modded-nanogpt: ``step:125/1770 train_loss:4.0235 train_time:20011ms step_avg:160.09ms``
- nanoGPT: ``iter 125: loss 4.0235, time 160.09ms, mfu 31.20%``
- Megatron-LM: ``iteration      125/  500000 | ... | lm loss: 4.023500E+00 | loss scale: 1.0 | grad norm: 1.234 |``
- ``key=value`` logs: ``step=125 loss=4.0235 grad_norm=1.23``, with ``train/loss``, ``train_loss`` too
- torchtitan: ``step: 125  loss:  4.0235  memory: 12.34GiB(15.67%)  tps: 1,234``, colour codes and all
- a block whose step header and loss are on separate lines (``[step=125/739328]`` then
  ``train/loss=4.0235``, or OLMo-core's ``train/CE loss=4.0235``): the loss belongs to the step
  header before it that has none yet.

A line is a step when it (or its block) names a step (``step``, ``iter``, ``iteration``,
``global_step``, followed by ``:``, ``=`` or spaces and a whole number, ``/total`` allowed) and a
*training* loss (``loss``, ``lm loss``, ``train_loss``, ``train/loss``, ``training_loss``, ...). A
loss whose key says validation (``val_loss``, ``val loss``, ``eval/loss``, ``valid``, ``test``)
is not one, and a line that carries one is an evaluation summary (nanoGPT's ``step 250: train loss
3.9, val loss 4.0`` is an estimate over many batches, not a step): it gives no step. Every other
line (the banner, the config, the code some trainers print first, warnings) is not a step and is
passed over without a count; a file in which no line is a step is an error, as an empty trace is.

Also read when present: ``grad norm`` / ``grad_norm``, ``lr`` / ``learning rate``, and a clock:
modded-nanogpt's cumulative ``train_time:NNNms``, else a timestamp at the start of the line
(``2024-05-01 12:00:00,123``, as Python's logging writes it; after a short prefix such as
``[rank0]:[titan]`` too). A per-iteration time (nanoGPT's
``time 160ms``) is no clock and is not used; without a clock the step number stands in for time.
Only the first ``MAX_LINE`` characters of a line are searched (a hostile megabyte line costs no
more than a normal one).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from typing import Any

MAX_LINE = 4096

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf(?:inity)?))"
_SEP = r"\s*[:=]?\s*"
# a step key not inside another word ("substep", "steps_per_epoch"), then its number (and /total)
_STEP = re.compile(r"(?<![\w/.-])(?:global_step|iteration|iter|step)" + r"\s*[:=]?\s*(\d+)(?:\s*/\s*\d+)?(?![\w.])", re.I)
# a loss key: an optional "train"/"lm" qualifier; a key inside another word ("val_loss") is not one
_LOSS = re.compile(r"(?<![\w/.-])((?:train(?:ing)?[ _/])?(?:lm[ _])?loss)" + _SEP + _NUM + r"(?![\w.])", re.I)
# keys that make a loss a validation one, when they come right before it
_EVAL_LOSS = re.compile(r"(?<![\w])(?:val|valid|validation|eval|test)[ _/]?(?:lm[ _])?loss" + _SEP + _NUM, re.I)
_GRAD = re.compile(r"(?<![\w/.-])grad(?:ient)?[ _]norm" + _SEP + _NUM + r"(?![\w.])", re.I)
_LR = re.compile(r"(?<![\w/.-])(?:lr|learning[ _]rate)" + _SEP + _NUM + r"(?![\w.])", re.I)
_TRAIN_TIME = re.compile(r"(?<![\w/.-])train_time\s*[:=]\s*(\d+(?:\.\d+)?)ms", re.I)
# a log timestamp near the start of the line (after a short prefix such as torchtitan's "[rank0]:[titan] ")
_STAMP = re.compile(r"^.{0,24}?(?<!\d)(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)(?:[.,](\d{1,6}))?")
# terminal colour and cursor codes (torchtitan colours its step lines): not part of any key
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _float(s: str) -> float:
    return float(s.lower().replace("infinity", "inf"))


def _clock(line: str) -> float | None:
    m = _TRAIN_TIME.search(line)
    if m:
        return float(m.group(1)) / 1000.0
    m = _STAMP.match(line)
    if m:
        try:
            t = datetime.strptime(f"{m.group(1)} {m.group(2)}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc)
        except ValueError:
            return None
        return t.timestamp() + (float("0." + m.group(3)) if m.group(3) else 0.0)
    return None


def _extras(line: str, obj: dict[str, Any]) -> None:
    """Grad norm, lr and the clock of ``line``, where it has them, into ``obj``."""
    for pat, key in ((_GRAD, "grad_norm"), (_LR, "lr")):
        m = pat.search(line)
        if m:
            v = _float(m.group(1))
            if math.isfinite(v):
                obj[key] = v
    t = _clock(line)
    if t is not None and math.isfinite(t):
        obj["time"] = t


def text_rows(lines: Iterable[bytes], path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, trace-line dict) for each training step found in a text log."""
    header: tuple[int, dict[str, Any]] | None = None  # a step named on a line with no loss yet
    for n, raw in enumerate(lines, 1):
        line = raw[:MAX_LINE].decode("utf-8", errors="replace")
        if "\x1b" in line:
            line = _ANSI.sub("", line)
        if _EVAL_LOSS.search(line):
            header = None  # an evaluation summary: no step, and no loss for a header before it
            continue
        s = _STEP.search(line)
        loss = _LOSS.search(line)
        if s is not None and loss is None:
            header = (n, {"step": int(s.group(1))})
            _extras(line, header[1])
            continue
        if loss is None:
            continue
        if s is not None:
            obj: dict[str, Any] = {"step": int(s.group(1))}
        elif header is not None:
            n, obj = header  # the loss line of a block: reported at its header's line
        else:
            continue  # a loss with no step to give it (a progress print, a summary)
        header = None
        obj["loss"] = _float(loss.group(2))
        _extras(line, obj)
        yield n, obj


def looks_like_text_log(first_line: bytes) -> bool:
    """Does a file's first line read as a trainer's log rather than a CSV header: a step line
    (``step:1/100 loss:...``, ``iter 1: loss ...``), a step header (``[step=1/100,epoch=1]``), or a
    line that starts with a log timestamp (a CSV header names columns; it is no date)?"""
    line = _ANSI.sub("", first_line[:MAX_LINE].decode("utf-8", errors="replace"))
    return _STEP.search(line) is not None or _STAMP.match(line) is not None
