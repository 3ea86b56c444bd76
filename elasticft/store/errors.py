"""What a failed etcd request raises, whichever module of the store made it."""

import grpc


class StoreError(RuntimeError):
    """An etcd request failed."""


class StoreUnavailable(StoreError):
    """etcd could not be reached at the configured endpoint."""


def one_line(exc: Exception) -> str:
    """A gRPC error as one line (its repr spans four): the code and etcd's words."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__
