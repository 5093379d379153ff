"""Hostile HTTP, both directions, as two tables on real sockets with in-process servers and sub-second
timeouts.

* Requests to the ``/metrics`` endpoint (``sentinel.metrics_http``: the daemon's and every trainer
  rank's, bound on 0.0.0.0 in the deployments): each gets a bounded answer (an HTTP error, the
  exposition, or the connection closed once the request timeout passes), no traceback on stderr,
  and the endpoint serves the next scrape. Before: every idle connection held a thread and a
  descriptor for good (at the descriptor limit the accept loop spun at 100 % CPU), and every
  client that timed out printed socketserver's traceback into the daemon's log.
* Responses to the daemon's Alertmanager client (``sentinel.daemon_pages.Pager``): the page is
  not counted as delivered, the daemon says why in one line without the URL's password, and
  within the POST's deadline. Before: a BadStatusLine raised out of the daemon's poll, a server
  trickling a byte every 2 s held its loop for good, and a redirect was followed as a GET with no
  alert in it (counted as delivered) that carried the basic-auth header to wherever it pointed.
  That a failed page is still on the bus is tests/daemon/test_hostile_inputs.py's.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.request

import pytest

from sentinel import daemon_pages, metrics_http
from sentinel.metrics import SentinelMetrics
from tests.helpers.services import talker

TIMEOUT_S = 0.5  # the endpoint's request timeout here (10 s in production)
DEADLINE_S = 0.5  # the page POST's deadline here (5 s in production)


# ------------------------------------------------------------------ requests to /metrics
@pytest.fixture(scope="module")
def endpoint():
    """One endpoint for the table (a case that broke it breaks every later scrape): its port."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(metrics_http._Handler, "timeout", TIMEOUT_S)
        m = SentinelMetrics()
        m.steps.labels("r1").inc()
        yield m.serve("127.0.0.1", 0)


def _scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()


REQUEST = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
IDLE_FLOOD = metrics_http.MAX_CONNECTIONS + 20
# case: (what each client sends, how many clients, what the first answer starts with: b"" = closed unanswered)
REQUESTS = {
    "bad-method": (b"BREW /metrics HTTP/1.1\r\n\r\n", 1, b"HTTP/1.0 405"),
    "post-announcing-a-huge-body": (b"POST /metrics HTTP/1.1\r\nContent-Length: 100000000\r\n\r\nabc", 1, b"HTTP/1.0 405"),
    "path-outside-metrics": (b"GET /../../etc/passwd HTTP/1.1\r\n\r\n", 1, b"HTTP/1.0 200"),  # the exposition, no file
    "no-http-at-all": (b"\x00\xff\xfe not http\r\n\r\n", 1, b"<!DOCTYPE HTML>"),  # a 400 page, HTTP/0.9 style
    "unknown-http-version": (b"GET /metrics HTTP/9.9\r\n\r\n", 1, b"<!DOCTYPE HTML>"),
    "tls-client-hello": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(100), 1, b""),
    "huge-request-line": (b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n", 1, b"HTTP/1.0 414"),
    "huge-header-line": (REQUEST + b"X: " + b"a" * 70_000 + b"\r\n\r\n", 1, b"HTTP/1.0 431"),
    "too-many-headers": (REQUEST + b"".join(b"X%d: y\r\n" % i for i in range(200)) + b"\r\n", 1, b"HTTP/1.0 431"),
    "request-never-finished": (REQUEST, 1, b""),
    "connects-and-says-nothing": (b"", 1, b""),
    "idle-connections-past-the-cap": (b"", IDLE_FLOOD, b""),
}


@pytest.mark.parametrize("case", list(REQUESTS))
def test_a_hostile_request_gets_a_bounded_answer_and_the_next_scrape_is_served(endpoint, capfd, case):
    sends, clients, answer = REQUESTS[case]
    threads_before = threading.active_count()
    conns = [socket.create_connection(("127.0.0.1", endpoint)) for _ in range(clients)]
    try:
        for c in conns:
            if sends:
                c.sendall(sends)
        time.sleep(0.1)
        assert threading.active_count() - threads_before <= metrics_http.MAX_CONNECTIONS  # one thread per served one
        t0 = time.monotonic()
        got = []
        for c in conns:  # the server closes every one: answered, timed out, or refused past the cap
            c.settimeout(TIMEOUT_S + 3)
            data = b""
            while chunk := c.recv(65536):
                data += chunk
            got.append(data)
        assert time.monotonic() - t0 < TIMEOUT_S + 2, "the server held a connection past its request timeout"
    finally:
        for c in conns:
            c.close()
    assert got[0].startswith(answer) and (answer or got[0] == b""), got[0][:200]
    if case == "path-outside-metrics":
        assert b"sentinel_steps_processed_total" in got[0] and b"root:" not in got[0]
    body = _scrape(endpoint)
    assert 'sentinel_steps_processed_total{run="r1"} 1.0' in body
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


# ------------------------------------------------------------------ responses to the Alertmanager client
@contextlib.contextmanager
def _alertmanager(reply: bytes | None, *, trickle: float = 0.0):
    """``talker`` as an Alertmanager: it answers ``reply`` (None: nothing, ever); with ``trickle``, sends
    it again every ``trickle`` seconds, for ever. Yields (its URL, the requests it read)."""
    got: list[bytes] = []
    port, stop = talker(reply, reply if trickle and reply else b"", pause=trickle, got=got)
    try:
        yield f"http://127.0.0.1:{port}", got
    finally:
        stop.set()


def _status(line: str, headers: str = "", body: bytes = b"") -> bytes:
    return f"HTTP/1.1 {line}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body


# case: (the reply, trickle seconds, what the daemon's one line says)
RESPONSES = {
    "no-http-at-all": (b"\x00\xffSSH-2.0-not-http\r\n\r\n", 0.0, "could not reach Alertmanager (BadStatusLine"),
    "never-answers": (None, 0.0, "could not reach Alertmanager (TimeoutError"),
    "trickles-for-ever": (b"H", 0.1, "Alertmanager did not answer within 0.5 s"),
    "closes-at-once": (b"", 0.0, "could not reach Alertmanager ("),
    "server-error": (_status("500 Internal Server Error"), 0.0, "HTTP Error 500"),
    "unavailable-with-a-huge-body": (_status("503 Service Unavailable", body=b"x" * (4 << 20)), 0.0, "HTTP Error 503"),
    "redirect": (_status("302 Found", "Location: REDIRECT/api/v2/alerts\r\n"), 0.0, "HTTP Error 302"),
    "redirect-keeping-the-method": (_status("307 Temporary Redirect", "Location: REDIRECT/x\r\n"), 0.0, "HTTP Error 307"),
    "huge-status-line": (b"HTTP/1.1 200 " + b"O" * 70_000 + b"\r\n\r\n", 0.0, "LineTooLong"),
    "huge-header-line": (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 0.0, "LineTooLong"),
}


@pytest.mark.parametrize("case", list(RESPONSES))
def test_a_hostile_alertmanager_answer_is_one_line_and_no_delivery(monkeypatch, case):
    reply, trickle, said = RESPONSES[case]
    monkeypatch.setattr(daemon_pages, "DEADLINE_S", DEADLINE_S)
    with _alertmanager(_status("200 OK")) as (elsewhere, elsewhere_got):
        if reply is not None:
            reply = reply.replace(b"REDIRECT", elsewhere.encode())
        with _alertmanager(reply, trickle=trickle) as (url, got):
            logs: list[str] = []
            pager = daemon_pages.Pager("r1", url.replace("http://", "http://pager:s3cr3t@"), logs.append)
            t0 = time.monotonic()
            delivered = pager.fire(pager.alert("k", severity="critical", summary="s", incident_id="i", rule="r",
                                               now=time.time()), time.time())
            took = time.monotonic() - t0
    assert delivered is False and len(logs) == 1 and said in logs[0], logs
    assert logs[0].startswith("[r1] ") and "\n" not in logs[0] and "s3cr3t" not in logs[0], logs
    assert took < DEADLINE_S + 0.5, took
    assert got and got[0].startswith(b"POST /api/v2/alerts "), got  # it did reach the hostile server
    assert elsewhere_got == [], "a redirect was followed (with the credentials)"


def test_an_alertmanager_that_accepts_gets_the_page_with_its_credentials():
    """The table's control: a 200 is a delivery, with nothing logged."""
    with _alertmanager(_status("200 OK")) as (url, got):
        logs: list[str] = []
        pager = daemon_pages.Pager("r1", url.replace("http://", "http://pager:s3cr3t@"), logs.append)
        assert pager.fire(pager.alert("k", severity="critical", summary="s", incident_id="i", rule="r", now=time.time()),
                          time.time()) is True
    assert logs == [] and len(got) == 1 and b"Authorization: Basic cGFnZXI6czNjcjN0" in got[0], got
