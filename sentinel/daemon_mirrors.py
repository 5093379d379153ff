"""The run-dir mirror of a run's incidents and pages: their history survives the bus."""

from __future__ import annotations

from pathlib import Path

from sentinel import rundir
from sentinel.daemon_options import _is_file
from sentinel.protocol import Incident
from sentinel.rules import rules_yaml


class MirrorsMixin:
    def _mirror_dir(self) -> Path | None:
        """The run dir to mirror into: given on the command line, else the one the trainer registered
        (when it is on this machine). Resolved once found; None means no mirror (a remote run)."""
        if self._run_dir is None:
            d = self.opts.run_dirs.get(self.run)
            if d is None:
                raw = self._read_trusting_type("info", lambda r: r.hget(self.keys.info, "run_dir"))  # trainer-written: may be anything
                d = Path(raw.decode("utf-8", "replace")) if raw else None
                if d is not None and not _is_file(d / rundir.CONFIG):
                    d = None  # only ever write into a real run directory
            if d is not None and Path(d).is_dir():
                self._run_dir = Path(d)
                log = lambda m: self.log(f"[{self.run}] {m}")  # noqa: E731
                self._incidents_mirror = rundir.JsonlMirror(self._run_dir / rundir.INCIDENTS_LOG, log)
                self._pages_mirror = rundir.JsonlMirror(self._run_dir / rundir.PAGES_LOG, log)
                why = rundir.write_applied_rules(self._run_dir, rules_yaml(self.opts.rules))
                if why:
                    log(f"cannot write {rundir.APPLIED_RULES}: {why} (backtest of this run will use other rules)")
        return self._run_dir

    def _mirror_incidents(self, recent: dict[str, Incident], js: dict[str, str]) -> None:
        """Append every incident whose state changed since it was last mirrored (readers keep the last
        line per id), so incident history survives the bus."""
        if self._mirror_dir() is None:
            return
        for iid, j in js.items():
            if self._mirrored.get(iid) == j:
                continue
            if self._incidents_mirror.append(recent[iid].model_dump(mode="json")):
                self._mirrored[iid] = j
            else:
                self.m.mirror_failures.labels(self.run, rundir.INCIDENTS_LOG).inc()
        if len(self._mirrored) > 2 * len(js):  # forget what left the recent set
            self._mirrored = {iid: j for iid, j in self._mirrored.items() if iid in js}

    def _mirror_page(self, page: dict) -> None:
        if self._mirror_dir() is None:
            return
        if not self._pages_mirror.append(page):
            self.m.mirror_failures.labels(self.run, rundir.PAGES_LOG).inc()
