"""HTTP side of the dashboard: the page, its JSON snapshot, server-sent events and Prometheus text.

The standard library's threading server is enough: a handful of browsers and one scraper, each
request answered from the collector's prebuilt view. Every event-stream client holds one thread,
so there are at most `MAX_EVENT_STREAMS` of them.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST

from metrics.collector import Collector
from streamasr.logs import Throttle

log = structlog.get_logger()

EVENT_INTERVAL_S = 1.0
# A connection that sends no request, or a page that stops reading its events, for this long is
# closed: each holds a thread.
REQUEST_TIMEOUT_S = 10.0
# A page that stops reading its events is found out only when the socket buffers are full (an hour
# of events and more): past this many streams open at once, a new one is answered 503, so such
# pages (or a script that opens streams and never closes them) cannot pile up threads for ever.
MAX_EVENT_STREAMS = 32
STATIC = Path(__file__).with_name("static")
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


class Dashboard:
    """The HTTP server bound to `host:port` (port 0 picks a free one, see `url`)."""

    def __init__(self, collector: Collector, port: int, host: str = "127.0.0.1") -> None:
        self.collector = collector
        self.closing = threading.Event()
        self.event_streams = threading.BoundedSemaphore(MAX_EVENT_STREAMS)
        self.refusal_lines = Throttle("dashboard.events_refused")  # a refused page asks again every few seconds
        self.httpd = _Server((host, port), _handler(self))

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def serve_forever(self) -> None:
        try:
            self.httpd.serve_forever(poll_interval=0.25)
        finally:  # the refusals of its last second
            self.refusal_lines.tell_untold(log, lambda _: {})

    def shutdown(self) -> None:
        """Stop serving (from another thread than serve_forever's) and end the event streams."""
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # event streams never end by themselves

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-answer (a scraper past its timeout, a tab closed while loading) is no
        fault of the dashboard's and is not logged; anything else is, as one JSON line (the
        standard library prints a bare traceback amid the log's JSON)."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        log.error("dashboard.request_failed", client=f"{client_address[0]}:{client_address[1]}", exc_info=True)


def _handler(dashboard: Dashboard) -> type[BaseHTTPRequestHandler]:
    static = {p.name: p for p in STATIC.iterdir() if p.suffix in CONTENT_TYPES}  # only these, no path games

    class Handler(BaseHTTPRequestHandler):
        server_version = "streamasr-dashboard"
        timeout = REQUEST_TIMEOUT_S

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if not self._local_host():
                return
            path = self.path.split("?", 1)[0]
            if path == "/":
                self._file(static["index.html"])
            elif path.startswith("/static/") and path.removeprefix("/static/") in static:
                self._file(static[path.removeprefix("/static/")])
            elif path == "/api/snapshot":
                self._send(HTTPStatus.OK, "application/json", _json(dashboard.collector.snapshot()))
            elif path == "/metrics":
                self._send(HTTPStatus.OK, CONTENT_TYPE_LATEST, dashboard.collector.prometheus())
            elif path == "/events":
                self._events()
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

        do_HEAD = do_GET  # uptime checks and load balancers probe with HEAD: the same answer, without its body

        def _local_host(self) -> bool:
            """Only requests that name this host as a local address: a web page in the operator's
            browser could otherwise read the figures through a name it points at 127.0.0.1
            (DNS rebinding), since the browser sends that name."""
            host = (self.headers.get("Host") or "").strip().lower()
            name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]", 1)[0] + "]"
            if name in ("127.0.0.1", "localhost", "[::1]"):
                return True
            self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain; charset=utf-8",
                       b"the dashboard answers requests for 127.0.0.1 or localhost only\n")
            return False

        def _file(self, path: Path) -> None:
            self._send(HTTPStatus.OK, CONTENT_TYPES[path.suffix], path.read_bytes())

        def _send(self, status: HTTPStatus, content_type: str, body: bytes, headers: tuple[tuple[str, str], ...] = ()) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for name, value in headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _events(self) -> None:
            """Push the snapshot every second until the browser goes away or the server stops."""
            if not dashboard.event_streams.acquire(blocking=False):
                if (suppressed := dashboard.refusal_lines("events")) is not None:
                    log.warning("dashboard.events_refused", open=MAX_EVENT_STREAMS, suppressed=suppressed)
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, "text/plain; charset=utf-8",
                           f"{MAX_EVENT_STREAMS} event streams are open already: close a page, or poll /api/snapshot\n".encode(),
                           (("Retry-After", "5"),))
                return
            try:
                self._stream()
            finally:
                dashboard.event_streams.release()

        def _stream(self) -> None:
            """The stream itself, once it holds one of the slots."""
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command == "HEAD":
                return
            try:
                self.wfile.write(b"retry: 2000\n\n")
                while not dashboard.closing.is_set():
                    self.wfile.write(b"data: " + _json(dashboard.collector.snapshot()) + b"\n\n")
                    self.wfile.flush()
                    dashboard.closing.wait(EVENT_INTERVAL_S)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):  # gone, or not reading
                pass

        def log_message(self, format: str, *args: Any) -> None:
            """Silent: the page and scrapers ask every second, which would drown the log."""

    return Handler


def _json(value: Any) -> bytes:
    """Strict JSON: a number that is not finite (Infinity is no JSON, and the page's parser stops
    at it) goes out as null, which the page shows as unknown."""
    return json.dumps(_finite(value), separators=(",", ":"), allow_nan=False).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
