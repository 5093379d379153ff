"""The run's history files: ``directives.jsonl`` (the trainer's log of applied directives),
``audit.jsonl`` (who did what by hand, and why), ``incidents.jsonl`` and ``pages.jsonl`` (the
daemon's mirror of incidents and pages, so that history survives the control bus: ``JsonlMirror``
writes them, append + flush, a full disk counted and never fatal), and the rules the daemon applied."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from sentinel.contract.bounds import record_range_error
from sentinel.contract.parsing import SchemaError, finite_or_none
from sentinel.contract.records import Incident
from sentinel.contract.rundir import APPLIED_RULES, AUDIT, DIRECTIVES_LOG, INCIDENTS_LOG, PAGES_LOG
from sentinel.runfiles.base import _jsonl_objects, _read_jsonl, _reject

PAGE_FIELDS = ("time", "run", "severity", "summary", "incident_id", "rule", "delivered_to")


def read_directives_log(run_dir: str | os.PathLike, tail: int | None = None) -> list[dict]:
    """The trainer's ``directives.jsonl`` (applied directives: id, kind, status, step, timeline, ...)."""
    return _read_jsonl(Path(run_dir) / DIRECTIVES_LOG, tail)


def read_audit(run_dir: str | os.PathLike, tail: int | None = None) -> list[dict]:
    return _read_jsonl(Path(run_dir) / AUDIT, tail)


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
