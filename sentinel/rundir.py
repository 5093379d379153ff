"""Torch-free readers (and the few writers the CLI needs) for a run directory.

The on-call commands (`sentinel status`, `checkpoints`, `rollback`, `skip-list`, ...) must work on
a laptop without torch and must never import the training loop, so everything they need from
``RUN_DIR`` lives here, on the standard library plus ``sentinel.protocol``:

* ``steps.jsonl``: the last N records, read backwards from the end (a run's log can be huge);
* ``checkpoints/step-*/manifest.json``: listing, sizes, and a re-hash of every file against the
  manifest's sha256 (``checksum_ok`` / ``corrupt`` / ``incomplete``), plus ``verified.json`` from
  ``sentinel verify-resume`` (``resume_verified`` / ``failed``);
* ``skiplist.json``: read, and an atomic write (tmp + fsync + rename) in the trainer's format;
* ``pending_rollback.json``: the plan a trainer consumes at its next start;
* ``directives.jsonl`` (the trainer's log of applied directives) and ``audit.jsonl`` (who did what
  by hand, and why);
* ``incidents.jsonl`` and ``pages.jsonl``: the daemon's mirror of incidents (one Incident per line,
  appended on every state change; the last line per id wins) and of pages, so that history survives
  the control bus. ``JsonlMirror`` writes them (append + flush; a full disk is counted, never fatal).

The formats mirror ``trainer/checkpoint.py``, ``sentinel/client/skiplist.py`` and ``trainer/train.py``;
this module does not import them (``trainer.checkpoint`` imports torch).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from sentinel.protocol import (
    MAX_STATE_BYTES,
    read_regular_file,
    Incident,
    MAX_COUNT,
    MAX_SAMPLE_ID,
    MAX_TIMELINE,
    PENDING_ROLLBACK,
    SchemaError,
    StepRecord,
    TimelineRecord,
    atomic_write_text,
    authoritative_steps,
    checkpoint_dir_name,
    checkpoint_required_files,
    finite_or_none,
    loads_bounded,
    merge_ranges,
    subtract_ranges,
    skip_ranges_error,
    SKIP_REMOVED,
    parse_step_line,
    pending_rollback_error,
    record_range_error,
    sha256_file,
)

STEPS = "steps.jsonl"
SKIPLIST = "skiplist.json"
PENDING = PENDING_ROLLBACK
DIRECTIVES_LOG = "directives.jsonl"
AUDIT = "audit.jsonl"
INCIDENTS_LOG = "incidents.jsonl"
APPLIED_RULES = "sentinel-rules.applied.yaml"  # the rules the daemon applied to the run (resolved), for backtest
PAGES_LOG = "pages.jsonl"
PAGE_FIELDS = ("time", "run", "severity", "summary", "incident_id", "rule", "delivered_to")
CONFIG = "config.yaml"
CKPT_DIR = "checkpoints"
MANIFEST = "manifest.json"
VERIFIED = "verified.json"
CHECKPOINT_FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_INT64_MAX = (1 << 63) - 1  # the trainer's Manifest counts


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


# --------------------------------------------------------------------------------------------
# Identity
# --------------------------------------------------------------------------------------------


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
        import yaml

        cfg = yaml.safe_load(read_regular_file(run_dir / CONFIG, MAX_STATE_BYTES).decode("utf-8"))
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


# --------------------------------------------------------------------------------------------
# steps.jsonl
# --------------------------------------------------------------------------------------------


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


def parse_file_record(line: bytes | str) -> StepRecord | TimelineRecord:
    """One line of ``steps.jsonl``, held to the same bounds as a record from the bus (a negative or
    10**60 step, a -inf loss, a non-finite time): a line no trainer writes is a ``SchemaError``, so a
    hostile line cannot stretch a status or a report to step 10**60."""
    rec = parse_step_line(line)
    bad = record_range_error(rec)
    if bad:
        raise SchemaError(f"steps.jsonl: {bad}", "out_of_range")
    return rec


def tail_records(run_dir: str | os.PathLike, n: int = 1000, rejected: list[str] | None = None) -> list[StepRecord | TimelineRecord]:
    """The last ``n`` records of ``steps.jsonl``; [] if there is none. A malformed line is skipped,
    and its one-line reason appended to ``rejected`` when given."""
    path = Path(run_dir) / STEPS
    if not path.is_file():
        _not_a_log(path, rejected)
        return []
    out = []
    lines = tail_lines(path, n)
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(parse_file_record(line))
        except SchemaError as e:
            _reject(rejected, f"{STEPS} (line {i} of the last {len(lines)}): {e}")
    return out


def _not_a_log(path: Path, rejected: list[str] | None) -> None:
    """A steps.jsonl that is there but no regular file (a directory, a FIFO, a link to a device) is
    no log to read, and not "no steps yet" either: said, as a rejected line is."""
    if os.path.lexists(path):
        import stat

        try:
            mode = os.stat(path).st_mode
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "no regular file")
        except OSError as e:
            kind = f"unreadable ({e.strerror or e.__class__.__name__})"
        _reject(rejected, f"{STEPS} is {kind}: not read")


def read_records(run_dir: str | os.PathLike, rejected: list[str] | None = None):
    """Every record of ``steps.jsonl``, in order (streamed; a torn tail line is skipped). A malformed
    or out-of-range line is skipped, and its one-line reason ("steps.jsonl:N: ...") appended to
    ``rejected`` when given."""
    path = Path(run_dir) / STEPS
    if not path.is_file():
        _not_a_log(path, rejected)
        return
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                return
            if line.strip():
                try:
                    yield parse_file_record(line)
                except SchemaError as e:
                    if rejected is not None:
                        rejected.append(f"{STEPS}:{n}: {e}")


def effective_steps(records: Iterable) -> list[StepRecord]:
    """The authoritative step records of a record sequence (a rollback supersedes later steps)."""
    return list(authoritative_steps(records).values())


def run_config(run_dir: str | os.PathLike) -> dict:
    """The run's config.yaml as a mapping ({} when missing or unreadable: see ``_config``)."""
    return _config(Path(run_dir))


def planned_steps(run_dir: str | os.PathLike) -> int | None:
    """The run's ``max_steps`` from its config.yaml; None when absent, unreadable or not a count."""
    n = run_config(run_dir).get("max_steps")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def steps_mtime(run_dir: str | os.PathLike) -> float | None:
    try:
        return (Path(run_dir) / STEPS).stat().st_mtime
    except OSError:
        return None


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


step_dir_name = checkpoint_dir_name


@dataclass
class Checkpoint:
    step: int
    path: Path
    manifest: dict | None
    bytes: int
    created: float | None
    checksum: str  # checksum_ok | corrupt | incomplete | unverified (not re-hashed)
    problem: str | None = None
    verify_resume: dict | None = None  # the verified.json entry, if any

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def status(self) -> str:
        """What an operator should believe: a bad checksum beats an old verify-resume result."""
        if self.checksum in ("corrupt", "incomplete"):
            return self.checksum
        if self.verify_resume and self.verify_resume.get("verified") in ("resume_verified", "failed"):
            return str(self.verify_resume["verified"])
        return self.checksum

    @property
    def usable(self) -> bool:
        return self.checksum in ("checksum_ok", "unverified") and self.status != "failed"

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step, "name": self.name, "path": str(self.path), "bytes": self.bytes, "created": self.created,
            "age_seconds": (time.time() - self.created) if self.created else None, "verified": self.status,
            "checksum": self.checksum, "problem": self.problem, "verify_resume": self.verify_resume,
            # from the manifest: shown only when they are what the trainer writes (a hostile "x" is "-")
            "timeline": _int_in((self.manifest or {}).get("timeline"), 0, MAX_TIMELINE),
            "tokens": _int_in((self.manifest or {}).get("tokens"), 0, MAX_COUNT),
            "world_size": _int_in((self.manifest or {}).get("world_size"), 1, 1 << 20),
        }


def _dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def check_checkpoint(path: Path, *, rehash: bool = True) -> tuple[str, str | None, dict | None]:
    """(state, problem, manifest) for one ``step-N`` directory, like ``trainer.checkpoint.verify``."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        return "incomplete", "no manifest (the write never finished)", None
    try:
        manifest = load_json_file(mpath)
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError
    except (OSError, RunDirError, KeyError, TypeError):
        return "corrupt", "manifest.json is unreadable", None
    if manifest.get("format") != CHECKPOINT_FORMAT:
        return "corrupt", f"unsupported checkpoint format {manifest.get('format')!r}", manifest
    ws = manifest.get("world_size")
    if not isinstance(ws, int) or isinstance(ws, bool) or not 1 <= ws <= 1 << 20:
        return "corrupt", f"manifest world_size {ws!r} is invalid", manifest
    # the rest of what the trainer's strict Manifest refuses (trainer.checkpoint.verify): a checkpoint
    # listed checksum_ok here must be one the trainer will load
    st, m = manifest.get("step"), _STEP_DIR.match(path.name)
    if type(st) is not int or not 0 <= st <= _INT64_MAX:
        return "corrupt", f"manifest step {str(st)[:40]!r} is invalid", manifest
    if m and int(m.group(1)) != st:
        return "corrupt", f"manifest names step {st}, not the step of its directory", manifest
    created, size = manifest.get("created"), manifest.get("bytes", 0)
    if type(created) not in (int, float) or finite_or_none(created) is None:
        return "corrupt", "manifest created time is invalid", manifest
    if type(size) is not int or not 0 <= size <= _INT64_MAX:
        return "corrupt", "manifest bytes is invalid", manifest
    if not all(isinstance(d, str) and _SHA256.fullmatch(d) for d in files.values()):
        return "corrupt", "manifest lists a file without a sha256 digest", manifest
    # our trainer's files must all be there; a framework's checkpoint (``framework`` in its manifest, written
    # by sentinel.client.checkpoints) holds that framework's files, all listed and hashed below
    required = [] if "framework" in manifest else checkpoint_required_files(ws, any(str(n).startswith("dcp/") for n in files))
    for name in required:
        if name not in files:
            return "corrupt", f"{name} is not in the manifest (incomplete or tampered)", manifest
    for name in sorted(files):
        if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/"):
            return "corrupt", f"unsafe file name {name!r} in the manifest", manifest
        if not (path / name).is_file():
            if os.path.lexists(path / name):  # a FIFO, a directory, a link to a device: not what was saved
                return "corrupt", f"{name} is no regular file", manifest
            return "incomplete", f"{name} is missing", manifest
    if not rehash:
        return "unverified", None, manifest
    for name, digest in sorted(files.items()):
        try:
            if sha256_file(path / name) != digest:
                return "corrupt", f"{name} fails its sha256 check (corrupt or truncated)", manifest
        except OSError as e:
            return "corrupt", f"{name}: {e.strerror or e}", manifest
    return "checksum_ok", None, manifest


def read_verified(run_dir: str | os.PathLike) -> dict[int, dict]:
    """``checkpoints/verified.json`` written by ``sentinel verify-resume``: {step: {"verified", "time", ...}}."""
    p = Path(run_dir) / CKPT_DIR / VERIFIED
    try:
        raw = load_json_file(p)
    except (OSError, RunDirError):  # an annotation: unreadable, the checkpoints are only not marked verified
        return {}
    out: dict[int, dict] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            try:
                out[int(k)] = v if isinstance(v, dict) else {"verified": str(v)}
            except ValueError:
                continue
    return out


def checkpoint_steps(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory (valid or not), newest first; in-flight ``.tmp-*`` writes excluded."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def load_checkpoint(step: int, path: Path, verified: dict[int, dict] | None = None, *, rehash: bool = True) -> Checkpoint:
    state, problem, manifest = check_checkpoint(path, rehash=rehash)
    size = _int_in((manifest or {}).get("bytes"), 0, MAX_COUNT)
    size = _dir_bytes(path) if size is None else size
    created = finite_or_none(manifest.get("created")) if manifest else None
    if created is None:
        try:
            created = path.stat().st_mtime
        except OSError:
            created = None
    return Checkpoint(step=step, path=path, manifest=manifest, bytes=size, created=created, checksum=state,
                      problem=problem, verify_resume=(verified or {}).get(step))


def list_checkpoints(run_dir: str | os.PathLike, *, rehash: bool = True) -> list[Checkpoint]:
    """All checkpoints of a run, newest first, each with its checksum / verification state."""
    verified = read_verified(run_dir)
    return [load_checkpoint(s, p, verified, rehash=rehash) for s, p in checkpoint_steps(run_dir)]


def find_checkpoint(run_dir: str | os.PathLike, step: int, *, rehash: bool = True) -> Checkpoint | None:
    p = Path(run_dir) / CKPT_DIR / step_dir_name(step)
    if not p.is_dir():
        return None
    return load_checkpoint(step, p, read_verified(run_dir), rehash=rehash)


# --------------------------------------------------------------------------------------------
# Skip list
# --------------------------------------------------------------------------------------------


def read_skiplist(run_dir: str | os.PathLike) -> list[tuple[int, int]]:
    """``skiplist.json`` as merged [lo, hi) ranges; a missing file is an empty list."""
    p = Path(run_dir) / SKIPLIST
    try:
        raw = load_json_file(p, "skip list")
    except FileNotFoundError:
        return []
    try:
        ranges = [(int(lo), int(hi)) for lo, hi in raw]
    except (TypeError, ValueError, OverflowError):
        raise RunDirError(f"skip list {p} is malformed: expected [[lo, hi], ...]") from None
    if any(not 0 <= lo <= hi <= MAX_SAMPLE_ID for lo, hi in ranges):
        raise RunDirError(f"skip list {p} is malformed: ids must satisfy 0 <= lo <= hi <= {MAX_SAMPLE_ID} (int64)")
    return merge_ranges(ranges)


_atomic_write = atomic_write_text


def write_skiplist(run_dir: str | os.PathLike, ranges) -> list[tuple[int, int]]:
    """Replace ``skiplist.json`` atomically (same format as ``trainer.data.SkipList.save``)."""
    merged = merge_ranges(ranges)
    _atomic_write(Path(run_dir) / SKIPLIST, json.dumps([[lo, hi] for lo, hi in merged]))
    return merged


def read_skip_removals(run_dir: str | os.PathLike) -> list[tuple[int, int]]:
    """``skiplist.removed.json``: the ranges an operator removed that the trainer has not yet made
    stick (``protocol.SKIP_REMOVED``); [] when there is none."""
    p = Path(run_dir) / SKIP_REMOVED
    try:
        raw = load_json_file(p, "skip-list removals")
    except FileNotFoundError:
        return []
    bad = skip_ranges_error(raw)
    if bad:
        raise RunDirError(f"{p} is malformed: {bad}")
    return merge_ranges(tuple(r) for r in raw)


def change_skip_removals(run_dir: str | os.PathLike, *, add=(), drop=()) -> list[tuple[int, int]]:
    """Add ranges to the removals the trainer applies at its next start, or drop ranges from them
    (an operator who adds a range back after removing it); the file goes when none are left."""
    p = Path(run_dir) / SKIP_REMOVED
    after = subtract_ranges(merge_ranges(list(read_skip_removals(run_dir)) + [tuple(r) for r in add]), drop)
    if after:
        _atomic_write(p, json.dumps([[lo, hi] for lo, hi in after]))
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return after


def grow_skiplist(run_dir: str | os.PathLike, ranges) -> tuple[list[tuple[int, int]], int]:
    """Merge ``ranges`` into ``skiplist.json``; returns (new list, number of newly covered ids)."""
    before = read_skiplist(run_dir)
    after = merge_ranges(list(before) + [tuple(r) for r in ranges])
    if after != before:
        write_skiplist(run_dir, after)
    return after, count(after) - count(before)


# --------------------------------------------------------------------------------------------
# Range helpers
# --------------------------------------------------------------------------------------------


def parse_range(text: str) -> tuple[int, int]:
    """``LO:HI`` (half-open) or a single id ``N`` (= ``N:N+1``)."""
    t = text.strip()
    try:
        if ":" in t:
            a, b = t.split(":", 1)
            lo, hi = int(a), int(b)
        else:
            lo = int(t)
            hi = lo + 1
    except ValueError:
        dash = re.fullmatch(r"(\d+)-(\d+)", t)
        if dash:  # the inclusive form --inject-fault used to take: say what it would mean here
            a, b = int(dash.group(1)), int(dash.group(2))
            raise ValueError(f"bad sample range {text!r}: ranges are half-open LO:HI (HI excluded); "
                             f"for ids {a}..{b} inclusive write {a}:{b + 1}") from None
        raise ValueError(f"bad sample range {text!r}: expected LO:HI (sample ids, HI exclusive) or one id") from None
    if lo < 0 or hi <= lo:
        raise ValueError(f"bad sample range {text!r}: need 0 <= LO < HI")
    if hi > MAX_SAMPLE_ID:
        raise ValueError(f"bad sample range {text!r}: sample ids are int64 (HI at most {MAX_SAMPLE_ID})")
    return lo, hi


def count(ranges) -> int:
    return sum(int(hi) - int(lo) for lo, hi in ranges)


def intersect_ranges(a, b) -> list[tuple[int, int]]:
    out = []
    for lo, hi in merge_ranges(a):
        for blo, bhi in merge_ranges(b):
            x, y = max(lo, blo), min(hi, bhi)
            if x < y:
                out.append((x, y))
    return merge_ranges(out)


def fmt_ranges(ranges, limit: int = 6) -> str:
    rs = [f"{lo}:{hi}" for lo, hi in ranges]
    if len(rs) > limit:
        return ", ".join(rs[:limit]) + f", ... (+{len(rs) - limit})"
    return ", ".join(rs) or "-"


# --------------------------------------------------------------------------------------------
# Pending rollback, directives log, audit log
# --------------------------------------------------------------------------------------------


def read_pending_rollback(run_dir: str | os.PathLike) -> dict | None:
    """The plan in ``pending_rollback.json``, or None; a plan without a valid ``to_step`` and
    ``ranges`` is a ``RunDirError`` naming the file (the trainer could not apply it either)."""
    p = Path(run_dir) / PENDING
    try:
        data = load_json_file(p)
    except FileNotFoundError:
        return None
    bad = pending_rollback_error(data)
    if bad:
        raise RunDirError(f"{p} is malformed: {bad}")
    return data


def pending_rollback_for_view(run_dir: str | os.PathLike | None) -> dict | None:
    """``read_pending_rollback`` for a view (status, checkpoints, skip-list): a malformed plan is
    one stderr warning and shown as none, not a refusal to show the run (the trainer refuses to
    start on it with the same words; the next ``sentinel rollback`` replaces it)."""
    if run_dir is None:
        return None
    try:
        return read_pending_rollback(run_dir)
    except RunDirError as e:
        import sys

        print(f"warning: {e} (the trainer will not start until it is fixed or replaced by `sentinel rollback`)",
              file=sys.stderr)
        return None


def write_pending_rollback(run_dir: str | os.PathLike, *, to_step: int, ranges, reason: str | None, id: str,
                           **extra: Any) -> Path:
    """Write the plan the trainer's ``start()`` consumes: {"to_step", "ranges", "reason", "id", ...}."""
    p = Path(run_dir) / PENDING
    plan = {"to_step": int(to_step), "ranges": [[lo, hi] for lo, hi in merge_ranges(ranges)], "reason": reason,
            "id": id, **extra}
    _atomic_write(p, json.dumps(plan, indent=1, sort_keys=True))
    return p


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


def read_directives_log(run_dir: str | os.PathLike, tail: int | None = None) -> list[dict]:
    """The trainer's ``directives.jsonl`` (applied directives: id, kind, status, step, timeline, ...)."""
    return _read_jsonl(Path(run_dir) / DIRECTIVES_LOG, tail)


def read_audit(run_dir: str | os.PathLike, tail: int | None = None) -> list[dict]:
    return _read_jsonl(Path(run_dir) / AUDIT, tail)


def skip_origins(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Where the run's skip ranges came from, oldest first: ``{"ranges", "source", "step",
    "reason", "incident_id"}`` for the config's ``data.skip`` (the --skip flag), each rollback (its
    timeline record in steps.jsonl), each applied skip-samples directive (directives.jsonl, which
    logs its ranges), and each skip an operator added offline (audit.jsonl). For "why is sample N
    skipped?" (``sentinel skip-list RUN show``)."""
    d = Path(run_dir)
    out: list[dict[str, Any]] = []
    cfg = config_skip_ranges(d)
    if cfg:
        out.append({"ranges": cfg, "source": "config", "step": None, "reason": "data.skip in config.yaml (--skip)",
                    "incident_id": None})
    for rec in read_records(d):
        if isinstance(rec, TimelineRecord) and rec.kind == "rollback" and rec.skip_ranges:
            out.append({"ranges": merge_ranges(rec.skip_ranges), "source": "rollback", "step": rec.from_step,
                        "reason": rec.reason, "incident_id": None, "directive_id": rec.directive_id})
    by_directive = {o.get("directive_id"): o for o in out if o.get("directive_id")}
    for e in read_directives_log(d):
        if e.get("status") != "applied":
            continue
        if e.get("kind") == "rollback" and e.get("id") in by_directive:  # the timeline record said it: name the incident
            by_directive[e["id"]]["incident_id"] = e.get("incident_id") if isinstance(e.get("incident_id"), str) else None
            continue
        ranges = _ranges_of(e.get("ranges"))  # logged by the trainer since 2026-11-24
        if not ranges:
            continue
        out.append({"ranges": ranges, "source": str(e.get("kind")), "step": e.get("step") if type(e.get("step")) is int else None,
                    "reason": e.get("reason") if isinstance(e.get("reason"), str) else None,
                    "incident_id": e.get("incident_id") if isinstance(e.get("incident_id"), str) else None})
    for a in read_audit(d):
        ranges = _ranges_of(a.get("ranges"))
        if a.get("action") == "skip-samples" and a.get("phase") == "applied" and ranges:
            out.append({"ranges": ranges, "source": "operator", "step": None,
                        "reason": a.get("reason") if isinstance(a.get("reason"), str) else None,
                        "incident_id": None, "who": a.get("who") if isinstance(a.get("who"), str) else None})
    for o in out:
        o.pop("directive_id", None)
    return out


def _ranges_of(raw: Any) -> list[tuple[int, int]]:
    """Sample-id ranges from a log line: ``[[lo, hi], ...]`` of ints with lo < hi; [] for anything else."""
    if not isinstance(raw, list):
        return []
    ok = [(lo, hi) for r in raw[:100_000] if isinstance(r, (list, tuple)) and len(r) == 2
          for lo, hi in [r] if type(lo) is int and type(hi) is int and 0 <= lo < hi <= MAX_SAMPLE_ID]
    return merge_ranges(ok)


def origin_of(lo: int, hi: int, origins: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first origin (``skip_origins``) whose ranges overlap ``[lo, hi)``. Each origin's ranges
    are merged (sorted, disjoint): one bisection each."""
    for o in origins:
        rs = o["ranges"]
        i = bisect.bisect_right(rs, (hi, -1)) - 1  # the last range starting before hi
        if i >= 0 and rs[i][1] > lo:
            return o
    return None


def append_audit(run_dir: str | os.PathLike, record: dict[str, Any]) -> dict[str, Any]:
    """Append one line to ``audit.jsonl`` (O_APPEND + fsync: concurrent writers never interleave)."""
    rec = {"time": time.time(), **record}
    data = (json.dumps(rec, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(Path(run_dir) / AUDIT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return rec


def read_incidents_log(run_dir: str | os.PathLike, rejected: list[str] | None = None) -> list[Incident]:
    """Every incident in ``RUN_DIR/incidents.jsonl`` (last line per id wins), oldest first; [] when
    the file is absent. Malformed, torn or out-of-range lines are skipped (and their reasons
    appended to ``rejected`` when given)."""
    latest: dict[str, Incident] = {}
    for where, obj in _jsonl_objects(Path(run_dir) / INCIDENTS_LOG, rejected=rejected):
        inc = parse_incident(obj)
        if inc is not None:
            latest[inc.id] = inc
        else:
            _reject(rejected, f"{where}: not a valid incident (a field missing, of the wrong type or out of range)")
    return sorted(latest.values(), key=lambda i: i.opened_at)


def parse_incident(raw: str | bytes | dict) -> Incident | None:
    """An incident from the mirror or the bus's incidents hash, or None when it is malformed or out
    of range (an onset at step 10**400, an opening time of NaN: no view can place it)."""
    try:
        inc = Incident.from_json(raw)
    except SchemaError:
        return None
    return inc if record_range_error(inc) is None else None


def read_pages_log(run_dir: str | os.PathLike, tail: int | None = None, rejected: list[str] | None = None) -> list[dict]:
    """The pages in ``RUN_DIR/pages.jsonl``, oldest first, each with exactly ``PAGE_FIELDS``.
    Lines that are not a page (no finite numeric time or no summary: torn, hostile) are skipped (and
    their reasons appended to ``rejected`` when given)."""
    out = []
    for where, obj in _jsonl_objects(Path(run_dir) / PAGES_LOG, tail, rejected):
        page = normalize_page(obj)
        if page is not None:
            out.append(page)
        else:
            _reject(rejected, f"{where}: not a page (no finite time or no summary)")
    return out


def normalize_page(obj: Any) -> dict | None:
    """A page dict with exactly ``PAGE_FIELDS`` and sane types, or None when ``obj`` is not a page."""
    if not isinstance(obj, dict):
        return None
    t, summary = finite_or_none(obj.get("time")), obj.get("summary")
    if t is None or not isinstance(summary, str):
        return None
    to = obj.get("delivered_to")
    return {
        "time": t, "run": str(obj.get("run") or ""), "severity": str(obj.get("severity") or "critical"),
        "summary": summary, "incident_id": obj["incident_id"] if isinstance(obj.get("incident_id"), str) else None,
        "rule": obj["rule"] if isinstance(obj.get("rule"), str) else None,
        "delivered_to": [str(x) for x in to] if isinstance(to, list) else [],
    }


class JsonlMirror:
    """Append-only JSONL for the daemon's history in the run dir: append + flush per line.

    A write that fails (ENOSPC, EIO, a read-only or vanished run dir) is counted in ``failures`` and
    logged once per kind of error, never raised: the sentinel's job is the run, not its diary. A line
    cut short by a full disk is fenced off by a newline before the next write, so readers skip just
    that fragment."""

    def __init__(self, path: str | os.PathLike, log=None):
        self.path = Path(path)
        self.failures = 0
        self._torn = False
        self._log = log
        self._logged: set[str] = set()

    def append(self, obj: dict[str, Any]) -> bool:
        line = json.dumps(obj, sort_keys=True, default=str, allow_nan=True) + "\n"
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                if self._torn:
                    f.write("\n")
                self._torn = True  # until this line is flushed whole
                f.write(line)
                f.flush()
            self._torn = False
            return True
        except OSError as e:
            self.failures += 1
            why = os.strerror(e.errno) if e.errno else type(e).__name__
            if self._log is not None and why not in self._logged:
                self._logged.add(why)
                self._log(f"cannot write {self.path}: {why} (counted; the sentinel goes on)")
            return False


def write_applied_rules(run_dir: str | os.PathLike, rules_yaml: str) -> str | None:
    """Write the rules a daemon applies to the run into ``RUN_DIR/APPLIED_RULES`` (atomically; not
    at all when the file already says the same), so that ``sentinel backtest RUN_DIR/steps.jsonl``
    judges the run by them. None on success, else the reason (the caller logs it and goes on)."""
    path = Path(run_dir) / APPLIED_RULES
    text = ("# The rules `sentinel run` applied to this run (every setting resolved), for `sentinel backtest`\n"
            + rules_yaml)
    try:
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            return None
        tmp = path.with_name(f".{APPLIED_RULES}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        return None
    except (OSError, UnicodeDecodeError) as e:
        return os.strerror(e.errno) if getattr(e, "errno", None) else type(e).__name__


@dataclass
class StepsSummary:
    """What ``sentinel status`` shows for a run, computed from a window of step records."""

    step: int | None = None
    timeline: int | None = None
    loss: float | None = None
    loss_median: float | None = None
    val_ppl: float | None = None
    grad_norm: float | None = None
    tokens_per_second: float | None = None
    mfu: float | None = None
    guard_skips: int = 0
    window: int = 0
    last_time: float | None = None
    checkpoint_age_seconds: float | None = None
    last_timeline_event: dict | None = None
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d


def summarize(records: list, now: float | None = None) -> StepsSummary:
    now = time.time() if now is None else now
    steps = effective_steps(records)
    s = StepsSummary(window=len(steps))
    for r in records:
        if isinstance(r, TimelineRecord):
            s.last_timeline_event = {"kind": r.kind, "from_step": r.from_step, "timeline": r.timeline, "time": r.time,
                                     "reason": r.reason, "skip_samples": count(r.skip_ranges)}
    if not steps:
        return s
    last = steps[-1]
    s.step, s.timeline, s.loss, s.grad_norm, s.last_time = last.step, last.timeline, last.loss, last.grad_norm, last.time
    s.tokens_per_second, s.mfu = last.tokens_per_second, last.mfu
    recent = [r.loss for r in steps[-51:-1] if r.loss == r.loss and not r.skipped]
    if recent:
        recent.sort()
        m = len(recent) // 2
        s.loss_median = recent[m] if len(recent) % 2 else (recent[m - 1] + recent[m]) / 2
    for r in reversed(steps):
        if r.val_ppl is not None:
            s.val_ppl = r.val_ppl
            break
    s.guard_skips = sum(1 for r in steps if r.skipped)
    if last.checkpoint_age_seconds is not None:
        s.checkpoint_age_seconds = last.checkpoint_age_seconds + max(0.0, now - last.time)
    return s
