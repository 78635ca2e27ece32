"""HTTP side of the dashboard: the page, its JSON snapshot, server-sent events and Prometheus text.

The standard library's threading server is enough: a handful of browsers and one scraper, each
request answered from the collector's prebuilt view. Every event-stream client holds one thread.
"""

from __future__ import annotations

import json
import math
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from metrics.collector import Collector

EVENT_INTERVAL_S = 1.0
# A connection that sends no request, or a page that stops reading its events, for this long is
# closed: each holds a thread.
REQUEST_TIMEOUT_S = 10.0
STATIC = Path(__file__).with_name("static")
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                 ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}


class Dashboard:
    """The HTTP server bound to `host:port` (port 0 picks a free one, see `url`)."""

    def __init__(self, collector: Collector, port: int, host: str = "127.0.0.1") -> None:
        self.collector = collector
        self.closing = threading.Event()
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True  # event streams never end by themselves

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.25)

    def shutdown(self) -> None:
        """Stop serving (from another thread than serve_forever's) and end the event streams."""
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


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

        def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _events(self) -> None:
            """Push the snapshot every second until the browser goes away or the server stops."""
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
