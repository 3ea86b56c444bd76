"""A member whose agent is gone is lost at once, not at its lease's expiry
(elasticft/agent/gone_agents.py): real etcd, real leases, real sockets as beacons."""

from __future__ import annotations

import socket

import pytest

from elasticft.agent.fence import Beacon
from elasticft.agent.gone_agents import end_gone_leases, neighbours
from elasticft.contract.records import NodeRecord, NodeState
from elasticft.rendezvous.membership import Membership, NodeLease

TTL = 30.0  # longer than any test: a loss seen here was not the lease's expiry


def rec(node_id: str, state: NodeState = NodeState.RUNNING, spare_in: int = -1, beacon: str = "") -> NodeRecord:
    return NodeRecord(node_id, "host", "addr", 1, state=state, spare_in=spare_in, beacon=beacon)


def test_a_node_asks_its_two_neighbours_in_the_round_whatever_the_jobs_size():
    records = {r.node_id: r for r in [rec(f"n{i:04d}") for i in range(1000)]}
    records["n0500"] = rec("n0500", NodeState.SPARE, spare_in=3)  # waits in a later round: no member
    records["n0502"] = rec("n0502", NodeState.EXITED)
    assert [r.node_id for r in neighbours(records, "n0501", round_=2)] == ["n0499", "n0503"]
    assert [r.node_id for r in neighbours(records, "n0000", round_=2)] == ["n0999", "n0001"]  # a ring
    records["n0500"] = rec("n0500", NodeState.SPARE, spare_in=2)  # promoted into this round, record not yet rewritten
    assert [r.node_id for r in neighbours(records, "n0501", round_=2)] == ["n0500", "n0503"]
    two = {"a": rec("a"), "b": rec("b")}
    assert [r.node_id for r in neighbours(two, "a", round_=0)] == ["b"]  # asked once
    assert neighbours({"a": rec("a")}, "a", round_=0) == []


@pytest.fixture
def nodes(etcd, run_keys):
    """``nodes(name, beacon)``: a live record of ``name`` under its own lease, its beacon at ``beacon``."""
    made = []

    def make(name: str, beacon: str, state: NodeState = NodeState.RUNNING) -> NodeLease:
        made.append(NodeLease(etcd, run_keys, NodeRecord(name, "host", "addr", 100 + len(made), beacon=beacon,
                                                         state=state), ttl=TTL))
        return made[-1]

    yield make
    for lease in made:
        lease.close(clean=False)


def closed_port() -> str:
    """An address on this host where nothing listens: a dead agent's beacon."""
    beacon = Beacon("127.0.0.1")
    beacon.close()
    return beacon.address


def test_a_neighbour_whose_beacon_refuses_is_lost_now_with_every_key_of_its_lease(etcd, run_keys, nodes):
    """Its agent killed, its host up: the loss shows in the membership watch at once, as at its
    lease's expiry (a lost node, not an exit), and its rendezvous keys go with it (the next round
    would otherwise wait for them)."""
    me = Beacon("127.0.0.1")
    membership = Membership(etcd, run_keys)
    try:
        nodes("a", me.address)
        gone = nodes("b", closed_port())
        etcd.put(run_keys.rdzv_participant(0, "b"), b"{}", lease=gone.lease)
        assert end_gone_leases(etcd, run_keys, membership.members(), "a", 0) == ["b"]
        assert membership.lost.wait(10)
        assert [r.node_id for r in membership.take_losses()] == ["b"]
        assert etcd.get(run_keys.node("b")) is None and etcd.get(run_keys.rdzv_participant(0, "b")) is None
    finally:
        me.close()
        membership.close()


def test_a_frozen_agent_a_peer_that_answers_and_a_clean_exit_are_left_to_their_leases(etcd, run_keys, nodes):
    """A frozen agent's kernel still accepts connections (a listening socket never accepted from);
    a live agent answers; a node that marked itself exited and closed its beacon left cleanly."""
    frozen = socket.create_server(("127.0.0.1", 0))  # listens, never accepts: a SIGSTOPped agent
    live = Beacon("127.0.0.1")
    membership = Membership(etcd, run_keys)
    try:
        nodes("a", live.address)
        nodes("b", f"127.0.0.1:{frozen.getsockname()[1]}")
        nodes("c", live.address)
        assert end_gone_leases(etcd, run_keys, membership.members(), "a", 0) == []  # asks b and c
        nodes("d", closed_port(), state=NodeState.EXITED)
        assert end_gone_leases(etcd, run_keys, membership.members(), "a", 0) == []  # asks b and d
        assert {"a", "b", "c", "d"} <= set(membership.members()) and not membership.lost.is_set()
    finally:
        frozen.close()
        live.close()
        membership.close()


def test_a_node_back_under_its_id_is_not_taken_for_its_gone_incarnation(etcd, run_keys, nodes):
    """The record read names the dead agent's beacon; by the time of the ask, the node's new agent
    wrote its own record (node_claim.py): that one is left alone."""
    me = Beacon("127.0.0.1")
    membership = Membership(etcd, run_keys)
    try:
        nodes("a", me.address)
        dead = nodes("b", closed_port())
        seen = membership.members()
        dead.close(clean=False)
        nodes("b", me.address)  # the node back, another pid and beacon
        assert end_gone_leases(etcd, run_keys, seen, "a", 0) == []
        assert etcd.get(run_keys.node("b")) is not None
    finally:
        me.close()
        membership.close()
