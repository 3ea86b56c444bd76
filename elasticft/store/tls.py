"""What a TLS refusal by etcd looks like through gRPC, and the one line that names it.

gRPC reports a failed handshake, or a client certificate etcd rejects, as UNAVAILABLE, the
code of an etcd that is down: without this, eft would wait its join timeout for an etcd
that answers but will never let it in.
"""

from __future__ import annotations

import grpc

from elasticft.store.errors import StoreError
from elasticft.store.options import StoreOptions


def tls_refusal(exc: BaseException) -> str | None:
    """The TLS failure behind an 'unreachable' etcd, if that is what it was."""
    while exc is not None:
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
            details = exc.details() or ""
            if "TSI_" in details or "andshake" in details or "CERTIFICATE" in details:
                return details.rpartition(": ")[2] or details
        exc = exc.__cause__ or exc.__context__
    return None


def tls_error(options: StoreOptions, reason: str) -> StoreError:
    where = f"etcd at {options.endpoints}"
    if "CERTIFICATE_VERIFY_FAILED" in reason:
        return StoreError(f"{where}: its server certificate is not signed by cacert {options.cacert} ({reason})")
    if not options.cert:
        return StoreError(f"{where} refused the TLS connection ({reason}): it wants a client certificate, "
                          f"and none is given (--rdzv-conf cert=...,key=...)")
    return StoreError(f"{where} refused the TLS connection ({reason}): is client certificate {options.cert} "
                      f"signed by a CA that etcd trusts (its --trusted-ca-file)?")


def tls_error_behind(unavailable: StoreError, options: StoreOptions) -> StoreError | None:
    """The one-line error for a TLS refusal that gRPC reported as an unreachable etcd, or None."""
    reason = tls_refusal(unavailable) if options.cacert else None
    return tls_error(options, reason) if reason is not None else None
