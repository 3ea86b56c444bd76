"""The agent's ``/metrics`` endpoint: prometheus_client's WSGI app on a thread of its own.

A port that cannot be had (in use, not allowed) is one warning line and no endpoint: the job
trains on without metrics rather than not at all.
"""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - a scrape every few seconds is no news
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves ``collector`` at ``http://host:port/metrics`` until ``close``."""

    def __init__(self, collector: Collector, host: str, port: int):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        bind = host or "0.0.0.0"
        server_class = _Server6 if ":" in bind else _Server
        self._httpd = make_server(bind, port, make_wsgi_app(registry), server_class, handler_class=_Quiet)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="eft-metrics", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, collector: Collector, host: str, port: int, flag: str) -> "MetricsServer | None":
        """The server, or None with one warning when the address cannot be had."""
        try:
            return cls(collector, host, port)
        except OSError as exc:
            log.warning("%s %d: cannot serve metrics at %s:%d (%s); the job runs on without them", flag, port,
                        host or "*", port, exc.strerror or exc)
            return None

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)
