"""etcd's v3 gRPC methods on the members of one cluster: which member a request goes to, and how.

eft speaks etcd's API itself, with its own messages (``etcd_api_pb2``, made by an old protoc so
that any protobuf from 4.21 on runs them) and any grpcio: an etcd client library would pin both
to its own generation, and a container that pins them (NGC) could not install eft
(docs/install.md). A method is named by etcd's own package and service, which is all gRPC sends.

With several members, a request that finds its member down (UNAVAILABLE, or no answer within the
deadline) marks it failed for ``FAILED_ENDPOINT_RETRY`` seconds and the caller sends it to the
next one (client.py). A single member is never marked: gRPC's reconnect settings (options.py)
bring it back as soon as it answers.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import grpc

from elasticft.store import etcd_api_pb2 as api
from elasticft.store.options import FAILED_ENDPOINT_RETRY, StoreOptions


@dataclass(frozen=True)
class Method:
    """One of etcd's methods: its gRPC path and its answer's message."""

    path: str
    response: Any

    def unary(self, channel: grpc.Channel):
        return channel.unary_unary(self.path, request_serializer=_serialize,
                                   response_deserializer=self.response.FromString)

    def stream(self, channel: grpc.Channel):
        return channel.stream_stream(self.path, request_serializer=_serialize,
                                     response_deserializer=self.response.FromString)


def _serialize(message) -> bytes:
    return message.SerializeToString()


RANGE = Method("/etcdserverpb.KV/Range", api.RangeResponse)
PUT = Method("/etcdserverpb.KV/Put", api.PutResponse)
DELETE_RANGE = Method("/etcdserverpb.KV/DeleteRange", api.DeleteRangeResponse)
TXN = Method("/etcdserverpb.KV/Txn", api.TxnResponse)
COMPACT = Method("/etcdserverpb.KV/Compact", api.CompactionResponse)
WATCH = Method("/etcdserverpb.Watch/Watch", api.WatchResponse)
LEASE_GRANT = Method("/etcdserverpb.Lease/LeaseGrant", api.LeaseGrantResponse)
LEASE_REVOKE = Method("/etcdserverpb.Lease/LeaseRevoke", api.LeaseRevokeResponse)
LEASE_KEEP_ALIVE = Method("/etcdserverpb.Lease/LeaseKeepAlive", api.LeaseKeepAliveResponse)
STATUS = Method("/etcdserverpb.Maintenance/Status", api.StatusResponse)
MEMBER_LIST = Method("/etcdserverpb.Cluster/MemberList", api.MemberListResponse)
AUTHENTICATE = Method("/etcdserverpb.Auth/Authenticate", api.AuthenticateResponse)
# RBAC set-up (an operator's script, tests/etcd_tls.py): every answer is a bare header
AUTH_ENABLE = Method("/etcdserverpb.Auth/AuthEnable", api.AuthResponse)
USER_ADD = Method("/etcdserverpb.Auth/UserAdd", api.AuthResponse)
USER_GRANT_ROLE = Method("/etcdserverpb.Auth/UserGrantRole", api.AuthResponse)
ROLE_ADD = Method("/etcdserverpb.Auth/RoleAdd", api.AuthResponse)
ROLE_GRANT_PERMISSION = Method("/etcdserverpb.Auth/RoleGrantPermission", api.AuthResponse)

# what says a member is down (or cut off): try the next one
MEMBER_DOWN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class NoMemberAvailable(RuntimeError):
    """Every member failed a request within the last FAILED_ENDPOINT_RETRY seconds."""


def channel_credentials(options: StoreOptions) -> grpc.ChannelCredentials | None:
    """TLS credentials from the options' PEM files (None: a plain channel)."""
    if not options.cacert:
        return None

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(options.cacert), read(options.key), read(options.cert))


class Member:
    """One etcd member's channel, and when a request last found it down."""

    def __init__(self, host: str, port: int, credentials: grpc.ChannelCredentials | None, channel_options):
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.target = target
        self.channel = (grpc.secure_channel(target, credentials, options=channel_options) if credentials
                        else grpc.insecure_channel(target, options=channel_options))
        self.failed_at = float("-inf")  # monotonic
        self._calls: dict[str, Any] = {}

    def unary(self, method: Method):
        call = self._calls.get(method.path)
        if call is None:
            call = self._calls[method.path] = method.unary(self.channel)
        return call

    def failed(self, now: float) -> bool:
        return now - self.failed_at < FAILED_ENDPOINT_RETRY


class Members:
    """The cluster's members in the order given, and the one requests go to now."""

    def __init__(self, options: StoreOptions):
        credentials = channel_credentials(options)
        self.timeout = options.timeout
        self.members = [Member(host, port, credentials, options.channel_options())
                        for host, port in options.parsed_endpoints()]
        self.metadata: tuple[tuple[str, str], ...] = ()  # the auth token, once logged in (auth.py)
        # each client starts at a member of its own: a thousand agents' requests spread over the members
        self._current = random.randrange(len(self.members))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.members)

    def pick(self) -> Member:
        """The member to send to: the current one unless it failed lately, else the next that did
        not, in the order given (round); raises NoMemberAvailable when every one did."""
        if len(self.members) == 1:
            return self.members[0]
        now = time.monotonic()
        with self._lock:
            current = self.members[self._current]
            if not current.failed(now):
                return current
            count = len(self.members)
            for step in range(1, count):
                index = (self._current + step) % count
                if not self.members[index].failed(now):
                    self._current = index
                    return self.members[index]
        raise NoMemberAvailable(f"every etcd member failed within {FAILED_ENDPOINT_RETRY:g} s: "
                                + ", ".join(m.target for m in self.members))

    def fail(self, member: Member, exc: grpc.RpcError) -> None:
        """A request to ``member`` failed with ``exc``: with several members, a member that is down
        is passed over for FAILED_ENDPOINT_RETRY seconds."""
        if len(self.members) > 1 and _code(exc) in MEMBER_DOWN_CODES:
            member.failed_at = time.monotonic()

    def call(self, method: Method, request, timeout: float | None = None):
        """One request to the member of the moment; a gRPC error is raised as it came (after
        ``fail``)."""
        member = self.pick()
        try:
            return member.unary(method)(request, timeout=timeout or self.timeout, metadata=self.metadata or None)
        except grpc.RpcError as exc:
            self.fail(member, exc)
            raise

    def stream(self, method: Method, requests: Iterator, timeout: float | None = None) -> Iterator:
        """A bidirectional stream on the member of the moment (its answers, as they come); a member
        found down is marked as by ``call`` when the stream's first answer fails."""
        member = self.pick()
        answers = method.stream(member.channel)(requests, timeout=timeout, metadata=self.metadata or None)
        return _marking(self, member, answers)

    def close(self) -> None:
        for member in self.members:
            member.channel.close()


def _marking(members: Members, member: Member, answers: Iterator) -> Iterator:
    try:
        yield from answers
    except grpc.RpcError as exc:
        members.fail(member, exc)
        raise


def _code(exc: grpc.RpcError):
    return exc.code() if hasattr(exc, "code") else None
