"""Shared CLI plumbing: one-line errors, --json output, --redis-url, and RUN resolution."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import click


class SentinelError(click.ClickException):
    """A user-facing error: printed as one line (``error: ...``), exit code 2 unless given."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None):
        click.echo(f"error: {self.format_message()}", err=True)


def friendly_errors(fn):
    """Turn expected failures (bad files, Redis down, schema errors) into one line, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from sentinel.protocol import SchemaError

        try:
            return fn(*args, **kwargs)
        except click.ClickException:
            raise
        except SchemaError as e:
            raise SentinelError(str(e)) from None
        except OSError as e:  # a missing, unreadable or impossible path (a name longer than the filesystem allows)
            name = getattr(e, "filename", None)
            shown = (str(name)[:120] + "...") if name is not None and len(str(name)) > 120 else name
            why = e.strerror or " ".join(str(e).split()) or type(e).__name__
            raise SentinelError(f"{why}: {shown}" if shown is not None else why) from None
        except Exception as e:  # matched by module so this file imports neither redis nor torch
            mod = type(e).__module__
            if mod.startswith(("redis", "valkey")):
                raise SentinelError(f"control bus unreachable or failed: {e.__class__.__name__}: {_redact(str(e))}") from None
            if any(c.__module__.startswith(("sentinel.", "trainer.")) and c.__name__.endswith("Error") for c in type(e).__mro__):
                # our own one-line errors (BusError, RulesError, DataError, CheckpointError, ...) and
                # their subclasses (BusUnavailable)
                raise SentinelError(_redact(str(e)).splitlines()[0] if str(e) else type(e).__name__) from None
            raise

    return wrapper


class FiniteFloat(click.ParamType):
    """A number within [lo, hi], finite: click's FloatRange lets NaN through (every comparison with
    NaN is false), and a NaN or 1e300 timeout makes a directive that never expires and a wait that
    never ends."""

    name = "float"

    def __init__(self, lo: float, hi: float):
        self.lo, self.hi = lo, hi

    def convert(self, value, param, ctx):
        import math

        try:
            x = float(value)
        except (TypeError, ValueError, OverflowError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x) or not self.lo <= x <= self.hi:
            self.fail(f"{value!r} is not a number in [{self.lo:g}, {self.hi:g}]", param, ctx)
        return x

    def get_metavar(self, param, ctx=None) -> str:  # click 8.1 and 8.2 both call it
        return f"FLOAT {self.lo:g}-{self.hi:g}"


class OneLineText(click.ParamType):
    """Free text that goes into signed directives, audit logs and terminals (``--reason``): valid
    UTF-8 (a lone surrogate from undecodable argv bytes cannot be serialised and once broke every
    restart of a run), no control characters (an escape sequence would be echoed to the next
    operator's terminal), at most ``MAX`` characters."""

    name = "text"
    MAX = 2000

    def convert(self, value, param, ctx):
        v = str(value)
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            self.fail("not valid UTF-8 text", param, ctx)
        if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in v):
            self.fail("control characters are not allowed (one line of plain text)", param, ctx)
        if len(v) > self.MAX:
            self.fail(f"longer than {self.MAX} characters", param, ctx)
        return v


class ConsumerName(OneLineText):
    """A consumer name (``--consumer``): it goes into the log, the leader lease and the signed
    directives' ``issuer``, so one word of plain text, at most ``MAX`` characters."""

    name = "name"
    MAX = 128

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not v or any(c.isspace() for c in v):
            self.fail("one word, without spaces", param, ctx)
        return v


def not_empty(ctx, param, value):
    """Refuse a run, path or id given as "": read as "." or as "not given", it silently meant
    something else (`backtest ""` judged the current directory, `incidents --id ""` listed every
    incident, `backtest --rules ""` took the built-in rules)."""
    if value == "" or (isinstance(value, tuple) and "" in value):
        raise click.BadParameter("an empty value names nothing", ctx, param)
    return value


def _redact(text: str) -> str:
    """Never print secrets: every word with an ``@`` in it (a URL's userinfo, however broken the
    URL: ``redis://:pw/x@host``) has its password replaced (``bus.redact_url``)."""
    import re

    from sentinel.bus import redact_url

    return re.sub(r"\S*@\S*", lambda m: redact_url(m.group()), text)


def make_progress(enabled: bool):
    """A rich progress bar on stderr for a person; a no-op (None) for scripts."""
    if not enabled:
        return None, None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    task = bar.add_task("starting", total=None)

    def report(done: int, total: int, desc: str) -> None:
        bar.update(task, completed=done, total=max(total, 1), description=desc)

    return bar, report


def json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of tables.")(fn)


def redis_url_option(fn):
    return click.option(
        "--redis-url",
        envvar="SENTINEL_REDIS_URL",
        default=None,
        metavar="URL",
        help="Shared Redis (redis:// or rediss:// with AUTH). Default: the run's embedded bus. Env: SENTINEL_REDIS_URL.",
    )(fn)


def secret_file_option(fn, what: str = "HMAC secret file"):
    return click.option("--secret-file", type=click.Path(dir_okay=False),
                        help=f"{what} (mode 0600); without it: env SENTINEL_SECRET, then RUN_DIR/bus/secret.")(fn)


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def emit_runs(runs: list[dict], as_json: bool, render) -> None:
    """The per-run results of an on-call command: ``{"runs": [...]}`` with --json, else ``render(runs)``."""
    if as_json:
        emit_json({"runs": runs})
        return
    warn_rejected(runs)
    console = console_for_output()
    if not runs:
        console.print("[dim]no runs registered on the bus[/]")
    console.print(render(runs))


def console_for_output(stderr: bool = False):
    """A rich console; when output is piped, wide enough that rows are not cut to 80 columns."""
    from rich.console import Console

    c = Console(stderr=stderr)
    # an explicit COLUMNS (a narrow pager, a test of the 80-column layout) wins over the pipe default
    return c if c.is_terminal or os.environ.get("COLUMNS") else Console(stderr=stderr, width=200)


def warn_rejected(runs: list[dict]) -> None:
    """What a view skipped is said, on stderr so that the table stays clean."""
    for run in runs:
        if run.get("rejected_lines"):
            click.echo(f"warning: {run.get('run')}: skipped {run['rejected_lines']} malformed line(s) of the run directory; "
                       f"first: {run.get('first_rejected')}", err=True)
        if run.get("rejected_bus_entries"):
            click.echo(f"warning: {run.get('run')}: skipped {run['rejected_bus_entries']} malformed entr(y/ies) of the control "
                       f"bus; first: {run.get('first_rejected_bus_entry')}", err=True)


def bus_entry(hash_name: str, field) -> str:
    """Names a skipped entry of a bus hash for the operator: the hash and its field, cut short. Never
    the value (it may be a megabyte of anything)."""
    f = field.decode("utf-8", "replace") if isinstance(field, bytes) else str(field)
    return f"{hash_name} hash, field {f[:40]!r}" + ("..." if len(f) > 40 else "")


WRONG_TYPE = object()  # what ``read_unless_wrong_type`` returns for a key of another Redis type


def read_unless_wrong_type(r, read):
    """``read()`` with one-line bus errors, or ``WRONG_TYPE`` when the key holds another Redis type:
    anyone with bus access can SET a hash's name, and a view must not die of it."""
    from sentinel import bus

    try:
        with bus.bus_errors(r):
            return read()
    except bus.BusError as e:
        if "WRONGTYPE" not in str(e):
            raise
        return WRONG_TYPE


def read_or_reject(r, what: str, read, rejected: list[str], empty):
    """``read()``; a key of the wrong Redis type is skipped and counted like a malformed entry, so
    that the view still shows the rest."""
    got = read_unless_wrong_type(r, read)
    if got is WRONG_TYPE:
        rejected.append(f"{what} key, of the wrong Redis type")
        return empty
    return got


def count_bus_entries(out: dict, rejected: list[str]) -> None:
    """The ``--json`` fields saying what the view skipped on the bus (and what warn_rejected says)."""
    out["rejected_bus_entries"], out["first_rejected_bus_entry"] = len(rejected), (rejected[0] if rejected else None)


def fmt_clock(t, fmt: str = "%H:%M:%S", utc: bool = False) -> str:
    """A wall-clock time for a table (local, or UTC); "?" for a value no clock can show (a corrupt
    or hostile line's "x", NaN or 1e30 must not take the whole view down with it)."""
    import time

    if isinstance(t, bool) or not isinstance(t, (int, float)):
        return "?"
    try:
        return time.strftime(fmt, time.gmtime(t) if utc else time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "?"


def looks_like_run_dir(run: str) -> bool:
    try:
        is_dir = Path(run).is_dir()
    except OSError:  # a name too long for the filesystem (3.11's is_dir raises ENAMETOOLONG): no directory
        is_dir = False
    return is_dir or os.sep in run or run.startswith(".")


def is_tty() -> bool:
    return sys.stdout.isatty()


# --------------------------------------------------------------------------------------------
# A signed directive by hand: publish it and wait for the trainer's ack (rollback, pause, ...)
# --------------------------------------------------------------------------------------------


def send_and_wait(ref, d, timeout: float, *, console, as_json: bool, doing: str, secret: bytes | None = None):
    """Publish the signed directive ``d`` on the run's directives stream and wait up to ``timeout``
    seconds for the trainer's Ack (returned; None on timeout), with a spinner for a person. With
    ``secret``, only an ack the trainer signed counts."""
    from sentinel import bus
    from sentinel.acks import last_ack_id, wait_ack

    after = last_ack_id(ref)  # before publishing, so a fast ack is not missed
    eid = bus.publish_own(ref.r, ref.keys.directives, d)
    try:
        if as_json:
            return wait_ack(ref, d.id, after, timeout, secret=secret, entry_id=eid)
        with console.status(f"{doing}: waiting for the trainer's ack...") as st:
            return wait_ack(ref, d.id, after, timeout, secret=secret, entry_id=eid, on_tick=lambda el: st.update(
                f"{doing}: waiting for the trainer's ack... {el:.0f}s / {timeout:.0f}s"))
    except bus.BusError as e:
        raise lost_ack_error(ref, d, e) from None


def _expiry(d) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(d.expires_at))


def no_ack_error(ref, d, timeout: float) -> SentinelError:
    return SentinelError(f"no ack from the trainer of {ref.run} within {timeout:.0f}s; directive {d.id[:8]} expires "
                         f"unapplied at {_expiry(d)} (check `sentinel status {ref.run}`)", exit_code=1)


def lost_ack_error(ref, d, e: Exception) -> SentinelError:
    """The bus failed (a stalled or dead server) after directive ``d`` went out: the trainer may have it."""
    return SentinelError(f"directive {d.id[:8]} is on the bus, but waiting for its ack failed ({e}); the trainer of "
                         f"{ref.run} may still apply it until {_expiry(d)} (check `sentinel status {ref.run}`)",
                         exit_code=1)


# --------------------------------------------------------------------------------------------
# The offline views of a stopped run: its embedded bus being down is expected, not news
# --------------------------------------------------------------------------------------------

STEPS_QUIET_S = 60.0  # steps.jsonl unchanged this long: no trainer is writing it (status's offline-writing)
LOCK_FILE = "trainer.lock"  # trainer/rundir_lock.py: the trainer's rank 0 holds an exclusive flock on it


def trainer_holds_lock(run_dir: Path) -> bool | None:
    """Whether a process on this machine holds ``RUN_DIR/trainer.lock`` (the kernel's /proc/locks,
    read without touching the lock: taking it, even shared, could make a starting trainer refuse
    to start). False with no lock file; None when it cannot be known (no /proc/locks)."""
    try:
        st = (Path(run_dir) / LOCK_FILE).stat()
    except FileNotFoundError:
        return False
    except OSError:
        return None
    key = f" {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    try:
        with open("/proc/locks") as f:
            return any(key in line for line in f)
    except OSError:
        return None


def run_has_stopped(run_dir: Path | None) -> bool:
    """A run directory whose trainer has stopped: no process on this machine holds its lock, and its
    steps.jsonl has not changed for a minute (a trainer on another node writes it)."""
    if run_dir is None or trainer_holds_lock(run_dir) is not False:
        return False
    from sentinel import rundir

    mt = rundir.steps_mtime(run_dir)
    import time

    return mt is None or time.time() - mt >= STEPS_QUIET_S


def files_source_line(run: dict, source: str):
    """The line a view prints above what it read from ``source`` in the run directory instead of the bus
    (``run["source"] == "files"``): the bus's note (``offline_note``) in yellow; for a run that has stopped,
    whose bus is down by design, a dim line with nothing to warn of. None when the view read the bus."""
    from rich.text import Text

    if run["source"] != "files":
        return None
    if run.get("note"):
        return Text(f"{run['run']}: {run['note']}; from {source}:", style="yellow")
    return Text(f"{run['run']}: the run has stopped; from {source}:", style="dim")


def offline_note(ref) -> str | None:
    """The note a view prints about the missing bus: ``ref.bus_note``, except for a run that has
    stopped read without an explicit bus (--redis-url, SENTINEL_REDIS_URL): its own embedded bus is
    down because the run is over, and saying so at every view is noise. An explicit bus that is down
    is always said."""
    if ref.bus_note is None:
        return None
    ctx = click.get_current_context(silent=True)
    explicit = (ctx is not None and ctx.params.get("redis_url")) or os.environ.get("SENTINEL_REDIS_URL")
    if not explicit and run_has_stopped(ref.run_dir):
        return None
    return ref.bus_note
