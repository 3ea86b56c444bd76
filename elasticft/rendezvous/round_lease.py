"""The lease a node's rendezvous keys live under: the handler's own, or the node's, shared.

Under torchrun with eft's backend nothing else holds a lease for the node, and the
handler takes one of its own (``OwnLease``). Under eft's agent the node already holds
one: its record in ``nodes/``. Its participant and role keys then go under that same
lease (``SharedLease``), so a node costs etcd one keep-alive per period instead of two,
and a lost node's record and its place in the round vanish at one revision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from elasticft.store import EtcdClient, Lease


class RoundLease(Protocol):
    held: Lease | None  # the lease the node's keys are under now (None before the first join)

    def current(self) -> Lease:
        """A live lease: the one held, or a new one when etcd let it expire. Raises StoreError."""

    def release(self) -> bool:
        """The rendezvous is done with it; True when the node's keys went with it."""


class OwnLease:
    """A lease of the handler's own, revoked when the node leaves the rendezvous."""

    def __init__(self, client: EtcdClient, ttl: float):
        self._client = client
        self._ttl = ttl
        self.held: Lease | None = None

    def current(self) -> Lease:
        if self.held is None or self.held.lost.is_set():
            self.held = self._client.lease(self._ttl)
        return self.held

    def release(self) -> bool:
        lease, self.held = self.held, None
        if lease is not None:
            lease.revoke()
        return True


class SharedLease:
    """The node's lease, held by eft's agent: ``renew`` registers the node again under a new
    lease (its record rewritten) when etcd let the old one expire, and the agent revokes it
    when it leaves, not the rendezvous: a node that leaves the rendezvous but not the job (a
    straggler on its way out) keeps its record until the agent says why it left."""

    def __init__(self, lease: Lease, renew: Callable[[], None]):
        self.held: Lease = lease  # renewal regrants this same object: it stays the node's lease
        self._renew = renew

    def current(self) -> Lease:
        if self.held.lost.is_set():
            self._renew()
        return self.held

    def release(self) -> bool:
        return False
