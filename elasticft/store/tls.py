"""Whether an 'unreachable' etcd is one that refuses eft's TLS, and the one line that says so.

gRPC reports a failed handshake, or a client certificate etcd rejects, as UNAVAILABLE, the
code of an etcd that is down: without this, eft would wait its join timeout for an etcd
that answers but will never let it in. gRPC's words for it change with every release
(grpcio 1.51 "Endpoint read failed", 1.62 "Unwrap failed", 1.73 "Secure read failed"), and
under TLS 1.3 the refusal of a client certificate comes after the handshake, as an alert; so
eft asks etcd itself: one TLS handshake of its own with the same files, and a read for the
alert. Only when a client's first request found etcd unreachable (``connect``).
"""

from __future__ import annotations

import socket
import ssl

from elasticft.store.errors import StoreError
from elasticft.store.options import StoreOptions

ALERT_WAIT = 1.0  # seconds to wait for etcd's alert after the handshake; none: etcd took the certificate


def tls_refusal(options: StoreOptions) -> str | None:
    """OpenSSL's reason when an endpoint of ``options`` refuses a TLS connection made with its
    files (None: none answered, or every one that did let eft in)."""
    context = ssl.create_default_context(cafile=options.cacert)
    if options.cert:
        try:
            context.load_cert_chain(options.cert, options.key)
        except (OSError, ssl.SSLError) as exc:
            return f"cannot load cert {options.cert} with key {options.key}: {exc}"
    for host, port in options.parsed_endpoints():
        try:
            with socket.create_connection((host, port), timeout=max(options.connect_timeout, 1.0)) as raw, \
                    context.wrap_socket(raw, server_hostname=host) as tls:
                tls.settimeout(ALERT_WAIT)
                tls.recv(1)  # etcd speaks first only to refuse (an alert); a gRPC server waits
        except ssl.SSLError as exc:
            return exc.reason or str(exc)
        except OSError:  # refused, timed out, reset: down, or let in (no alert within ALERT_WAIT)
            continue
    return None


def tls_error(options: StoreOptions, reason: str) -> StoreError:
    where = f"etcd at {options.endpoints}"
    if "CERTIFICATE_VERIFY_FAILED" in reason:
        return StoreError(f"{where}: its TLS server certificate is not signed by cacert {options.cacert} ({reason})")
    if reason.startswith("cannot load"):
        return StoreError(f"{where}: TLS: {reason}")
    if not options.cert:
        return StoreError(f"{where} refused the TLS connection ({reason}): it wants a client certificate, "
                          f"and none is given (--rdzv-conf cert=...,key=...)")
    return StoreError(f"{where} refused the TLS connection ({reason}): is client certificate {options.cert} "
                      f"signed by a CA that etcd trusts (its --trusted-ca-file)?")


def tls_error_behind(options: StoreOptions) -> StoreError | None:
    """The one-line error for a TLS refusal that gRPC reported as an unreachable etcd, or None."""
    if not options.cacert:
        return None
    reason = tls_refusal(options)
    return tls_error(options, reason) if reason is not None else None
