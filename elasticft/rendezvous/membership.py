"""Who is in the job: node records kept alive by etcd leases, and a watch on them.

Each agent writes ``/eft/<run>/nodes/<node_id>`` under its own lease (``NodeLease``).
If the agent dies, nothing refreshes the lease and etcd deletes the key within the
lease TTL. ``Membership`` mirrors the prefix (list, then watch from the next
revision) and tells apart a node that left cleanly (it marked itself ``exited``
before deleting its key) from a node that was lost.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from elasticft.contract.keys import RunKeys
from elasticft.contract.records import (
    NodeRecord,
    NodeState,
    apply_node_events,
    store_node_record,
)
from elasticft.store import EtcdClient, Lease, StoreError, WatchEvent
from elasticft.store.errors import LeaseNotFound, StoreClosed
from elasticft.store.outage import is_unavailable

log = logging.getLogger(__name__)


def default_node_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class NodeLease:
    """This agent's record, kept alive under its own lease."""

    def __init__(self, client: EtcdClient, keys: RunKeys, record: NodeRecord, ttl: float):
        self._client = client
        self._key = keys.node(record.node_id)
        self.record = record
        self.lease: Lease = client.lease(ttl)
        self._closed = False
        client.put(self._key, record.to_json(), lease=self.lease)

    def set_state(self, state: NodeState) -> None:
        """Rewrite the record with ``state`` (running, exited, excluded); raises StoreError."""
        self.record.state = NodeState(state)
        self._client.put(self._key, self.record.to_json(), lease=self.lease)

    def wait_as_spare(self, round_: int | None) -> None:
        """Say in the record that this node waits as a spare in rendezvous round ``round_``, or
        (None) that it is a member again; no write when the record says so already, nor over
        ``exited`` or ``excluded``. Raises StoreError."""
        state, spare_in = (NodeState.SPARE, round_) if round_ is not None else (NodeState.RUNNING, -1)
        if (self.record.state, self.record.spare_in) == (state, spare_in) or self.record.state not in (
                NodeState.RUNNING, NodeState.SPARE):
            return
        self.record.state, self.record.spare_in = state, spare_in
        self._client.put(self._key, self.record.to_json(), lease=self.lease)

    def workers_failed(self, round_: int) -> None:
        """Say in the record that this node's workers of rendezvous round ``round_`` failed; raises StoreError."""
        self.record.failed_round = round_
        self._client.put(self._key, self.record.to_json(), lease=self.lease)

    def rejoin(self) -> None:
        """Register again, same node id and record, after etcd let the lease expire (the node was
        frozen, or cut from etcd, for longer than the TTL; the others went on without it).
        Raises StoreError."""
        self.lease.regrant()
        self.set_state(NodeState.RUNNING)

    def close(self, clean: bool) -> None:
        """Leave the job (a second call does nothing).

        ``clean`` (the workers finished, or got past the save of a job-wide stop) marks the
        record exited before revoking, so watchers see a departure. Otherwise the key just
        vanishes: to the survivors that is a lost node, as it should be for an agent stopped
        by a signal before its workers saved, and for a node that left as a straggler (state
        ``excluded``): the survivors restart at once instead of charging their failed
        collectives to ``--max-restarts``.
        """
        if self._closed:
            return
        self._closed = True
        if clean:
            try:
                self.set_state(NodeState.EXITED)
            except StoreError as exc:
                log.warning("could not mark node %s exited: %s", self.record.node_id, exc)
        self.lease.revoke()


def running_nodes(client: EtcdClient, keys: RunKeys, spares: bool = False) -> dict[str, NodeRecord]:
    """The nodes whose record says ``running`` (and ``spare`` with ``spares``), read from etcd now
    (not a mirror)."""
    items, _ = client.get_prefix(keys.nodes)
    records: dict[str, NodeRecord] = {}
    for item in items:
        store_node_record(records, keys.nodes, item.key, item.value)
    wanted = (NodeState.RUNNING, NodeState.SPARE) if spares else (NodeState.RUNNING,)
    return {node: r for node, r in records.items() if r.state in wanted}


def end_node_lease(client: EtcdClient, key: str, still: Callable[[NodeRecord], bool]) -> NodeRecord | None:
    """Revoke the lease of the node record at ``key`` if ``still(record)`` holds for it as read
    now: etcd deletes the record and every other key of that agent (its rendezvous participant
    keys among them, which a next round waits for) as at the lease's expiry. For an agent known
    gone (``node_claim.py``, ``agent/gone_agents.py``). Returns the record ended, else None;
    raises StoreError."""
    item = client.get(key)
    if item is None or not item.lease:
        return None
    try:
        record = NodeRecord.from_json(item.value)
    except (ValueError, TypeError, KeyError):
        return None
    if not still(record):
        return None
    try:
        client.revoke_lease(item.lease)
    except LeaseNotFound:
        pass  # it expired (or another node ended it) since the read: gone all the same
    return record


def is_member_loss(record: NodeRecord, round_: int) -> bool:
    """Whether losing the node of ``record`` (its last record) loses a member of rendezvous round
    ``round_``: any node but a spare that waits in a later round. A spare promoted into ``round_``
    is a member even before its record says so (it is rewritten as the round forms, but its
    lease outlives the rewrite by a TTL: the round number, not the state word, decides)."""
    return not (record.state is NodeState.SPARE and record.spare_in > round_)


class Membership:
    """A live mirror of ``nodes/``; ``lost`` is set whenever a member is lost.

    A spare's loss is no member's (``is_member_loss``): ``on_spare_lost`` hears of it instead.
    """

    def __init__(self, client: EtcdClient, keys: RunKeys):
        self._client = client
        self._prefix = keys.nodes
        self._lock = threading.Lock()
        self._records: dict[str, NodeRecord] = {}
        self._lost: dict[str, NodeRecord] = {}  # every loss, for the rendezvous
        self._unreported: list[NodeRecord] = []  # losses the agent has not acted on
        self._formed_at = 0  # the revision this node's round was formed at (forget_non_members)
        self._lost_at: dict[str, int] = {}  # node -> the revision its record went (watched)
        self._excluded_at: dict[str, int] = {}  # node -> revision its record said ``excluded`` (watched)
        self._round = -1  # the rendezvous round this node is a member of (forget_non_members)
        # Told of each spare lost (on the watch's thread: keep it short).
        self.on_spare_lost: Callable[[NodeRecord], None] | None = None
        self.lost = threading.Event()
        self._closed = False
        self._cancel = None
        self._subscribe()

    def _subscribe(self) -> None:
        items, revision = self._client.get_prefix(self._prefix)
        with self._lock:
            self._records = {}
            for item in items:
                self._store(item.key, item.value)
        self._cancel = self._client.watch_prefix(
            self._prefix, self._on_events, start_revision=revision + 1, on_error=self._on_error
        )

    def _store(self, key: str, value: bytes) -> None:
        store_node_record(self._records, self._prefix, key, value)

    def _on_events(self, events: list[WatchEvent]) -> None:
        spares: list[NodeRecord] = []
        with self._lock:
            for event in events:
                for record in apply_node_events(self._records, self._prefix, [event]):
                    log.debug("node %s (%s) lost its lease", record.node_id, record.host)
                    if not is_member_loss(record, self._round):
                        spares.append(record)
                        continue
                    self._lost[record.node_id] = record
                    self._lost_at[record.node_id] = event.revision
                    marked = self._excluded_at.pop(record.node_id, None)
                    if marked is not None and marked <= self._formed_at:
                        continue  # left as a straggler before this node's round formed: not a member
                    self._unreported.append(record)
                    self.lost.set()
                node = event.key[len(self._prefix):]
                if not event.deleted and node in self._records and self._records[node].state is NodeState.EXCLUDED:
                    self._excluded_at.setdefault(node, event.revision)
        for record in spares:
            log.info("spare node %s (%s) lost its lease; the members go on", record.node_id, record.host)
            if self.on_spare_lost is not None:
                self.on_spare_lost(record)

    def _on_error(self, exc: Exception) -> None:
        if self._closed:
            return
        log.log(logging.DEBUG if is_unavailable(exc) else logging.WARNING,
                "watch on %s broke (%s); resubscribing", self._prefix, exc)

        def resubscribe():
            while not self._closed:
                try:
                    self._subscribe()
                    return
                except StoreClosed:  # the agent is shutting down: nothing left to mirror
                    return
                except StoreError as err:  # etcd away: its Outage says so, once
                    log.log(logging.DEBUG if is_unavailable(err) else logging.WARNING, "resubscribe failed: %s", err)
                    time.sleep(1.0)

        threading.Thread(target=resubscribe, name="eft-membership-resubscribe", daemon=True).start()

    def members(self) -> dict[str, NodeRecord]:
        """Every node with a record, spares included."""
        with self._lock:
            return dict(self._records)

    def failed_in(self, round_: int) -> list[NodeRecord]:
        """The live members whose record says their workers failed in rendezvous round ``round_``
        (their agents restart; the round's other ranks wait on dead peers). From the watch."""
        with self._lock:
            return [r for r in self._records.values() if r.failed_round == round_]

    def lost_nodes(self) -> dict[str, NodeRecord]:
        with self._lock:
            return dict(self._lost)

    def lost_rdzv_identities(self) -> set[tuple[str, int]]:
        with self._lock:
            return {record.rdzv_identity for record in self._lost.values()}

    def take_losses(self) -> list[NodeRecord]:
        """The nodes lost since the last call; clears ``lost``."""
        with self._lock:
            fresh, self._unreported = self._unreported, []
            self.lost.clear()
            return fresh

    def forget_non_members(self, formed_at: int | None = None, round_: int | None = None) -> None:
        """Drop the unreported departures of nodes that are no members of the round just formed.

        Called after a rendezvous round completed, ``formed_at`` the etcd revision its members
        were counted at (None: unknown). Two kinds: a node that left as a straggler (state
        ``excluded``) left instead of joining any later round, so the round is complete without
        it; one marked at or before ``formed_at`` is no member even when this watch delivers its
        departure only after the round formed (the decision comes through another watch). And a
        node lost at or before ``formed_at`` (its record and its participant key go at one
        revision): it died while this node restarted, the round formed without it, and its loss
        calls for no second restart. A node lost after ``formed_at`` was a member: still a loss.
        ``round_``: the number of that round (a spare waiting in a later one is no member).
        """
        with self._lock:
            if formed_at is not None:
                self._formed_at = formed_at
            if round_ is not None:
                self._round = round_

            def member(record: NodeRecord) -> bool:
                lost_at = self._lost_at.get(record.node_id)
                return record.state is not NodeState.EXCLUDED and not (
                    formed_at is not None and lost_at is not None and lost_at <= formed_at)

            self._unreported = [r for r in self._unreported if member(r)]
            if not self._unreported:
                self.lost.clear()

    def close(self) -> None:
        self._closed = True
        if self._cancel is not None:
            try:
                self._cancel()
            except StoreError:
                pass
