"""A few read-only HTTP endpoints on a background thread (``/metrics``, ``/healthz``).

The standard library's threading server: each request on a thread of its
own, so a slow scrape does not hold a health probe back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("outbox.metrics")

#: What an endpoint answers: HTTP status, body, content type.
Reply = tuple[int, bytes, str]


class Endpoints:
    """Serves ``GET`` on each path of ``routes`` (the query string ignored); 404 elsewhere."""

    def __init__(
        self, routes: Mapping[str, Callable[[], Reply]], host: str, port: int, *, name: str
    ) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                route = routes.get(self.path.split("?")[0])
                status, body, content_type = (
                    route() if route else (404, b"not found\n", "text/plain")
                )
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                log.debug(f"{name}: " + format, *args)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        #: The port listened on (the one given, or the one the system chose for 0).
        self.port: int = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, name=f"outbox-{name}")
        self.thread.daemon = True

    def start(self) -> None:
        """Start serving."""
        self.thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.httpd.shutdown()
        self.httpd.server_close()
