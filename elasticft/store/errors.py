"""What a failed etcd request raises, whichever module of the store made it."""

import grpc


class StoreError(RuntimeError):
    """An etcd request failed."""


class StoreUnavailable(StoreError):
    """etcd could not be reached at the configured endpoint."""


class StoreClosed(StoreError):
    """A request on a client already closed (its owner is shutting down): never sent."""


class LeaseNotFound(StoreError):
    """A write under a lease that etcd let expire (the writer was frozen, or cut off from etcd)."""


class TokenExpired(StoreError):
    """etcd no longer knows the client's auth token (it restarted): log in again (auth.py)."""


def error_of(exc: Exception) -> StoreError:
    """A failed etcd request's error as eft's own: ``LeaseNotFound`` for an expired lease,
    ``TokenExpired`` for a forgotten auth token."""
    details = (exc.details() or "") if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else ""
    if "lease not found" in details:
        return LeaseNotFound(f"etcd request failed: {one_line(exc)}")
    if "invalid auth token" in details:
        return TokenExpired(f"etcd request failed: {one_line(exc)}")
    return StoreError(f"etcd request failed: {one_line(exc)}")


def one_line(exc: Exception) -> str:
    """A gRPC error as one line (its repr spans four): the code and etcd's words."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc) or type(exc).__name__


_UNAVAILABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def watch_error(response: Exception | None, endpoints: str) -> StoreError:
    """Why a watch ended, as one line: ``StoreUnavailable`` when etcd went away (its Outage says so)."""
    if isinstance(response, grpc.RpcError) and hasattr(response, "code") and response.code() in _UNAVAILABLE_CODES:
        return StoreUnavailable(f"etcd at {endpoints} is unreachable ({one_line(response)})")
    if isinstance(response, grpc.RpcError):
        return error_of(response)
    return StoreError(one_line(response) if response is not None else "watch stream closed")
