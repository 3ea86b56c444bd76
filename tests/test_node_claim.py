"""A node that comes back under its id while its earlier record is still in etcd
(elasticft/rendezvous/node_claim.py): the others must still see it lost, and two live
agents must not share one id. Real etcd, real leases."""

from __future__ import annotations

import logging
import socket
import subprocess
import threading

import pytest

from bench.launch import wait_for
from elasticft.config import ConfigError
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import Membership, NodeLease
from elasticft.rendezvous.node_claim import claim_node_id


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_node_back_within_its_ttl_removes_its_dead_incarnations_record_and_the_others_see_it_lost(
        etcd, run_keys):
    """Its agent killed, the node's record lives on until its lease expires. Written over by the
    new agent, it would never go: the survivors would see no loss (no ``node_lost``)."""
    membership = Membership(etcd, run_keys)
    earlier = NodeLease(etcd, run_keys, NodeRecord("n1", socket.gethostname(), "addr", dead_pid()), ttl=30)
    etcd.put(run_keys.rdzv_participant(0, "n1"), b"{}", lease=earlier.lease)  # the next round would wait for it
    try:
        claim_node_id(etcd, run_keys.node("n1"), "n1", ttl=30)  # at once: not the 30 s of its lease
        assert etcd.get(run_keys.node("n1")) is None and etcd.get(run_keys.rdzv_participant(0, "n1")) is None
        assert membership.lost.wait(10)
        assert [r.node_id for r in membership.take_losses()] == ["n1"]
    finally:
        earlier.close(clean=False)
        membership.close()


def test_a_record_from_another_host_is_awaited_until_its_lease_ends(etcd, run_keys, caplog):
    """A record written elsewhere cannot be told dead from here: its lease decides."""
    other = NodeLease(etcd, run_keys, NodeRecord("n1", "other-host", "addr", 4242), ttl=30)
    claimed = threading.Event()
    caplog.set_level(logging.INFO, logger="elasticft.rendezvous.node_claim")
    waiter = threading.Thread(target=lambda: (claim_node_id(etcd, run_keys.node("n1"), "n1", ttl=30), claimed.set()))
    waiter.start()
    try:
        wait_for(lambda: "waiting for its lease to expire" in caplog.text, 10, "the claim to wait")
        assert not claimed.is_set()
        other.close(clean=False)  # its lease ends (as at its expiry)
        assert claimed.wait(10)
    finally:
        other.close(clean=False)
        waiter.join(10)


def test_two_live_agents_given_one_id_is_one_line_naming_the_flag(etcd, run_keys):
    live = NodeLease(etcd, run_keys, NodeRecord("n1", "other-host", "addr", 4242), ttl=3)
    try:
        with pytest.raises(ConfigError, match=r"^--eft-node-id n1: a live agent of this run has that id "
                                              r"\(pid 4242 on other-host\); every node needs an id of its own$"):
            claim_node_id(etcd, run_keys.node("n1"), "n1", ttl=0.5)  # its keep-alives outlast 2 TTLs
        assert etcd.get(run_keys.node("n1")) is not None  # the live agent's record is left alone
    finally:
        live.close(clean=False)
