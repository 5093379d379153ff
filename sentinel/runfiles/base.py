"""What every run-dir reader shares: the error type, bounded JSON and JSONL reads, a file's tail,
and the run's identity and config.

The on-call commands must work on a laptop without torch and never import the training loop, so
everything here runs on the standard library, YAML and the contract.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sentinel.contract.fsio import MAX_STATE_BYTES, read_regular_file
from sentinel.contract.parsing import SchemaError, loads_bounded
from sentinel.contract.ranges import merge_ranges
from sentinel.contract.rundir import CKPT_DIR, CONFIG, STEPS
from sentinel.contract.yamlio import read_yaml


class RunDirError(Exception):
    """A one-line problem with a run directory (missing, unreadable, malformed file)."""


def load_json_file(path: Path, what: str | None = None) -> Any:
    """A whole JSON document from a run-dir file. ``FileNotFoundError`` passes through; anything
    else unreadable (not UTF-8, not JSON, nested 50,000 deep, a directory, a device or FIFO, over
    ``MAX_STATE_BYTES``) is one ``RunDirError`` line naming the file, never a RecursionError, a
    UnicodeDecodeError or a read that never ends."""
    what = f"{what} {path}" if what else str(path)
    try:
        return json.loads(read_regular_file(path, MAX_STATE_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise
    except UnicodeDecodeError:
        raise RunDirError(f"{what} is unreadable: not UTF-8") from None
    except RecursionError:
        raise RunDirError(f"{what} is unreadable: JSON nested too deep") from None
    except ValueError as e:
        raise RunDirError(f"{what} is unreadable: {e}") from None
    except OSError as e:
        raise RunDirError(f"{what} is unreadable: {e.strerror or e}") from None


def _int_in(x: Any, lo: int, hi: int) -> int | None:
    """``x`` when it is an int (not a bool) in [lo, hi], else None."""
    return x if isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi else None


def require_run_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise RunDirError(f"run directory not found: {p}")
    if not any((p / n).exists() for n in (STEPS, CONFIG, CKPT_DIR, "bus")):
        raise RunDirError(f"{p} is not a run directory (no {STEPS}, {CONFIG}, {CKPT_DIR}/ or bus/)")
    return p


def run_id_of(run_dir: str | os.PathLike) -> str:
    """The run id the trainer uses for this directory: config.yaml's ``run_id``, else the directory's
    name (the same rule as ``Trainer``; a copied run dir becomes a new run)."""
    d = Path(run_dir)
    rid = _config(d).get("run_id")
    if isinstance(rid, (str, int)) and not isinstance(rid, bool) and rid:
        # only a name: str() of a YAML alias bomb (nine lists of nine aliases, nine deep) never ends
        return str(rid)
    return d.resolve().name


def _config(run_dir: Path) -> dict:
    """The run's config.yaml as a mapping; {} when it is missing, unreadable or no mapping (that is
    the trainer's problem, not the reader's): a device, a FIFO or a file over ``MAX_STATE_BYTES``
    is not read."""
    try:
        cfg = read_yaml(run_dir / CONFIG, MAX_STATE_BYTES)
    except Exception:  # noqa: BLE001 - any way to be unreadable reads as no config
        return {}
    return cfg if isinstance(cfg, dict) else {}


def config_skip_ranges(run_dir: str | os.PathLike) -> list[tuple[int, int]]:
    """``data.skip`` of the run's config.yaml (the trainer re-adds these at every start)."""
    try:
        raw = (_config(Path(run_dir)).get("data") or {}).get("skip") or []
        return merge_ranges((int(lo), int(hi)) for lo, hi in raw)
    except Exception:
        return []


def run_config(run_dir: str | os.PathLike) -> dict:
    """The run's config.yaml as a mapping ({} when missing or unreadable: see ``_config``)."""
    return _config(Path(run_dir))


def planned_steps(run_dir: str | os.PathLike) -> int | None:
    """The run's ``max_steps`` from its config.yaml; None when absent, unreadable or not a count."""
    n = run_config(run_dir).get("max_steps")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def tail_lines(path: str | os.PathLike, n: int, block: int = 1 << 16) -> list[bytes]:
    """The last ``n`` complete lines of a file, reading backwards (a torn last line is dropped)."""
    p = Path(path)
    with open(p, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        buf = b""
        pos = end
        while pos > 0 and buf.count(b"\n") <= n:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            buf = f.read(step) + buf
    if not buf.endswith(b"\n"):
        cut = buf.rfind(b"\n")
        buf = buf[: cut + 1] if cut >= 0 else b""
    lines = [ln for ln in buf.split(b"\n") if ln.strip()]
    if pos > 0 and lines:  # the first piece may be a partial line
        lines = lines[1:]
    return lines[-n:] if n else []


def _read_jsonl(path: Path, tail: int | None = None, rejected: list[str] | None = None) -> list[dict]:
    """The JSON objects of a JSONL file (its last ``tail`` lines when given); see ``_jsonl_objects``."""
    return [obj for _, obj in _jsonl_objects(path, tail, rejected)]


def _jsonl_objects(path: Path, tail: int | None = None, rejected: list[str] | None = None) -> list[tuple[str, dict]]:
    """(where, object) for each JSON object line of a JSONL file; a line that is not one is skipped,
    and its one-line reason appended to ``rejected`` when given."""
    if not path.is_file():
        return []
    lines = tail_lines(path, tail) if tail else path.read_bytes().splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{n}" if not tail else f"{path.name} (line {n} of the last {len(lines)})"
        try:  # bounded: a line nested 50,000 deep is a RecursionError inside json, not a ValueError
            obj = loads_bounded(line, where)
        except SchemaError as e:
            _reject(rejected, str(e))
            continue
        if isinstance(obj, dict):
            out.append((where, obj))
        else:
            _reject(rejected, f"{where}: expected a JSON object")
    return out


def _reject(rejected: list[str] | None, why: str) -> None:
    if rejected is not None:
        rejected.append(why)
