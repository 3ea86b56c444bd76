"""AgentContext: what every agent service needs to reach the run, in one object.

Services used to take (client, keys, node_id, lease, record, run_dir) one by one; a
service now takes the context and reads what it needs. It exists only on the
``etcd-v3`` backend: without etcd there is no lease, no event log and no shared key.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from elasticft.agent.events import EventLog
from elasticft.agent.fence import Beacon, FenceWatch
from elasticft.agent.gone_agents import end_gone_leases
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import Membership, NodeLease, default_node_id
from elasticft.rendezvous.node_claim import claim_node_id
from elasticft.store import EtcdClient, Lease, StoreError, StoreOptions, connect
from elasticft.store.outage import is_unavailable, through_outage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EtcdTarget:
    """Where this run's keys live: endpoints (with TLS/auth) and the key prefix."""

    store: StoreOptions
    keys: RunKeys
    attempt: str = ""  # which launch this agent belongs to (NodeRecord.attempt; rendezvous/reuse.py)


@dataclass(frozen=True)
class AgentContext:
    """One node agent's handle on the run: its etcd client, keys, lease, events, run dir."""

    client: EtcdClient
    keys: RunKeys
    node: NodeLease  # this node's record, kept alive under its lease
    events: EventLog
    membership: Membership  # a live mirror of every node's record
    run_dir: Path  # node-local; shared with the workers (elasticft.contract.run_dir)
    beacon: Beacon | None = None  # tells peers how long etcd has been silent to this node
    fence: FenceWatch | None = None  # says when this node, cut off from etcd alone, must stop its workers

    @property
    def node_id(self) -> str:
        return self.node.record.node_id

    @property
    def lease(self) -> Lease:
        return self.node.lease

    def record(self, kind: str, **fields) -> None:
        """Append an event to the run's log (and notify, when it is a notified kind)."""
        self.events.record(kind, **fields)

    def publish(self, key: str, value: str) -> None:
        """Write a record that only informs (``eft top``'s layout): a failure is logged, not raised,
        so that etcd just coming back (its first requests may still fail) cannot fail a restart."""
        try:
            self.client.put(key, value)
        except StoreError as exc:
            log.log(logging.DEBUG if is_unavailable(exc) else logging.WARNING, "could not write %s: %s", key, exc)

    def fenced(self) -> bool:
        """etcd let this node's lease expire: its record is gone, the job went on without it.
        Asks etcd (raises StoreError): the lease keeper hears of an expiry only at its next refresh."""
        return self.node.lease.lost.is_set() or self.client.get(self.keys.node(self.node_id)) is None

    def rejoin_if_fenced(self, outage_limit: float) -> None:
        """Register again (same node id) before the next round if the node was fenced off,
        waiting for etcd up to ``outage_limit`` seconds: a node cut off from etcd rejoins once
        it reaches etcd again. Raises StoreError."""

        def rejoin() -> float | None:
            if not self.fenced():
                return None
            silent = time.monotonic() - self.node.lease.refreshed_at
            self.node.rejoin()
            return silent

        silent = through_outage(rejoin, outage_limit, f"node {self.node_id}'s check of its lease")
        if silent is not None:
            log.warning("node %s registered again after %.0f s fenced off; it rejoins at this round",
                        self.node_id, silent)
            self.record(EventKind.NODE_FENCED, silent=round(silent, 1))

    @classmethod
    def join(cls, target: EtcdTarget, node_id: str, rdzv_addr: str, gpus: int, ttl: float,
             run_dir: Path, domain: str = "", metrics: str = "", segment: str = "") -> "AgentContext":
        """Connect, write this node's record under a new lease, and watch the others'."""
        client = connect(target.store)
        node_id = node_id or default_node_id()
        beacon = Beacon(rdzv_addr)
        record = NodeRecord(
            node_id=node_id,
            host=socket.gethostname(),
            rdzv_addr=rdzv_addr,  # the address torch's rendezvous names this agent by
            pid=os.getpid(),
            gpus=list(range(gpus)),
            domain=domain,
            segment=segment,
            attempt=target.attempt,
            beacon=beacon.address,
            metrics=metrics,
        )
        claim_node_id(client, target.keys.node(node_id), node_id, ttl)  # an earlier incarnation's record goes first
        membership = Membership(client, target.keys)
        node = NodeLease(client, target.keys, record, ttl)
        fence = FenceWatch(lambda: time.monotonic() - node.lease.refreshed_at, node.lease.ttl, lambda: [
            r.beacon for r in membership.members().values() if r.node_id != record.node_id and r.beacon],
            confirm=lambda timeout: node.lease.confirm(timeout))
        beacon.report = fence.report
        events = EventLog(client, target.keys, record.node_id)
        log.info("node %s joined run %s (lease TTL %g s)", record.node_id, target.keys.run_id, ttl)
        return cls(client, target.keys, node, events, membership, run_dir, beacon, fence)

    def end_gone_neighbours(self, round_: int) -> list[str]:
        """The round's neighbours of this node whose agents are gone, their leases ended (gone_agents.py)."""
        return end_gone_leases(self.client, self.keys, self.membership.members(), self.node_id, round_)

    def leave(self, clean: bool) -> None:
        """Revoke the lease (marked exited first when ``clean``) and disconnect. The beacon closes
        after the mark: a peer that finds it closed may take this node for gone (gone_agents.py)."""
        if self.fence is not None:
            self.fence.close()
        try:
            self.node.close(clean)
        finally:
            if self.beacon is not None:
                self.beacon.close()
        self.membership.close()
        self.client.close()
