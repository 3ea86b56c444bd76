"""Standing aside (rendezvous/aside.py), on the session's real etcd with real handlers.

A node cut from its round's master while it still reaches etcd is simulated by
sending that node's probes to a real silent endpoint (a listening socket whose accept
queue is full: connections neither open nor are refused), and nothing else; the rules
are then the real ones: who stands aside, when the others go on without it, when it
comes back. Real cuts between network namespaces: tests/test_partitions.py.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from bench.launch import wait_for
from elasticft.rendezvous import aside
from elasticft.rendezvous.backend import EtcdRendezvousOptions, RendezvousConfigError, create_handler
from elasticft.rendezvous.handler import EtcdRendezvousHandler


@pytest.fixture(scope="module")
def silent():
    """A loopback address:port that never answers: listen(0), and its one slot taken."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        address = server.getsockname()
        with socket.create_connection(address, 1):
            yield address


def params(endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf) -> RendezvousParameters:
    conf = {"last_call_timeout": "1", "join_timeout": "60", "lease_ttl": "2", "peer_probe_timeout": "1", **conf}
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id, min_nodes=min_nodes,
                                max_nodes=max_nodes, local_addr="127.0.0.1", **conf)


class Node:
    """A handler whose probes of a port for which ``cut_from`` is true go to ``silent``: its view
    of a cut from the peers that serve there (each round's master serves on a new port)."""

    def __init__(self, handler: EtcdRendezvousHandler, silent):
        self.handler = handler
        self.cut_from = lambda port: False
        peers = handler.peers
        check, master_of = peers.check, peers._master_of

        def route(address):
            return silent if address is not None and self.cut_from(address[1]) else address

        peers.check = lambda formed, addr, port: check(formed, *route((addr, port)))
        peers._master_of = lambda n: route(master_of(n))

    def cut_from_all(self) -> None:
        self.cut_from = lambda port: True

    def heal(self) -> None:
        self.cut_from = lambda port: False

    @property
    def serves(self) -> int | None:
        """The port of the store this node serves as its round's master, if it is one now."""
        server = self.handler._tcp_store_server
        return server.port if server is not None else None

    @property
    def name(self) -> str:
        return self.handler.rounds.node


@pytest.fixture
def nodes(etcd_server, silent):
    """``nodes(n, min_nodes)``: n handlers of one fresh run (max n); all leave at teardown."""
    run_id, made = uuid.uuid4().hex, []

    def make(n: int, min_nodes: int) -> list[Node]:
        made.extend(Node(create_handler(params(etcd_server.endpoint, run_id, min_nodes, n)), silent) for _ in range(n))
        return made[-n:]

    yield make
    for node in made:
        node.handler.rounds.leave()


def join(handler: EtcdRendezvousHandler):
    """A rendezvous as eft's agent makes it: once ranks are assigned, stand aside if cut."""
    info = handler.next_rendezvous()
    while handler.stand_aside_if_cut():
        info = handler.next_rendezvous()
    return info


def rendezvous(nodes: list[Node]) -> dict[str, int]:
    """Each node's next round, in parallel: node name -> world size."""
    with ThreadPoolExecutor(len(nodes)) as pool:
        infos = list(pool.map(lambda n: join(n.handler), nodes))
    return {n.name: i.world_size for n, i in zip(nodes, infos)}


def in_background(node: Node) -> ThreadPoolExecutor:
    pool = ThreadPoolExecutor(1)
    node.pending = pool.submit(join, node.handler)
    return pool


def restart(*survivors: Node) -> None:
    """What their agents do once a member of their round is gone: a new rendezvous."""
    wait_for(lambda: survivors[0].handler.num_nodes_waiting() > 0, 30, "a member of the round to leave it")
    for n in survivors:
        in_background(n)


def by_rank(nodes: list[Node]) -> list[Node]:
    return sorted(nodes, key=lambda n: n.handler.round.rank)


def test_reachable_is_an_answer_within_the_timeout(silent):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert aside.reachable(*listening.getsockname(), timeout=2)
        closed = listening.getsockname()
    assert aside.reachable(*closed, timeout=2)  # refused: the host is there
    began = time.monotonic()
    assert not aside.reachable(*silent, timeout=1.5)
    assert 1.4 < time.monotonic() - began < 3
    began = time.monotonic()
    assert aside.reachable(*silent, timeout=30, give_up=lambda: True)  # another reason to move on
    assert time.monotonic() - began < 3


def test_a_node_cut_from_its_master_stands_aside_and_joins_again_once_healed(nodes):
    three = nodes(3, min_nodes=2)
    assert set(rendezvous(three).values()) == {3}
    master, other, cut = by_rank(three)
    cut.cut_from_all()
    for n in (master, other):
        in_background(n)
    pool = in_background(cut)
    # the next round forms with all three; the cut node then leaves it, the others restart
    # (their workers could not have trained) and go on at world size 2 without it
    assert master.pending.result(30).world_size == other.pending.result(30).world_size == 3
    restart(master, other)
    assert master.pending.result(30).world_size == other.pending.result(30).world_size == 2
    assert not cut.pending.done()
    control = cut.handler.rounds.control()
    assert any(k.endswith("aside/" + cut.name) for k in control)
    assert not master.handler.peers.odd_one_out(control)  # one node cannot make a master step back
    cut.heal()  # healed: it joins the next round, the others take it in
    wait_for(lambda: master.handler.num_nodes_waiting() > 0, 30, "the healed node to wait for a round")
    for n in (master, other):
        in_background(n)
    assert {n.pending.result(30).world_size for n in three} == {3}
    assert not any("/aside/" in k for k in master.handler.rounds.control())  # its marker went when it joined
    pool.shutdown()


def test_a_master_that_most_nodes_cannot_reach_stands_aside_itself(nodes):
    three = nodes(3, min_nodes=2)
    rendezvous(three)
    master, others = by_rank(three)[0], by_rank(three)[1:]
    master.cut_from = lambda port: port != master.serves  # every store but its own is out of reach
    for n in others:
        n.cut_from = lambda port: port == master.serves
    for n in three:
        in_background(n)
    assert master.pending.result(30).world_size == 3
    restart(master)
    # both others stand aside naming the master; it finds itself the odd one out and steps
    # back; they join again and train at world size 2, the master waits outside
    wait_for(lambda: all(n.pending.done() for n in others), 60, "the two others to form a round")
    assert [n.pending.result().world_size for n in others] == [2, 2]
    assert master.name not in {n.handler.rounds.node for n in others}
    assert not master.pending.done()
    assert any(k.endswith("aside/" + master.name) for k in master.handler.rounds.control())
    for n in three:
        n.heal()
    wait_for(lambda: others[0].handler.num_nodes_waiting() > 0, 30, "the master to wait for a round again")
    for n in others:
        in_background(n)
    assert {n.pending.result(30).world_size for n in three} == {3}


def test_of_two_nodes_cut_from_each_other_the_master_trains_on(nodes):
    two = nodes(2, min_nodes=1)
    rendezvous(two)
    master, cut = by_rank(two)
    cut.cut_from_all()
    in_background(master)
    in_background(cut)
    assert master.pending.result(30).world_size == 2
    restart(master)
    assert master.pending.result(30).world_size == 1
    wait_for(lambda: any(k.endswith("aside/" + cut.name) for k in master.handler.rounds.control()), 30,
             "the cut node's marker")
    # one marker: the master's round stays as it is, the other node waits outside
    assert not master.handler.peers.odd_one_out(master.handler.rounds.control())
    assert master.handler.num_nodes_waiting() == 0 and not cut.pending.done()
    cut.heal()
    wait_for(lambda: master.handler.num_nodes_waiting() > 0, 30, "the healed node to wait for a round")
    in_background(master)
    assert {n.pending.result(30).world_size for n in two} == {2}


def test_peer_probe_timeout_is_checked_and_zero_turns_it_off(etcd_server):
    def options(value):
        return EtcdRendezvousOptions.from_params(params(etcd_server.endpoint, "x", 1, 1, peer_probe_timeout=value))

    assert options("0").peer_probe_timeout == options("0.0").peer_probe_timeout == 0.0
    assert options("2.5").peer_probe_timeout == 2.5
    with pytest.raises(RendezvousConfigError, match="peer_probe_timeout expects seconds"):
        options("soon")
    with pytest.raises(RendezvousConfigError, match=r"peer_probe_timeout must be > 0 \(or 0: off\)"):
        options("-1")
