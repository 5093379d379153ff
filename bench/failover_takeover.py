"""How long a run goes unwatched when its leading sentinel dies or hangs.

    PYTHONPATH=. python bench/failover_takeover.py [--lease-seconds 10] [--trials 3]

Starts Debian's redis-server (foreground, 127.0.0.1, a free port) and, per trial, two
`sentinel run` processes on one run; the leader is SIGKILLed (dead, on this host: the standby sees
its pid gone and takes the lease at once) or SIGSTOPped (hung: what a standby on another host sees
of a dead one, it waits out the lease). Prints the seconds from the signal until the standby holds
the lease, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis

from sentinel.protocol import Keys


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lease-seconds", type=float, default=10.0)
    ap.add_argument("--trials", type=int, default=3)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(tempfile.mkdtemp())
    srv = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    secret = tmp / "secret"
    secret.write_text("s" * 40)
    secret.chmod(0o600)
    out: dict = {"lease_s": a.lease_seconds}
    try:
        r = redis.Redis.from_url(url)
        for _ in range(100):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        for how in ("SIGKILL", "SIGSTOP"):
            for trial in range(a.trials):
                k = Keys(f"takeover-{how}-{trial}")
                procs = []
                for n in range(2):
                    procs.append(subprocess.Popen([sys.executable, "-m", "sentinel", "run", k.run, "--redis-url", url, "--secret-file",
                                                   str(secret), "--consumer", f"s{n}", "--lease-seconds", str(a.lease_seconds)],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
                    while n == 0 and not r.get(k.leader):
                        time.sleep(0.05)
                time.sleep(3)  # the standby is up and standing by
                holder = json.loads(r.get(f"{k.leader}:holder"))
                t0 = time.monotonic()
                os.kill(holder["pid"], getattr(signal, how))
                while (r.get(k.leader) or b"").decode() in ("", holder["consumer"]):
                    time.sleep(0.01)
                out.setdefault(how, []).append(round(time.monotonic() - t0, 2))
                for p in procs:
                    if how == "SIGSTOP" and p.pid == holder["pid"]:
                        os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                    p.wait()
    finally:
        srv.terminate()
        srv.wait()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
