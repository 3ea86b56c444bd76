"""A member of the round before keeps its rank, and a spare taken in takes the rank of the node it
replaces (``rendezvous/decision.py``): every survivor's share of a memory checkpoint is where its
rank still is, and the spare is the one node that needs the lost node's.

eft's handlers on real etcd (torch's registry builds them, real threads join). The spare's name
sorts before the members' (``127.0.0.1_...`` before ``localhost_...``): ranks in name order would
give it rank 0 and move the survivor.
"""

from __future__ import annotations

import pytest

from bench.launch import wait_for
from tests.rdzv_subjects import Run, eft_subject, in_thread, join_all


@pytest.fixture
def run(etcd_server, etcd):
    made = Run(eft_subject(etcd_server, etcd))
    yield made
    made.close()


@pytest.mark.parametrize("lost_rank", [0, 1])
def test_the_survivor_keeps_its_rank_and_the_spare_takes_the_lost_nodes(run, lost_rank):
    members = [run.handler(2, 2, local_addr="localhost") for _ in range(2)]
    first = join_all(members)
    spare = run.handler(2, 2, local_addr="127.0.0.1")
    assert spare.rounds.node < min(m.rounds.node for m in members)  # it sorts first
    promoted = in_thread(spare.next_rendezvous)
    wait_for(lambda: run.subject.probe.spare_registered(run.run_id, members[0]), 15, "the spare to register")

    lost = next(m for m, info in zip(members, first) if info.rank == lost_rank)
    survivor = next(m for m in members if m is not lost)
    kept = next(info.rank for m, info in zip(members, first) if m is survivor)
    run.subject.probe.lose(lost)
    wait_for(lambda: survivor.num_nodes_waiting() > 0, 30, "the survivor to see the loss")
    again = survivor.next_rendezvous()
    taken = promoted.result(timeout=30)
    assert (again.rank, taken.rank) == (kept, lost_rank)
    assert again.world_size == taken.world_size == 2
    # one bootstrap store, rank 0's, for both
    assert again.bootstrap_store_info.master_port == taken.bootstrap_store_info.master_port


def test_a_round_of_the_same_nodes_keeps_every_rank(run):
    members = [run.handler(3, 3) for _ in range(3)]
    first = {m.rounds.node: i.rank for m, i in zip(members, join_all(members))}
    again = {m.rounds.node: i.rank for m, i in zip(members, join_all(members))}
    assert again == first and sorted(first.values()) == [0, 1, 2]


def test_spares_whose_names_sort_first_never_displace_a_survivor(run):
    members = [run.handler(2, 2, local_addr="localhost") for _ in range(2)]
    first = join_all(members)
    spares = [run.handler(2, 2, local_addr="127.0.0.1") for _ in range(2)]  # both sort before the members
    waiting = [in_thread(s.next_rendezvous) for s in spares]
    wait_for(lambda: run.subject.probe.spare_registered(run.run_id, members[0]), 15, "the spares to register")
    lost, survivor = members
    run.subject.probe.lose(lost)
    wait_for(lambda: survivor.num_nodes_waiting() > 0, 30, "the survivor to see the loss")
    again = in_thread(survivor.next_rendezvous).result(timeout=30)  # by name alone: both spares, not it
    assert again.rank == first[1].rank and again.world_size == 2
    taken = wait_for(lambda: [f for f in waiting if f.done()], 30, "a spare to be taken in")
    assert len(taken) == 1 and taken[0].result().rank == first[0].rank
