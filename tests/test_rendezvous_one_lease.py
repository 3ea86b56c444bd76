"""Under eft's agent a node holds one etcd lease and one watch on who is alive (issue 35).

Its record (``nodes/<node>``) and its rendezvous keys share the node's lease, and the
rendezvous learns of a lost member from the agent's membership watch instead of a watch
of its own. Counted by etcd itself (/metrics), on an etcd of the test's own, next to the
design before it (``two``: the handler's own lease and participant watch), measured the
same way in the same test.
"""

from __future__ import annotations

import uuid

import pytest

from bench.launch import wait_for
from bench.rdzv_agents import SimulatedNode, connect_to, join_round
from bench.rdzv_sim import metric_totals
from elasticft.contract.keys import RunKeys
from elasticft.store import EmbeddedEtcd

pytestmark = pytest.mark.timeout(120)

NODES = 3


@pytest.fixture
def own_etcd():
    with EmbeddedEtcd() as server:
        client = connect_to(server.endpoint)
        yield server.endpoint, client
        client.close()


def footprint(endpoint: str, client, design: str) -> dict:
    """A round of NODES nodes of ``design``; what etcd holds for them once it formed, and
    what one lost node then costs: watch events sent, and whether the survivors saw it."""
    keys = RunKeys(uuid.uuid4().hex)
    before = metric_totals(endpoint)
    nodes = [SimulatedNode.join(client, endpoint, keys, f"n{i}", NODES, design, lease_ttl=2.0)
             for i in range(NODES)]
    try:
        join_round(nodes)
        assert all(n.handler.num_nodes_waiting() == 0 for n in nodes)  # steady state: every watch made
        now = metric_totals(endpoint)
        seen = {
            "leases": now("etcd_debugging_lease_granted_total") - before("etcd_debugging_lease_granted_total"),
            "watchers": now("etcd_debugging_mvcc_watcher_total") - before("etcd_debugging_mvcc_watcher_total"),
        }
        lost, survivors = nodes[-1], nodes[:-1]
        record = client.get(keys.node(lost.name))
        participant = [kv for kv in client.get_prefix(keys.rdzv_participants(0))[0]
                       if lost.handler.rounds.node in kv.key]
        seen["one lease for record and round"] = record.lease == participant[0].lease
        lost.unplug()  # its watches end first, as a dead node's do (etcd ends them a moment later)
        wait_for(lambda: metric_totals(endpoint)("etcd_debugging_mvcc_watcher_total")
                 <= now("etcd_debugging_mvcc_watcher_total") - seen["watchers"] / NODES, 30, "its watches to end")
        sent = metric_totals(endpoint)("etcd_debugging_mvcc_events_total")
        lost.expire()
        wait_for(lambda: all(n.handler.num_nodes_waiting() > 0 for n in survivors), 30,
                 "the survivors to see the lost member")
        wait_for(lambda: all(n.membership.lost.is_set() for n in survivors), 30, "the membership watches")
        seen["events per loss"] = metric_totals(endpoint)("etcd_debugging_mvcc_events_total") - sent
        return seen
    finally:
        for n in nodes[:-1]:
            n.leave()
        # every watch of this design ended before the next is counted: etcd sends (and counts) a
        # watch's events on its own schedule, and the leavers' last writes must not land in the next
        # design's window (under a loaded machine they did: 5 events per loss instead of 2)
        wait_for(lambda: metric_totals(endpoint)("etcd_debugging_mvcc_watcher_total")
                 <= before("etcd_debugging_mvcc_watcher_total"), 30, "this design's watches to end")


def test_a_node_holds_one_lease_and_one_membership_watch_and_a_loss_costs_one_event_per_survivor(own_etcd):
    endpoint, client = own_etcd
    two = footprint(endpoint, client, "two")
    shared = footprint(endpoint, client, "shared")
    # before: a lease for the record and one for the rendezvous keys; watches on nodes/,
    # on the rendezvous control keys and on the round's participants
    assert two["leases"] == 2 * NODES and two["watchers"] == 3 * NODES
    assert not two["one lease for record and round"]
    assert shared["leases"] == NODES, shared
    assert shared["watchers"] == 2 * NODES, shared  # nodes/ and the control keys
    assert shared["one lease for record and round"]
    # the lost node's record and participant key go at one revision: each survivor's one
    # watch on who is alive hears it once (before: twice, on two watches)
    assert shared["events per loss"] == NODES - 1, shared
    assert two["events per loss"] == 2 * (NODES - 1), two
