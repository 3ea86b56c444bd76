"""What a TLS refusal by etcd looks like through gRPC, and the one line that names it.

gRPC reports a failed handshake, or a client certificate etcd rejects, as UNAVAILABLE, the
code of an etcd that is down: without this, eft would wait its join timeout for an etcd
that answers but will never let it in.
"""

from __future__ import annotations

import grpc

from elasticft.store.errors import StoreError
from elasticft.store.options import StoreOptions


# gRPC's words for a TLS failure, across its versions: a handshake that failed on either side,
# or the connection etcd ends once the handshake is over, under TLS 1.3, when it refuses the
# client's certificate (grpcio 1.62: "Unwrap failed"; 1.73: "Secure read failed"; 1.85: "Unwrap
# failed (TSI_DATA_CORRUPTED)"). Looked for only when a client first connects (connect()).
_TLS_WORDS = ("TSI_", "andshake", "CERTIFICATE", "SSL_ERROR", "Unwrap failed", "Secure read failed")


def tls_refusal(exc: BaseException) -> str | None:
    """gRPC's words for the TLS failure behind an 'unreachable' etcd, if that is what it was."""
    while exc is not None:
        if isinstance(exc, grpc.RpcError) and hasattr(exc, "details"):
            details = exc.details() or ""
            if any(word in details for word in _TLS_WORDS):
                return details
        exc = exc.__cause__ or exc.__context__
    return None


def _short(details: str) -> str:
    """The reason alone: gRPC's prefix (the addresses it tried) off."""
    reason = details.rpartition("last error: ")[2]
    for marker in ("Ssl handshake failed: ", "Tls handshake failed ", "Unwrap failed", "Secure read failed"):
        if marker in reason:
            return reason[reason.index(marker):].removesuffix(": OK")
    return reason.rpartition(": ")[2] or reason


def tls_error(options: StoreOptions, details: str) -> StoreError:
    where, reason = f"etcd at {options.endpoints}", _short(details)
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return StoreError(f"{where}: its TLS server certificate is not signed by cacert {options.cacert} "
                          f"(CERTIFICATE_VERIFY_FAILED)")
    if not options.cert:
        return StoreError(f"{where} refused the TLS connection ({reason}): it wants a client certificate, "
                          f"and none is given (--rdzv-conf cert=...,key=...)")
    return StoreError(f"{where} refused the TLS connection ({reason}): is client certificate {options.cert} "
                      f"signed by a CA that etcd trusts (its --trusted-ca-file)?")


def tls_error_behind(unavailable: StoreError, options: StoreOptions) -> StoreError | None:
    """The one-line error for a TLS refusal that gRPC reported as an unreachable etcd, or None."""
    details = tls_refusal(unavailable) if options.cacert else None
    return tls_error(options, details) if details is not None else None
