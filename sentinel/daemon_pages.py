"""Pages to Alertmanager, with a lifecycle: firing while the incident is open, resolved when it closes.

Alertmanager forgets an alert that is not re-sent: without ``endsAt`` it resolves it after its
``resolve_timeout`` (5 min by default), and a restarted Alertmanager without persistent storage
knows none. So every open page is re-sent every ``RESEND_S`` seconds with an explicit ``endsAt``
``ENDS_AFTER_S`` ahead (well inside any ``resolve_timeout``): it stays active while its incident is
open, comes back within ``RESEND_S`` after an Alertmanager restart, and resolves by itself
``ENDS_AFTER_S`` after a sentinel that can no longer say so went away. When the incident closes,
one more POST with ``endsAt`` now resolves it (the receiver's "resolved" notice). Pages carry the
rule name (label ``rule``), the incident id and a ``runbook_url``.

The open pages are part of the daemon's saved state: a new leader goes on re-sending them.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime, timezone
from urllib.parse import unquote, urlsplit, urlunsplit

from sentinel import bus

ALERTNAME = "SentinelPage"
RESEND_S = 20.0  # an open page is POSTed again this often
ENDS_AFTER_S = 180.0  # ... with endsAt this far ahead
DEADLINE_S = 5.0  # one POST, all of it (a server that trickles a byte every 2 s must not hold the loop)
RUNBOOK_URL = "https://github.com/sentinel-train/sentinel/blob/main/docs/runbooks/SentinelEscalation.md"  # the escalation runbook (alerts/build.py)
MAX_OPEN = 256  # open pages kept (one per open incident, plus operational ones)
OPERATIONAL_S = 900.0  # a page of no incident (a rule whose action is page) stays up this long


def basic_auth(url: str) -> tuple[str, dict[str, str]]:
    """An Alertmanager URL with ``user:password@`` (basic auth behind a proxy): the URL without them,
    and the ``Authorization`` header they stand for (urllib would read them as part of the host)."""
    parts = urlsplit(url)
    if parts.username is None:
        return url, {}
    netloc = parts.hostname or ""
    netloc = f"[{netloc}]" if ":" in netloc else netloc
    if parts.port is not None:
        netloc += f":{parts.port}"
    token = base64.b64encode(f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()).decode()
    return urlunsplit(parts._replace(netloc=netloc)), {"Authorization": f"Basic {token}"}


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        """Not followed: urllib would re-send a POST as a GET with no alert in it (and count that as
        delivered), carrying the basic-auth header to wherever the Location points. An HTTPError."""
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def post_alerts(url: str, alerts: list[dict], deadline_s: float | None = None) -> BaseException | bool | None:
    """POST ``alerts`` to ``url``'s /api/v2/alerts within ``deadline_s`` (``DEADLINE_S``): None when
    accepted (a 2xx), the exception when it failed (a redirect too), False when no answer came in time."""
    deadline_s = DEADLINE_S if deadline_s is None else deadline_s
    base, headers = basic_auth(url)
    req = urllib.request.Request(base.rstrip("/") + "/api/v2/alerts", data=json.dumps(alerts).encode(),
                                 headers={"Content-Type": "application/json", **headers}, method="POST")
    outcome: list[BaseException | None] = []

    def post() -> None:
        try:
            # each socket read within 3 s of the 5: a silent server is a timeout, a trickling one the deadline
            _OPENER.open(req, timeout=0.6 * deadline_s).close()
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 - down, refused, not HTTP (BadStatusLine), a host idna refuses
            outcome.append(e)

    t = threading.Thread(target=post, name="alertmanager-post", daemon=True)
    t.start()
    t.join(deadline_s)
    return outcome[0] if outcome else False


class Pager:
    """The open pages of one run and their delivery to Alertmanager."""

    def __init__(self, run: str, url: str | None, log: Callable[[str], None]):
        self.run, self.url, self.log = run, url, log
        self.open: dict[str, dict] = {}  # page key (incident id, or rule for an operational page) -> alert
        self._last_resend = 0.0
        self._resending: threading.Thread | None = None
        self._resend_failed = False

    def alert(self, key: str, *, severity: str, summary: str, incident_id: str | None, rule: str | None,
              now: float) -> dict:
        return {"labels": {"alertname": ALERTNAME, "run": self.run, "severity": severity, "incident": incident_id or "",
                           "rule": rule or ""},
                "annotations": {"summary": summary, "rule": rule or "", "runbook_url": RUNBOOK_URL},
                "startsAt": _iso(now), "key": key}

    def fire(self, alert: dict, now: float) -> bool:
        """Open (or update) a page and POST it now; True when Alertmanager accepted it."""
        if not self.url:
            return False  # no Alertmanager: nothing to keep up
        key = alert["key"]
        old = self.open.get(key)
        if old is not None:
            alert["startsAt"] = old["startsAt"]  # one alert per incident: its start is the first page's
        self.open[key] = alert
        while len(self.open) > MAX_OPEN:
            self.open.pop(next(iter(self.open)))
        return self._post([alert], now, first=True)

    def _body(self, alert: dict, now: float, ends: float) -> dict:
        return {"labels": alert["labels"], "annotations": alert["annotations"], "startsAt": alert["startsAt"],
                "endsAt": _iso(ends)}

    def _post(self, alerts: list[dict], now: float, *, first: bool = False, resolved: bool = False) -> bool:
        if not self.url or not alerts:
            return False
        ends = now if resolved else now + ENDS_AFTER_S
        res = post_alerts(self.url, [self._body(a, now, ends) for a in alerts])
        if res is None:
            return True
        if first or resolved:
            if res is False:
                self.log(f"[{self.run}] Alertmanager did not answer within {DEADLINE_S:g} s: the page is "
                         "in the log, on the bus and in the run dir" + ("" if first else " (resolved notice)"))
            else:
                self.log(f"[{self.run}] could not reach Alertmanager ({res.__class__.__name__}: "
                         f"{bus.redact_url(str(res))[:200]!r})")
        return False

    def tick(self, now: float, is_open: Callable[[str], bool]) -> None:
        """Resolve the pages whose incident closed; re-send the others every ``RESEND_S`` (in the
        background: an Alertmanager that hangs must not hold the daemon's loop)."""
        done = [k for k, a in self.open.items()
                if (now >= a["until"] if isinstance(a.get("until"), (int, float)) else not is_open(k))]
        if done:
            closed = [self.open.pop(k) for k in done]
            if self._post(closed, now, resolved=True):
                self.log(f"[{self.run}] resolved {len(closed)} page(s) in Alertmanager: " + ", ".join(done)[:300])
        if not self.url or not self.open or now - self._last_resend < RESEND_S:
            return
        if self._resending is not None and self._resending.is_alive():
            return
        self._last_resend = now
        alerts = list(self.open.values())

        def resend() -> None:
            ok = self._post(alerts, time.time())
            if ok and self._resend_failed:
                self.log(f"[{self.run}] Alertmanager takes pages again: {len(alerts)} open page(s) re-sent")
            elif not ok and not self._resend_failed:
                self.log(f"[{self.run}] could not re-send {len(alerts)} open page(s) to Alertmanager; retrying every "
                         f"{RESEND_S:g} s")
            self._resend_failed = not ok

        self._resending = threading.Thread(target=resend, name="alertmanager-resend", daemon=True)
        self._resending.start()

    def state_dict(self) -> list[dict]:
        return list(self.open.values())

    def load_state_dict(self, pages: object) -> None:
        self.open = {}
        if not isinstance(pages, list):
            return
        for a in pages[-MAX_OPEN:]:
            if (isinstance(a, dict) and isinstance(a.get("key"), str) and isinstance(a.get("labels"), dict)
                    and isinstance(a.get("annotations"), dict) and isinstance(a.get("startsAt"), str)
                    and all(isinstance(v, str) for d in (a["labels"], a["annotations"]) for v in d.values())):
                self.open[a["key"]] = {k: a[k] for k in ("key", "labels", "annotations", "startsAt")}
                if isinstance(a.get("until"), (int, float)):
                    self.open[a["key"]]["until"] = float(a["until"])
        self._last_resend = 0.0  # a new leader re-sends at once
