"""How to reach etcd: endpoints, TLS, user/password, and the connection's retry settings."""

from __future__ import annotations

from dataclasses import dataclass

# pyetcd marks an endpoint failed after one UNAVAILABLE or DEADLINE_EXCEEDED answer and
# refuses to use it for ``time_retry`` seconds (300 by default): a client of a single
# etcd would be dead for five minutes after one lost request. Try it again after this.
FAILED_ENDPOINT_RETRY = 1.0

# gRPC waits up to 120 s (1 s, then x1.6 each try) before it reconnects to a server that went
# away: after an etcd restart a client would miss it for seconds, and every lease it holds
# (TTL 3 s by default) would expire though etcd is back. Reconnect within half a second.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


@dataclass(frozen=True)
class StoreOptions:
    """How to reach etcd: endpoints and, optionally, TLS and user/password."""

    endpoints: str = "127.0.0.1:2379"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    timeout: float = 10.0

    def parsed_endpoints(self) -> list[tuple[str, int]]:
        out = []
        for item in self.endpoints.split(","):
            item = item.strip()
            for scheme in ("http://", "https://"):
                if item.startswith(scheme):
                    item = item[len(scheme):]
            host, sep, port = item.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"expected HOST:PORT, got {item!r}")
            out.append((host.strip("[]"), int(port)))
        if not out:
            raise ValueError("no endpoint given")
        return out
