"""etcd user/password auth: a new token when etcd no longer knows the client's.

etcd's default ``simple`` tokens live in the server's memory: an etcd that restarts (a
crash, an upgrade) forgets every token it gave, and each request of a client that logged
in before answers ``invalid auth token`` from then on. A job must not end for that: the
client logs in again, once per such answer, and sends the request again.
"""

from __future__ import annotations

import grpc
from pyetcd import etcdrpc

from elasticft.store.errors import error_of


class TokenRenewal:
    """Logs a library client in again with the credentials it was made with."""

    def __init__(self, user: str | None, password: str | None, secure: bool):
        self._user, self._password, self._secure = user, password, secure

    @property
    def possible(self) -> bool:
        return self._user is not None and self._password is not None

    def renew(self, etcd) -> None:
        """A new token on ``etcd`` (a pyetcd client); raises StoreError."""
        try:
            answer = etcd.authstub.Authenticate(
                etcdrpc.AuthenticateRequest(name=self._user, password=self._password), etcd.timeout)
        except grpc.RpcError as exc:
            raise error_of(exc) from exc
        etcd.metadata = (("token", answer.token),)
        if self._secure:  # on a plain channel the token travels as metadata only (client.py)
            etcd.call_credentials = grpc.metadata_call_credentials(_Token(answer.token))


class _Token(grpc.AuthMetadataPlugin):
    def __init__(self, token: str):
        self._token = token

    def __call__(self, context, callback):
        callback((("token", self._token),), None)
