"""A member whose agent is gone is lost now, not when its lease expires.

A node's record lives as long as its lease, so its loss is seen a TTL after its agent last
refreshed it: with a spare waiting, most of a swap is that wait. Yet when an agent dies and its
host stays up (the agent killed, OOM-killed, crashed; the whole node's processes killed), the
host says so at once: its beacon port (``fence.Beacon``, open for all of the agent's life, closed
after its record is marked ``exited``) refuses connections.

So when this node's workers fail and no loss is known yet (``Observer``), it asks the beacons of
its neighbours in the round: the members just before and after it in node-id order, two asks
whatever the job's size (when a node dies, every survivor's collectives fail; its two
neighbours find it). A neighbour whose host refuses is gone: its lease is ended now (etcd
deletes its keys as at the lease's expiry) if its record is still that agent's and not marked
``exited`` (a clean departure), and every agent's membership watch sees the loss as it would at
the expiry (``node_lost``, the restart uncharged). Anything else waits for the lease as before:
a frozen agent (its kernel accepts), a dead host or a cut path (no answer), a peer that answers.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from elasticft.agent.fence import NoAnswer, ask
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord, NodeState
from elasticft.rendezvous.membership import end_node_lease, is_member_loss
from elasticft.store import EtcdClient, StoreError

log = logging.getLogger(__name__)

# a spare promoted into the round is a member before its record is rewritten (is_member_loss)
MEMBER_STATES = (NodeState.RUNNING, NodeState.SPARE)
ASK_TIMEOUT = 0.5  # seconds: a refusal comes back in a round trip; silence is the lease's to judge


def neighbours(records: dict[str, NodeRecord], node_id: str, round_: int) -> list[NodeRecord]:
    """The members of ``round_`` just before and after ``node_id`` in node-id order (a ring)."""
    ring = sorted({node_id} | {r.node_id for r in records.values()
                               if r.state in MEMBER_STATES and is_member_loss(r, round_)})
    if node_id not in ring or len(ring) < 2:
        return []
    at = ring.index(node_id)
    names = dict.fromkeys([ring[at - 1], ring[(at + 1) % len(ring)]])  # one name when there are two nodes
    return [records[name] for name in names if name != node_id]


def end_gone_leases(client: EtcdClient, keys: RunKeys, records: dict[str, NodeRecord], node_id: str,
                    round_: int) -> list[str]:
    """Ask this node's neighbours' beacons; end the leases of those whose agents are gone.
    Returns their node ids. etcd out of reach: nothing ended (the leases expire all the same)."""
    peers = [r for r in neighbours(records, node_id, round_) if r.beacon]
    if not peers:
        return []
    with ThreadPoolExecutor(len(peers), thread_name_prefix="eft-gone-ask") as pool:
        answers = list(pool.map(lambda r: ask(r.beacon, ASK_TIMEOUT), peers))
    gone = []
    for peer, answer in zip(peers, answers):
        if answer is not NoAnswer.REFUSED:
            continue
        try:
            # still that agent's record (another pid is the node back, node_claim.py) and not marked
            # exited (a clean departure). The record is read after the refusal, and an agent closes
            # its beacon after its last write (AgentContext.leave): no write of it comes between.
            if end_node_lease(client, keys.node(peer.node_id), lambda now, peer=peer: (
                    (now.pid, now.beacon) == (peer.pid, peer.beacon) and now.state is not NodeState.EXITED)):
                log.info("node %s (%s): its agent is gone (beacon %s refused the connection): its lease is ended, "
                         "so that the job sees the loss now rather than at the lease's expiry",
                         peer.node_id, peer.host, peer.beacon)
                gone.append(peer.node_id)
        except StoreError as exc:
            log.debug("could not end the lease of gone node %s: %s", peer.node_id, exc)
    return gone
