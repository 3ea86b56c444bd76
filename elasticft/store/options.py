"""How to reach etcd: endpoints, TLS, user/password, and the connection's retry settings."""

from __future__ import annotations

from dataclasses import dataclass

# With several members, one found down (UNAVAILABLE, or DEADLINE_EXCEEDED) is passed over for
# this long (etcd_rpc.Members): long enough not to send every request to a dead member first,
# short enough that a member back from a restart takes requests again at once.
FAILED_ENDPOINT_RETRY = 1.0

# gRPC waits up to 120 s (1 s, then x1.6 each try) before it reconnects to a server that went
# away: after an etcd restart a client would miss it for seconds, and every lease it holds
# (TTL 3 s by default) would expire though etcd is back. Reconnect within half a second.
# gRPC also reads its "min reconnect backoff" as the least time a connection attempt may take
# to its first HTTP/2 frame (its own default: 20 s); StoreOptions.connect_timeout sets it.
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
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
    # Seconds a new connection may take to etcd's first answer. A CPU-starved etcd sends it
    # late: at 0.1 s (what the reconnect settings above once implied) an operator's `eft ckpt
    # save` to a loaded job's etcd failed at once as unreachable. A refused connection fails at
    # once whatever this is; a silent member costs a request up to this before the next one.
    connect_timeout: float = 1.0

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC's settings for a channel to one member."""
        return [*RECONNECT_OPTIONS, ("grpc.min_reconnect_backoff_ms", max(100, int(self.connect_timeout * 1000)))]

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
