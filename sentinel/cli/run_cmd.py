"""``sentinel run``: the daemon."""

from __future__ import annotations

import gc
import signal
import sys
from pathlib import Path

import click

from sentinel.cli.common import ConsumerName, SentinelError, friendly_errors, not_empty, redis_url_option
from sentinel.logs import ENV_FORMAT, LOG_FORMATS, configure, daemon_log
from sentinel.shards import MAX_WORKERS

# a run's state saved (and its step entries acknowledged) at most every 4 s when only step records
# moved it: at 10 steps/s per run, a save per step would cost a fleet of 300 runs more than the
# rules do, and every 2 s a sixth of the daemon's CPU once the runs' histories are full
# (docs/benchmarks/daemon-scale.md); a successor judges the unacknowledged ones again (at most
# 4 s of records a run: ~40 at 10 steps/s)
STATE_SAVE_S = 4.0
# a step read at most every 25 µs per run led (7.5 ms at 300 runs; at most PACE_MAX_S, 20 ms): a read
# names every stream, so back to back at 300 runs each took ~18 records: paced, 0.70-0.73 of a core
# against 0.83-0.84 unpaced, alternated (docs/benchmarks/daemon-scale.md, 2026-11-30 evening). 50 µs
# until 2026-12-01, when the iterations' own cost had fallen: 25 µs took the p50 from ~13 to ~7.5 ms
# and the p99 at 300 runs from a mean of 69.7 to 58.7 ms for ~5 % more CPU; 12.5 µs added ~8 % more
# CPU for a gain the noise did not settle
PACE_PER_RUN_S = 25e-6
# a healthy run's acks and approvals read (and its clock rules run) at most every ~0.5 s, not at
# each of its steps (docs/benchmarks/daemon-scale.md, 2026-12-01). A run in an incident, or just
# sent an action, reads them at every poll; checkpoints are read at every poll
SIDE_READ_S = 0.5


def _check_alertmanager_url(url: str) -> None:
    """An http(s) URL with a host, or a one-line error now: a bad one would otherwise surface only
    at the first page, as a delivery failure in the middle of an incident. The URL may carry basic
    auth (``https://user:password@am:9093``): it is never shown with its password."""
    from urllib.parse import urlsplit

    from sentinel.bus import redact_url

    shown = repr(redact_url(url)[:80])
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises on a port that is not a number or out of range
    except ValueError as e:
        raise SentinelError(f"--alertmanager-url {shown}: not a URL ({redact_url(str(e))[:120]})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SentinelError(f"--alertmanager-url {shown}: use http://HOST:PORT or https://HOST:PORT")
    try:
        parts.hostname.encode("idna")
    except UnicodeError:
        raise SentinelError(f"--alertmanager-url {shown}: {parts.hostname[:80]!r} is no valid host name") from None


def _run_dir_problem(path: str, created: list[str]) -> str | None:
    """Why the RUN_DIR argument ``path`` is no run directory (as the other commands say it), or None. A
    run dir that does not exist yet, in a directory that does, is created (appended to ``created``): the
    sentinel may start before the trainer, which then finds the embedded bus waiting in it."""
    import os
    import stat

    from sentinel.runref import printable

    shown = printable(path, 200)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return f"run directory not found: {shown}, and its parent {printable(parent, 200)} does not exist either"
        try:
            os.mkdir(path, 0o755)
        except OSError as e:
            return f"run directory {shown}: cannot create it ({e.strerror or type(e).__name__})"
        created.append(path)
        return None
    except OSError as e:  # a parent that is a file, no permission, a name too long
        return f"run directory {shown}: {e.strerror or type(e).__name__}"
    if not stat.S_ISDIR(st.st_mode):
        return f"not a directory: {shown}"
    return None


def _shard_option(ctx, param, value):
    if value is None:
        return None
    from sentinel.shards import parse_shard

    try:
        return parse_shard(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


@click.command("run")
@click.argument("runs", nargs=-1, metavar="[RUN_DIR_OR_ID]...", callback=not_empty)
@redis_url_option
@click.option("--rules", "rules_file", type=click.Path(dir_okay=False), help="Rules YAML (default: the built-in rules).")
@click.option("--secret-file", type=click.Path(dir_okay=False),
              help="HMAC secret file for directives (mode 0600); without it: env SENTINEL_SECRET, then RUN_DIR/bus/secret.")
@click.option("--dry-run", is_flag=True, help="Decide and record, but send no directive.")
@click.option("--require-approval", is_flag=True, default=None, help="Page and wait for `sentinel approve` before acting.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True,
              help="Address the metrics endpoint binds (0.0.0.0 for a Prometheus on another host).")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None, help="Serve sentinel_* metrics on this port (0: a free port).")
@click.option("--consumer", type=ConsumerName(),
              help="Consumer name in the group (default: host-pid). Reuse it to resume exactly this consumer's pending work.")
@click.option("--alertmanager-url", envvar="SENTINEL_ALERTMANAGER_URL", show_envvar=True,
              help="Post pages to this Alertmanager (e.g. http://127.0.0.1:9093; basic auth in the URL is never shown).")
@click.option("--lease-seconds", type=click.FloatRange(0.5, 3600.0), default=None,
              help="Leader lease period in seconds [default: 10]. One sentinel acts per run; a standby takes "
                   "over within this after the leader's last renewal, at once when the leader was a "
                   "process of this machine that died. Shorter: faster takeover, more renewals (one every third).")
@click.option("--lease-ms", type=click.IntRange(500, 3_600_000), default=None,
              help="The lease period in ms (the same setting as --lease-seconds).")
@click.option("--max-runs", type=click.IntRange(1, 100_000), default=1024, show_default=True,
              help="With no run named: watch at most this many live runs (a run is live when its trainer signed a step "
                   "record in the last day, or its heartbeat is on).")
@click.option("--workers", type=click.IntRange(1, MAX_WORKERS), default=1, show_default=True, envvar="SENTINEL_WORKERS",
              show_envvar=True,
              help="Worker processes, each watching its share of the runs (a hash of the run id), one metrics endpoint "
                   "for all (a worker label on each series). About one per 100-150 runs, up to the cores: at 300 "
                   "runs on 2 vCPUs, 2 workers read a verdict p99 of ~44 ms where one process read ~68 ms (medians), "
                   "for ~30 % more CPU. --max-runs is per worker.")
@click.option("--worker", "shard", callback=_shard_option, hidden=True)  # set by the supervisor: this worker's I/K
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default="text", show_default=True,
              envvar=ENV_FORMAT, show_envvar=True,
              help="text: a console on a terminal, plain lines elsewhere; json: one object per line "
                   "(time, level, logger, message, run) for Loki or ELK.")
@friendly_errors
def run(runs, redis_url, rules_file, secret_file, dry_run, require_approval, metrics_host, metrics_port, consumer,
        alertmanager_url, lease_seconds, lease_ms, max_runs, workers, shard, log_format):
    """Watch every step of the given runs (run dirs or run ids; none: every run on the bus) and act.

    The first SIGTERM/Ctrl-C finishes the current batch, saves state and releases leases (warm
    stop); a second one exits at once (cold stop). With --workers, the signals are passed on to
    every worker.
    """
    from dataclasses import replace

    from sentinel import bus
    from sentinel.daemon import Daemon, Options
    from sentinel.fleet import Fleet, Member
    from sentinel.metrics import SentinelMetrics
    from sentinel.rules import RulesError, default_rules
    from sentinel.rules_file import load_rules
    from sentinel.rundir import run_id_of

    if lease_seconds is not None and lease_ms is not None:
        raise SentinelError("give --lease-seconds or --lease-ms, not both")
    lease_ms = int(lease_seconds * 1000) if lease_seconds is not None else (lease_ms or 10_000)
    if alertmanager_url is not None:
        _check_alertmanager_url(alertmanager_url)
    created: list[str] = []
    for r in runs:
        if "/" in r or r.startswith("."):
            bad = _run_dir_problem(r, created)
            if bad:
                raise SentinelError(bad)
    try:
        rules = load_rules(rules_file) if rules_file else default_rules()
    except RulesError as e:
        raise SentinelError(str(e)) from None
    opts = Options(rules=rules, secret=b"", dry_run=dry_run, require_approval=require_approval,
                   alertmanager_url=alertmanager_url, lease_ms=lease_ms, max_runs=max_runs, state_save_s=STATE_SAVE_S,
                   pace_per_run_s=PACE_PER_RUN_S, side_read_s=SIDE_READ_S,
                   run_dirs={run_id_of(Path(x)): Path(x) for x in runs if Path(x).is_dir()})
    if consumer:
        opts.consumer = consumer
    log = daemon_log(configure(log_format))
    for d in created:
        log(f"created {d}: the run has not started yet; its trainer will find the bus waiting there")
    if workers > 1 and shard is None:
        sys.exit(_supervise(runs, workers, opts.consumer, dict(
            redis_url=redis_url, rules_file=rules_file, secret_file=secret_file, dry_run=dry_run,
            require_approval=require_approval, alertmanager_url=alertmanager_url, lease_ms=lease_ms,
            max_runs=max_runs, log_format=log_format), metrics_host, metrics_port, log))
    if shard is not None:
        from sentinel.shards import in_shard
        from sentinel.workers import watch_parent

        watch_parent()
        mine = [x for x in runs if in_shard(_run_id(x), shard)]
        if runs and not mine:
            raise SentinelError(f"worker {shard[0]}/{shard[1]}: none of the runs named is its share")
        runs = tuple(mine)
        # a fleet's reads as often as one process's: each worker leads about 1/K of the runs
        opts = replace(opts, shard=shard, pace_per_run_s=PACE_PER_RUN_S * shard[1])
    metrics = SentinelMetrics()
    members = []
    for (url, secret, run_dir), ids in _bus_groups(runs, redis_url, secret_file).items():
        r = bus.connect(url)
        daemon = Daemon(r, replace(opts, secret=secret), runs=ids or None, metrics=metrics, log=log)
        members.append(Member(daemon, url, run_dir))
    if metrics_port is not None:
        try:
            port = metrics.serve(metrics_host, metrics_port)
        except OSError as e:  # a host that does not resolve (gaierror), a port in use or not allowed
            raise SentinelError(f"cannot serve metrics on {metrics_host!r} port {metrics_port}: {e.strerror or e}") from None
        log(f"sentinel metrics on http://{metrics_host}:{port}/metrics")
    fleet = Fleet(members, metrics, log)
    stops = {"n": 0}

    def on_signal(signum, frame):
        stops["n"] += 1
        if stops["n"] == 1:
            log("warm stop requested: finishing the current batch (signal again to stop now)")
            fleet.stop_requested = True
        else:
            log("cold stop")
            sys.exit(130)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for m in members:
        ids = m.daemon.fixed_runs
        log(f"sentinel {opts.consumer} on {m.label}" + (" (dry run)" if dry_run else "")
            + (f", runs: {', '.join(ids)}" if ids else ", all registered runs") + f"; lease {lease_ms / 1000:g} s")
    if not alertmanager_url:
        log(NO_ALERTMANAGER_WARNING)
    # what exists now (modules, classes, the rules: some 56,000 objects) lives as long as the
    # process: frozen out of the collector's sight, a full collection walks only the runs' own
    # objects (about 150 a run); and a young generation of 20,000 (not 700) lets a step's
    # temporaries die before they are walked at all. A fleet of 300 runs paused 50-200 ms in
    # gen-2 collections before (docs/benchmarks/daemon-scale.md)
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
    fleet.run_forever()
    log("stopped")


def _run_id(item: str) -> str:
    """A RUN_DIR_OR_ID argument's run id (as ``_bus_groups`` reads it): a directory's, else the text."""
    from sentinel.rundir import run_id_of

    return run_id_of(Path(item)) if Path(item).is_dir() else item


def _supervise(runs, count: int, consumer: str, given: dict, metrics_host: str, metrics_port: int | None, log) -> int:
    """``--workers K``: start worker I of K for each share that holds a run named (every share when
    none is: each discovers its own), serve their metrics as one, pass signals on; the exit status."""
    import os

    from sentinel.client.metrics import MetricsRegistry
    from sentinel.metrics_http import serve
    from sentinel.shards import shard_of
    from sentinel.workers import Supervisor
    from sentinel.workers_metrics import WorkersCollector

    env = dict(os.environ)
    if given["redis_url"]:  # through the environment, as the secrets go: never in a process list
        env["SENTINEL_REDIS_URL"] = given["redis_url"]
    if given["alertmanager_url"]:
        env["SENTINEL_ALERTMANAGER_URL"] = given["alertmanager_url"]
    base = [sys.executable, "-m", "sentinel", "run", *runs, "--consumer", consumer, "--lease-ms", str(given["lease_ms"]),
            "--max-runs", str(given["max_runs"]), "--log-format", given["log_format"]]
    base += ["--rules", given["rules_file"]] if given["rules_file"] else []
    base += ["--secret-file", given["secret_file"]] if given["secret_file"] else []
    base += ["--dry-run"] if given["dry_run"] else []
    base += ["--require-approval"] if given["require_approval"] else []
    base += ["--metrics-host", "127.0.0.1", "--metrics-port", "0"] if metrics_port is not None else []
    ids = [_run_id(x) for x in runs]
    shares = sorted({shard_of(r, count) for r in ids}) if ids else list(range(count))
    sup = Supervisor({i: [*base, "--worker", f"{i}/{count}"] for i in shares}, count, log, env)
    if metrics_port is not None:
        registry = MetricsRegistry()
        registry.register(WorkersCollector(sup.ports, sup.restart_counts))
        try:
            _server, port = serve(registry, metrics_host, metrics_port)
        except OSError as e:
            raise SentinelError(f"cannot serve metrics on {metrics_host!r} port {metrics_port}: {e.strerror or e}") from None
        log(f"sentinel metrics on http://{metrics_host}:{port}/metrics")
    log(f"sentinel {consumer}: {len(shares)} worker(s) of {count}"
        + (f" for {len(ids)} runs" if ids else ", each discovering its share of the registered runs"))

    def on_signal(signum, frame):
        log("warm stop requested: passed on to the workers (signal again to stop them now)" if not sup.stops
            else "cold stop: passed on to the workers")
        sup.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = sup.run()
    log("stopped")
    return code


def _bus_groups(runs, redis_url, secret_file) -> dict[tuple[str, bytes, Path | None], list[str]]:
    """Group the runs by (bus URL, directive secret, supervised run dir): one daemon per group.

    A run directory on its embedded bus gets its own group (its own bus, secret and supervisor);
    run ids, and run dirs on a shared bus (--redis-url / SENTINEL_REDIS_URL), share one per
    (URL, secret). No runs at all: every run registered on the one bus.
    """
    import os

    from sentinel import bus
    from sentinel.embedded import restart_if_dead
    from sentinel.rundir import run_id_of

    groups: dict[tuple[str, bytes, Path | None], list[str]] = {}
    shared = redis_url or os.environ.get(bus.ENV_URL)
    for item in runs or [None]:
        p = Path(item) if item is not None else None
        if p is not None and not shared and p.is_dir() and not (p / "bus" / "url").is_file():
            # started before its run (`mkdir RUN_DIR && sentinel run RUN_DIR`): the run dir gets its embedded
            # bus now, and the run (our trainer, a callback's RunSession) finds and uses it when it starts
            from sentinel.embedded import ensure_embedded

            ensure_embedded(p)
        if p is not None and p.is_dir():
            embedded = not shared and (p / "bus" / "url").is_file()
            # the supervisor's first job: a dead embedded bus is restarted before we connect to it
            url = restart_if_dead(p)[0] if embedded else bus.resolve_url(p, redis_url)
            key = (url, bus.load_secret(p, secret_file), p.resolve() if embedded else None)
            groups.setdefault(key, []).append(run_id_of(p))
        else:
            key = (bus.resolve_url(None, redis_url), bus.load_secret(None, secret_file), None)
            ids = groups.setdefault(key, [])
            if item is not None:
                ids.append(item)
    return groups


NO_ALERTMANAGER_WARNING = (
    "no --alertmanager-url: pages reach NOBODY. They go only to this log, the bus's events "
    "stream and RUN_DIR/pages.jsonl (`sentinel pages RUN`); pass --alertmanager-url http://HOST:9093 to "
    "notify the on-call engineer.")
