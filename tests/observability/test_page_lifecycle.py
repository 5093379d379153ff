"""A page's life in a real Alertmanager (Debian's prometheus-alertmanager, foreground, 127.0.0.1).

One incident that waits for a human's approval (the run paused, the page out) is kept open past
Alertmanager's ``resolve_timeout`` and past the page's own ``endsAt``: the sentinel re-sends it,
so it stays active. Alertmanager is restarted (it keeps no alerts across a restart): the page
comes back. The operator approves, the rollback verifies, the incident closes: the receiver gets
the resolved notice. The page carries the rule, the incident and a ``runbook_url``. The compose
stack's inhibit rules (deploy/compose/alertmanager.yml) are loaded as they are: the Prometheus
``SentinelEscalation`` alert of the same escalation never reaches the receiver beside the page.

The re-send period and ``endsAt`` horizon are shortened (1 s, 3 s) so the test takes seconds; the
shipped ones are 20 s and 180 s, against Alertmanager's default ``resolve_timeout`` of 5 min.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from sentinel import bus, daemon_pages
from sentinel.protocol import Ack, Directive, Keys, TimelineRecord
from tests.helpers.daemon import NAN_STEP, SECRET, TARGET, incident_run, make_daemon, publish_steps
from tests.helpers.services import Webhook, find_binary, free_port, start_logged, stop_process, wait_http_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


class AM:
    def __init__(self, tmp: Path, hook: Webhook):
        self.bin, self.port, self.tmp, self.n = find_binary("prometheus-alertmanager"), free_port(), tmp, 0
        self.cfg = tmp / "alertmanager.yml"
        compose = yaml.safe_load((ROOT / "deploy" / "compose" / "alertmanager.yml").read_text())
        self.cfg.write_text(yaml.safe_dump({
            "global": {"resolve_timeout": "2s"},
            "route": {"receiver": "hook", "group_by": ["alertname", "run"], "group_wait": "0s", "group_interval": "1s",
                      "repeat_interval": "1h"},
            "inhibit_rules": compose["inhibit_rules"],
            "receivers": [{"name": "hook", "webhook_configs": [{"url": hook.url, "send_resolved": True}]}],
        }))  # fmt: skip
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> None:
        self.n += 1  # a fresh storage each time: nothing carried over but what the sentinel re-sends
        log = self.tmp / f"am-{self.n}.log"
        self.proc = start_logged([self.bin, f"--config.file={self.cfg}", f"--storage.path={self.tmp / f'am-{self.n}'}",
                            f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address=", "--log.level=warn"], log)
        wait_http_ready(f"{self.url}/-/ready", self.proc, log)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def active(self, alertname: str = daemon_pages.ALERTNAME) -> list[dict]:
        try:
            with urllib.request.urlopen(f"{self.url}/api/v2/alerts?active=true&inhibited=true", timeout=2) as f:
                got = json.loads(f.read())
        except OSError:
            return []
        return [a for a in got if a["labels"].get("alertname") == alertname and a["status"]["state"] == "active"]


def test_a_page_stays_up_while_its_incident_is_open_survives_a_restart_and_resolves_once(redis_server, unique_run, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(daemon_pages, "RESEND_S", 1.0)
    monkeypatch.setattr(daemon_pages, "ENDS_AFTER_S", 3.0)
    hook = Webhook()
    am = AM(tmp_path, hook)
    am.start()
    try:
        r = bus.connect(redis_server.url)
        run, k = unique_run, Keys(unique_run)
        d = make_daemon(r, run, require_approval=True, alertmanager_url=am.url)
        incident_run(r, run)

        def pump(until, timeout=15.0):
            t = time.monotonic() + timeout
            while time.monotonic() < t:
                d.iterate(block_ms=50)
                if until():
                    return
            raise AssertionError(f"not met in {timeout} s; {d.logs[-8:]}")

        pump(lambda: bool(am.active()))
        [page] = am.active()
        assert page["labels"]["rule"] == "nonfinite" and page["labels"]["run"] == run and page["labels"]["incident"]
        assert page["annotations"]["runbook_url"].endswith("/docs/runbooks/SentinelEscalation.md")
        iid = page["labels"]["incident"]
        # Prometheus' SentinelEscalation of the same escalation, as its rule would send it
        esc = json.dumps([{"labels": {"alertname": "SentinelEscalation", "run": run, "severity": "critical"},
                           "annotations": {"summary": f"Run {run}: the sentinel escalated to a human"}}]).encode()
        urllib.request.urlopen(urllib.request.Request(f"{am.url}/api/v2/alerts", data=esc, method="POST",
                                                      headers={"Content-Type": "application/json"}), timeout=2).close()

        # open past resolve_timeout (2 s) and the page's endsAt (3 s): active at every look
        t_end = time.monotonic() + 7
        while time.monotonic() < t_end:
            d.iterate(block_ms=50)
            assert len(am.active()) == 1, d.logs[-5:]
        # Alertmanager restarts with nothing: the page is back within the re-send period
        am.stop()
        am.start()
        assert am.active() == []
        t0 = time.monotonic()
        pump(lambda: bool(am.active()), timeout=10)
        back_s = time.monotonic() - t0
        print(f"PAGE back {back_s:.2f} s after the Alertmanager restart")
        assert back_s < 5, back_s

        # the operator approves; the rollback is applied and verifies: the incident closes, the page resolves
        bus.publish_own(r, k.approvals, Directive(run=run, kind="resume", incident_id=iid, issuer="cli:test").signed(SECRET))
        pump(lambda: any(bus.decode(e, Directive).kind == "rollback" for e in bus.read_stream(r, k.directives, "0-0")))
        [rb] = [x for x in (bus.decode(e, Directive) for e in bus.read_stream(r, k.directives, "0-0")) if x.kind == "rollback"]
        bus.publish(r, k.acks, Ack(run=run, directive_id=rb.id, kind="rollback", status="applied", step=TARGET, timeline=1),
                    secret=SECRET)
        bus.publish(r, k.steps, TimelineRecord(kind="rollback", run=run, from_step=TARGET, timeline=1, time=time.time(),
                                               directive_id=rb.id, skip_ranges=rb.ranges), secret=SECRET)
        publish_steps(r, run, range(TARGET + 1, NAN_STEP + 6), timeline=1)
        pump(lambda: not am.active() and any(a["status"] == "resolved" for a in hook.alerts()))
        assert json.loads(r.hget(k.incidents, iid))["state"] == "healthy"
        time.sleep(1.5)  # a late re-send would bring it back
        d.iterate(block_ms=50)
        assert am.active() == []
    finally:
        am.stop()
        hook.stop()
    names = [(a["labels"]["alertname"], a["status"]) for a in hook.alerts()]
    assert ("SentinelEscalation", "firing") not in names, names  # inhibited by the page of the same run
    assert names.count(("SentinelPage", "resolved")) == 1, names
    assert names[0] == ("SentinelPage", "firing"), names
