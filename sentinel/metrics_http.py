"""The ``/metrics`` endpoint both sides serve (the daemon's and each trainer rank's), hardened.

``prometheus_client.start_http_server`` gives every connection a thread and no timeout: a client
that connects and never sends holds a thread and a file descriptor for good, and at the process's
descriptor limit the accept loop spins at 100 % CPU while Prometheus's scrapes time out. Those
ports are bound on 0.0.0.0 in the deployments, so any host that reaches them could do it. Here a
connection must send its request within ``TIMEOUT_S``, at most ``MAX_CONNECTIONS`` are served at
once (the rest are closed at once, a scraper retries), and an address that cannot be served on (a
host name IDNA refuses, a port past 65535) is an ``OSError`` like any other bind failure. A client
that timed out, reset or left costs nothing but its connection: no traceback on stderr (socketserver
prints one per failed request, so any host could fill the daemon's log with them).
"""

from __future__ import annotations

import errno
import sys
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family

TIMEOUT_S = 10.0  # a scrape sends its request at once; an idle connection is closed after this
MAX_CONNECTIONS = 32  # served at once; Prometheus holds one per target


class _Handler(WSGIRequestHandler):
    timeout = TIMEOUT_S  # socketserver.StreamRequestHandler sets it on the connection's socket

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        """No access log: a scrape every 15 s would fill the daemon's."""


class _Server(ThreadingWSGIServer):
    daemon_threads = True
    # the listen backlog (socketserver's default is 5): past it the kernel drops a connection's SYN and
    # the client waits a second to retry, so a burst of connections (closed at once past the cap)
    # would make the next scrape wait for seconds
    request_queue_size = 128

    def __init__(self, *args: Any, **kw: Any):
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kw)

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):  # full: close this one now rather than queue it
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        """A request that failed: the client's doing (timed out, reset, gone) says nothing; anything
        else one line on stderr, never socketserver's traceback."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            return
        print(f"metrics endpoint: a request from {client_address[0]} failed "
              f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]})", file=sys.stderr)


def serve(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, int]:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread: (server, bound port).
    OSError when the address cannot be served on, whatever the reason."""
    try:
        server_cls = type("MetricsServer", (_Server,), {})
        server_cls.address_family, addr = _get_best_family(host, port)
        httpd = make_server(addr, port, make_wsgi_app(registry), server_cls, handler_class=_Handler)
    except (UnicodeError, ValueError, OverflowError) as e:  # idna refuses the host; a port past 65535
        raise OSError(errno.EINVAL, f"not an address to serve on ({' '.join(str(e).split())[:160]})") from None
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd, int(httpd.server_port)
