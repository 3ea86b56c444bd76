"""etcd user/password auth: a new token when etcd no longer knows the client's.

etcd's default ``simple`` tokens live in the server's memory: an etcd that restarts (a
crash, an upgrade) forgets every token it gave, and each request of a client that logged
in before answers ``invalid auth token`` from then on. A job must not end for that: the
client logs in again, once per such answer, and sends the request again.
"""

from __future__ import annotations

from elasticft.store import etcd_api_pb2 as api
from elasticft.store.etcd_rpc import AUTHENTICATE


class TokenRenewal:
    """Logs a client in (again) with the credentials it was made with."""

    def __init__(self, user: str | None, password: str | None):
        self._user, self._password = user, password

    @property
    def possible(self) -> bool:
        return self._user is not None and self._password is not None

    def renew(self, members) -> None:
        """A new token for ``members`` (etcd_rpc.Members): every request carries it from now on,
        as metadata, as etcdctl's do (on a TLS channel and a plain one alike). Raises gRPC's error."""
        members.metadata = ()  # a forgotten token must not travel with the login itself
        answer = members.call(AUTHENTICATE, api.AuthenticateRequest(name=self._user, password=self._password))
        members.metadata = (("token", answer.token),)
