"""`sentinel replay-batch`: replay the exact batch of one step offline and name the culprit samples."""

from __future__ import annotations

import math
import re

import click

from sentinel.cli.common import SentinelError, emit_json, friendly_errors, is_tty, json_option, make_progress, not_empty


def parse_checkpoint(value: str | None, flag: str = "--checkpoint") -> int | None:
    """A checkpoint id: a step number (``20``) or its directory name (``step-00000020``)."""
    if value is None:
        return None
    m = re.fullmatch(r"(?:step-)?0*(\d{1,18})", value.strip())  # a step past 10^18 is no checkpoint (and int() refuses 4300+ digits)
    if not m:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise SentinelError(f"{flag} {shown!r}: expected a step number or step-NNNNNNNN")
    return int(m.group(1))


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return repr(x) if math.isfinite(x) else str(x)
    return str(x)


@click.command("replay-batch")
@click.argument("run", metavar="RUN", callback=not_empty)
@click.option("--step", "step", required=True, type=click.IntRange(min=1), help="The step whose batch to replay.")
@click.option("--checkpoint", "checkpoint", default=None, metavar="ID",
              help="Start from this checkpoint (a step number); default: the newest valid one before the step.")
@click.option("--timeline", "timeline", default=None, type=click.IntRange(min=0), metavar="T",
              help="Replay the step as timeline T trained it (after a rollback a step exists on the abandoned "
                   "branch and on the surviving one); default: the surviving record. The checkpoint comes from "
                   "T's own lineage.")
@click.option("--top", "top_k", default=5, show_default=True, type=click.IntRange(min=0), help="How many culprit samples to name.")
@click.option("--rank-by", "rank_by", type=click.Choice(["loss", "grad_norm"]), default="loss", show_default=True,
              help="Rank culprits by per-sample loss or by per-sample gradient norm.")
@click.option("--skip-culprits", is_flag=True, help="Add the top culprits to the run's skip list (and send a signed "
              "skip-samples directive when the run's control bus answers).")
@json_option
@friendly_errors
def replay_batch(run: str, step: int, checkpoint: str | None, timeline: int | None, top_k: int, rank_by: str,
                 skip_culprits: bool, as_json: bool) -> None:
    """Replay exactly the batch RUN trained on at --step, offline, and name its culprit samples.

    Restores the newest valid checkpoint before the step, fast-forwards with the recorded sample ids
    of every step in between (checking each against the log), then runs the step's forward and
    backward without the update. Equal loss and grad norm (bitwise on CPU, rtol 1e-3 on CUDA) means
    *reproduced*: the cause is in the data plus the state. Otherwise a transient or hardware fault
    is suspected. Per-sample losses and gradient norms name the culprits (id, data source, shard,
    offset, text).
    Multi-rank runs are replayed on the same number of ranks (torchrun).
    A step trained on more than one timeline (a rollback abandoned the first) is named in a warning;
    --timeline picks the abandoned branch's record.
    """
    from sentinel.offline import OfflineError, launch_workers, open_run, precheck_checkpoint

    ck = parse_checkpoint(checkpoint)
    try:
        log = open_run(run, keep=lambda s: s == step)
        log.warn_rejected()
        if timeline is None and step not in log.records:
            raise OfflineError(_not_surviving(log, step))
        if ck is not None and ck >= step:
            raise OfflineError(f"checkpoint {ck} is not before step {step}: replay needs the state before the step")
        bar, report = make_progress(not as_json and is_tty())
        try:
            if bar is not None:
                bar.start()
            if log.world_size > 1:
                precheck_checkpoint(log.run_dir, exact=ck, before=step - 1)
                argv = ["replay", str(log.run_dir), "--step", str(step), "--top", str(top_k), "--rank-by", rank_by]
                if ck is not None:
                    argv += ["--checkpoint", str(ck)]
                if timeline is not None:
                    argv += ["--timeline", str(timeline)]
                res = launch_workers(log.world_size, argv, progress=report)
                for m in res.get("warnings", []):  # the workers' stderr went to their log file
                    click.echo(m, err=True)
            else:
                res = _in_process(log.run_dir, step, ck, timeline, top_k, rank_by, report)
        finally:
            if bar is not None:
                bar.stop()
    except OfflineError as e:
        raise SentinelError(str(e)) from None

    from sentinel.rundir import RunDirError

    failed = None
    if skip_culprits:
        try:
            res["skip"] = _skip(log, res, top_k)
        except (SentinelError, OSError, RunDirError) as e:  # a read-only run dir: the verdict is still worth printing
            failed = e if isinstance(e, SentinelError) else SentinelError(
                f"could not add the culprits to the skip list: {getattr(e, 'strerror', None) or e}")
            res["skip"] = {"status": "failed", "detail": str(failed)}
    if as_json:
        emit_json(res)
    else:
        _render(res)
    if failed is not None:
        raise failed


def _not_surviving(log, step: int) -> str:
    """Why ``step`` cannot be replayed by default: absent from the log, or only on abandoned
    timelines (then: which, and the --timeline that replays it). Torch-free, before any replay."""
    from sentinel.client.steplog import read
    from sentinel.contract.rundir import STEPS
    from sentinel.protocol import StepRecord

    log_path = log.run_dir / STEPS
    gone = sorted({r.timeline for r in read(log_path, rejected=[]) if isinstance(r, StepRecord) and r.step == step})
    if not gone:
        return f"step {step} is not in the step log of {log.run_dir} ({log.span()})"
    return (f"step {step} is not on the surviving timeline ({log.span()}); it was trained on abandoned timeline(s) "
            f"{', '.join(map(str, gone))}: pass {' or '.join(f'--timeline {t}' for t in gone)} to replay it")


def _in_process(run_dir, step, ck, timeline, top_k, rank_by, report):
    from sentinel.offline import OfflineError
    from sentinel.offline.replay import replay
    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.train import TrainingError

    try:
        return replay(_env(run_dir), run_dir, step, checkpoint=ck, timeline=timeline, top_k=top_k, rank_by=rank_by,
                      progress=report, warn=lambda m: click.echo(m, err=True))
    except (CheckpointError, TrainingError, DataError, ConfigError) as e:
        raise OfflineError(str(e)) from None


def _env(run_dir):
    from sentinel.offline.replay import local_env
    from trainer.config import load_run_config

    return local_env(load_run_config(run_dir).device)


def _skip(log, res: dict, top_k: int) -> dict:
    from sentinel.offline.replay import add_to_skiplist, send_skip_directive

    ids = [c["id"] for c in res["culprits"][:top_k]]
    if not ids:
        return {"ids": [], "ranges": [], "added": 0, "bus": "nothing to skip"}
    ranges, added = add_to_skiplist(log.run_dir, ids)
    bus = send_skip_directive(log.run_dir, res.get("run") or log.run_id, ranges,
                              reason=f"replay-batch: culprits of step {res['step']}")
    out = {"ids": ids, "ranges": [list(r) for r in ranges], "added": added, "bus": bus,
           "file": str(log.run_dir / "skiplist.json")}
    if not res["reproduced"]:
        out["warning"] = "the step was not reproduced: these samples may be innocent (transient fault suspected)"
    return out


def _render(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    con = Console()
    on = f" (timeline {res['timeline']})" if len(res.get("timelines", [])) > 1 else ""
    con.print(Text(f"replay of step {res['step']}{on} from checkpoint {res['checkpoint']} "
                   f"({res['world_size']} rank(s), {res['device']}, tolerance {res['tolerance']}; "
                   f"fast-forward {res['fast_forward']['steps']} step(s): "
                   f"{'matched the log' if res['fast_forward']['matched'] else 'DIVERGED'})"))
    t = Table(show_edge=False)
    t.add_column("")
    t.add_column("recorded", justify="right")
    t.add_column("replayed", justify="right")
    t.add_column("match")
    for k in ("loss", "grad_norm", "lr", "skipped"):
        ok = res["match"][k]
        t.add_row(k, fmt(res["recorded"][k]), fmt(res["replayed"][k]), Text("yes" if ok else "NO", style="green" if ok else "bold red"))
    con.print(t)
    style = "bold green" if res["reproduced"] else "bold yellow"
    con.print(Text(res["verdict"], style=style))
    if res.get("lr_note"):
        con.print(Text("note: " + res["lr_note"], style="yellow"))
    if res["culprits"]:
        ct = Table(title=f"top {len(res['culprits'])} culprits (by per-sample {res['ranked_by']}; batch of {res['batch_size']})",
                   show_edge=False, title_justify="left")
        for col, just in (("id", "right"), ("loss", "right"), ("grad norm", "right"), ("source", "left"),
                          ("shard:offset", "left")):
            ct.add_column(col, justify=just, no_wrap=True)
        ct.add_column("text", ratio=1, overflow="fold")  # the snippet wraps: it is the evidence
        for c in res["culprits"]:
            gn = "-" if c["grad_norm"] is None else f"{c['grad_norm']:.4g}"
            ct.add_row(str(c["id"]), f"{c['loss']:.4f}", gn, c.get("source") or "-", f"{c['shard']}:{c['offset']}",
                       Text(c["text"]))
        con.print(ct)
    if "skip" in res and res["skip"].get("status") != "failed":  # a failure is the error line after the verdict
        s = res["skip"]
        con.print(Text(f"skip list: added {s['ids']} ({s['added']} new id(s)) to {s.get('file', 'skiplist.json')}; {s['bus']}"))
        if s.get("warning"):
            con.print(Text("warning: " + s["warning"], style="yellow"))
