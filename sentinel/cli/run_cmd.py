"""``sentinel run``: the daemon."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import click

from sentinel.cli.common import SentinelError, friendly_errors, redis_url_option


def _console_log():
    from rich.console import Console

    console = Console(stderr=True, highlight=False, log_path=False, width=max(100, Console().width))

    def log(msg: str) -> None:
        style = "bold red" if ("PAGE" in msg or "escalat" in msg) else ("yellow" if "sent " in msg else None)
        console.log(msg, style=style)

    return log


@click.command("run")
@click.argument("runs", nargs=-1, metavar="[RUN_DIR_OR_ID]...")
@redis_url_option
@click.option("--rules", "rules_file", type=click.Path(dir_okay=False), help="Rules YAML (default: the built-in rules).")
@click.option("--secret-file", type=click.Path(dir_okay=False), help="HMAC secret for directives (default: RUN_DIR/bus/secret; env SENTINEL_SECRET).")
@click.option("--dry-run", is_flag=True, help="Decide and record, but send no directive.")
@click.option("--require-approval", is_flag=True, default=None, help="Page and wait for `sentinel approve` before acting.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@click.option("--metrics-port", type=int, default=None, help="Serve sentinel_* metrics on this port (0: a free port).")
@click.option("--consumer", help="Consumer name in the group (default: host-pid). Reuse it to resume exactly this consumer's pending work.")
@click.option("--alertmanager-url", help="Post pages to this Alertmanager (e.g. http://127.0.0.1:9093).")
@click.option("--lease-ms", type=int, default=10_000, show_default=True, help="Leader lease TTL (HA: one sentinel acts per run).")
@friendly_errors
def run(runs, redis_url, rules_file, secret_file, dry_run, require_approval, metrics_host, metrics_port, consumer,
        alertmanager_url, lease_ms):
    """Watch every step of the given runs (run dirs or run ids; none: every run on the bus) and act.

    The first SIGTERM/Ctrl-C finishes the current batch, saves state and releases leases (warm
    stop); a second one exits at once (cold stop).
    """
    from sentinel import bus
    from sentinel.daemon import Daemon, Options
    from sentinel.metrics import SentinelMetrics
    from sentinel.rules import RulesError, default_rules, load_rules

    run_dirs = [Path(r) for r in runs if Path(r).is_dir()]
    for r in runs:
        if ("/" in r or r.startswith(".")) and not Path(r).is_dir():
            raise SentinelError(f"run directory not found: {r}")
    try:
        rules = load_rules(rules_file) if rules_file else default_rules()
    except RulesError as e:
        raise SentinelError(str(e)) from None
    first_dir = run_dirs[0] if run_dirs else None
    url = bus.resolve_url(first_dir, redis_url)
    secret = bus.load_secret(first_dir, secret_file)
    r = bus.connect(url)
    ids = []
    for item in runs:
        p = Path(item)
        if p.is_dir():
            ids.append(_run_id_of(p))
        else:
            ids.append(item)
    opts = Options(rules=rules, secret=secret, dry_run=dry_run, require_approval=require_approval,
                   alertmanager_url=alertmanager_url, lease_ms=lease_ms)
    if consumer:
        opts.consumer = consumer
    log = _console_log()
    metrics = SentinelMetrics()
    if metrics_port is not None:
        port = metrics.serve(metrics_host, metrics_port)
        log(f"sentinel metrics on http://{metrics_host}:{port}/metrics")
    daemon = Daemon(r, opts, runs=ids or None, metrics=metrics, log=log)
    stops = {"n": 0}

    def on_signal(signum, frame):
        stops["n"] += 1
        if stops["n"] == 1:
            log("warm stop requested: finishing the current batch (signal again to stop now)")
            daemon.stop_requested = True
        else:
            log("cold stop")
            sys.exit(130)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log(f"sentinel {opts.consumer} on {bus.redact_url(url)}" + (" (dry run)" if dry_run else "")
        + (f", runs: {', '.join(ids)}" if ids else ", all registered runs"))
    daemon.run_forever()
    log("stopped")


def _run_id_of(run_dir: Path) -> str:
    """The run id a trainer uses for this dir: config.yaml's run_id, else the directory name."""
    import yaml

    cfg = run_dir / "config.yaml"
    if cfg.is_file():
        try:
            rid = (yaml.safe_load(cfg.read_text()) or {}).get("run_id")
            if rid:
                return str(rid)
        except yaml.YAMLError:
            pass
    return run_dir.resolve().name
