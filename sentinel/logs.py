"""The daemon's log: stdlib ``logging`` with levels, as text for a person or JSON for Loki / ELK.

    from sentinel.logs import configure, daemon_log
    logger = configure("json")          # or "text"; None: $SENTINEL_LOG_FORMAT, else text
    log = daemon_log(logger)            # the callable the Daemon and the Fleet log through
    log("[gpt2-a] PAGE: loss stayed above its band")

* **Where.** One handler on the ``sentinel`` logger (stderr), so ``sentinel.*`` loggers of other
  modules (``sentinel.embedded``, ``sentinel.client.bus``) land in the same stream and format.
* **text.** On a terminal, a rich console (time, coloured level, message); elsewhere (a pipe, a
  file, ``kubectl logs``) one plain line: ``2026-11-28T13:55:00.123Z WARNING [run] message``.
* **json.** One object per line: ``time`` (RFC 3339, UTC), ``level``, ``logger``, ``message`` and
  ``run`` (the run the line is about, ``null`` for daemon-wide lines); an exception adds ``exc``.
  In JSON the ``[run]`` prefix is moved out of ``message`` into ``run``.
* **Levels.** ``daemon_log``'s callable takes an explicit ``level=``. Without one, the level comes
  from how the daemon's message *starts* (after its ``[run]`` prefix), from the table
  ``LEVELS`` below, one place to read and test: a page or a lost page is ERROR, a step the sentinel
  took or a problem it worked around is WARNING, the rest is INFO.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from typing import IO

LOG_FORMATS = ("text", "json")
ENV_FORMAT = "SENTINEL_LOG_FORMAT"
LOGGER = "sentinel"

# How a daemon message starts (after "[run] ") -> its level. First match wins; the rest is INFO.
LEVELS: tuple[tuple[re.Pattern[str], int], ...] = tuple((re.compile(p), lvl) for p, lvl in (
    (r"PAGE:", logging.ERROR),
    (r"SENTINEL CANNOT KEEP UP", logging.ERROR),
    (r"internal error", logging.ERROR),
    (r"could not reach Alertmanager|Alertmanager did not answer", logging.ERROR),
    (r"could not restart the embedded bus", logging.ERROR),
    (r"WARNING:?", logging.WARNING),
    (r"sent ", logging.WARNING),
    (r"ack \S+ \S+: (failed|rejected)", logging.WARNING),
    (r"BACKLOG", logging.WARNING),
    (r"rejected \S+ entry", logging.WARNING),
    (r"control bus .*error", logging.WARNING),
    (r"embedded bus of .* was down", logging.WARNING),
    (r"leader lease lost", logging.WARNING),
    (r"persisted policy state is unreadable", logging.WARNING),
    (r"the steps stream (held entries|started over)", logging.WARNING),
    (r"the bus holds no checkpoint entry", logging.WARNING),
    (r"cannot write ", logging.WARNING),
    (r"\d+ more live runs on the bus than --max-runs", logging.WARNING),
))  # fmt: skip
_RUN_PREFIX = re.compile(r"\[([^\]\s]{1,200})\] ")


def split_run(message: str) -> tuple[str | None, str]:
    """``"[run] text"`` -> ``("run", "text")``; a message without the prefix -> ``(None, message)``."""
    m = _RUN_PREFIX.match(message)
    return (m.group(1), message[m.end():]) if m else (None, message)


def level_of(message: str) -> int:
    """The level of a daemon message (``LEVELS``), ``[run]`` prefix or not."""
    text = split_run(message)[1]
    return next((lvl for pattern, lvl in LEVELS if pattern.match(text)), logging.INFO)


def _utc(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{int(created % 1 * 1000):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, run (and exc)."""

    def format(self, record: logging.LogRecord) -> str:
        prefixed, rest = split_run(record.getMessage())
        run = getattr(record, "run", None) or prefixed
        message = rest if prefixed is not None and prefixed == run else record.getMessage()
        out = {"time": _utc(record.created), "level": record.levelname, "logger": record.name,
               "message": message, "run": run}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class PlainFormatter(logging.Formatter):
    """``<UTC time> <LEVEL> <message>``: for a pipe, a file or a container log."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_utc(record.created)} {record.levelname} {record.getMessage()}"
        return line + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def resolve_format(fmt: str | None) -> str:
    """``fmt``, else ``$SENTINEL_LOG_FORMAT``, else ``text``; ValueError for anything else."""
    chosen = (fmt or os.environ.get(ENV_FORMAT) or "text").strip().lower()
    if chosen not in LOG_FORMATS:
        raise ValueError(f"log format {chosen[:40]!r}: use one of {', '.join(LOG_FORMATS)}"
                         + ("" if fmt else f" (from ${ENV_FORMAT})"))
    return chosen


class _StderrHandler(logging.StreamHandler):
    """A stream handler on whatever ``sys.stderr`` is when a line is written (as logging's own
    last-resort handler), never on a stream captured once and closed since."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _handler(fmt: str, stream: IO[str] | None) -> logging.Handler:
    if fmt == "text" and (stream or sys.stderr).isatty():
        from rich.console import Console
        from rich.logging import RichHandler

        console = Console(file=stream, stderr=stream is None, highlight=False)
        console.width = max(100, console.width)
        return RichHandler(console=console, show_path=False, markup=False, rich_tracebacks=False,
                           log_time_format="%H:%M:%S")
    h: logging.Handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    h.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    return h


def configure(fmt: str | None = None, stream: IO[str] | None = None, level: int = logging.INFO) -> logging.Logger:
    """Give the ``sentinel`` logger one handler (replacing the last one set here) and return it.
    ``stream`` None: the process's stderr at the time of each line."""
    logger = logging.getLogger(LOGGER)
    unconfigure()
    h = _handler(resolve_format(fmt), stream)
    h._sentinel_logs = True  # type: ignore[attr-defined]
    logger.addHandler(h)
    logger.setLevel(level)
    return logger


def unconfigure() -> None:
    """Remove the handler ``configure`` set (the logger's other handlers stay)."""
    logger = logging.getLogger(LOGGER)
    for h in [h for h in logger.handlers if getattr(h, "_sentinel_logs", False)]:
        logger.removeHandler(h)
        h.close()


def daemon_log(logger: logging.Logger | None = None) -> Callable[..., None]:
    """The ``log(message, level=None)`` callable the Daemon and the Fleet are given."""
    logger = logger or logging.getLogger(f"{LOGGER}.daemon")
    if logger.name == LOGGER:
        logger = logger.getChild("daemon")

    def log(message: str, level: int | None = None) -> None:
        run, _ = split_run(message)
        logger.log(level_of(message) if level is None else level, "%s", message, extra={"run": run})

    return log
