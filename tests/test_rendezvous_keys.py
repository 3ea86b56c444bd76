"""eft's keys-based etcd-v3 rendezvous handler, on the session's real etcd.

The semantics torch's agent relies on (min/max nodes, last call, join timeout, the
redundancy list, closing, num_nodes_waiting), a mixed-version job, a round of 128
agents with idle traffic of keep-alives only, and survivors of a killed node forming
a new round within the lease TTL plus a little.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from datetime import timedelta
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousParameters,
    RendezvousTimeoutError,
)

from bench.launch import wait_for
from bench.rdzv_sim import simulate_round
from elasticft.contract.keys import RunKeys
from elasticft.rendezvous.backend import create_handler
from elasticft.rendezvous.blob import create_blob_handler
from elasticft.rendezvous.rounds import MixedVersionError
from tests.rdzv_subjects import join_all


def params(endpoint: str, run_id: str, min_nodes: int, max_nodes: int, **conf) -> RendezvousParameters:
    conf = {"last_call_timeout": "1", "join_timeout": "30", "lease_ttl": "2", **conf}
    return RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id, min_nodes=min_nodes,
                                max_nodes=max_nodes, local_addr="127.0.0.1", **conf)


@pytest.fixture
def rendezvous(etcd_server):
    """``rendezvous(min, max, **conf) -> make()``: handlers of one fresh run; all leave at teardown."""
    run_id = uuid.uuid4().hex
    made = []

    def of(min_nodes: int, max_nodes: int, **conf):
        def make():
            made.append(create_handler(params(etcd_server.endpoint, run_id, min_nodes, max_nodes, **conf)))
            return made[-1]
        return make

    yield of
    for handler in made:
        handler.rounds.leave()




def test_max_nodes_form_a_round_at_once_with_distinct_ranks(rendezvous):
    make = rendezvous(2, 3, last_call_timeout="20")
    began = time.monotonic()
    infos = join_all([make() for _ in range(3)])
    assert time.monotonic() - began < 10  # no 20 s last call: the round is full
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    # every node reaches the same store, and rank 0's address reaches the others
    infos[0].store.set("hello", b"world")
    assert infos[2].store.get("hello") == b"world"
    assert len({(i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos}) == 1


def test_min_nodes_form_a_round_after_the_last_call(rendezvous):
    make = rendezvous(2, 4, last_call_timeout="1")
    began = time.monotonic()
    infos = join_all([make(), make()])
    assert time.monotonic() - began >= 1.0
    assert sorted(i.rank for i in infos) == [0, 1] and infos[0].world_size == 2


def test_too_few_nodes_time_out_at_the_join_timeout(rendezvous):
    handler = rendezvous(2, 2, join_timeout="1")()
    with pytest.raises(RendezvousTimeoutError):
        handler.next_rendezvous()


def test_a_late_node_waits_and_the_members_take_it_in_at_the_next_round(rendezvous):
    make = rendezvous(2, 3)
    members = [make(), make()]
    join_all(members)
    late = make()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(late.next_rendezvous)
        wait_for(lambda: members[0].num_nodes_waiting() == 1 and members[1].num_nodes_waiting() == 1, 10,
                 "members to see the waiting node")
        again = join_all(members)
        infos = again + [joined.result(timeout=30)]
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}


def test_a_new_round_gives_the_workers_a_bootstrap_store_with_nothing_of_the_last(rendezvous):
    # the next generation of workers must not read the last one's keys (gloo addresses
    # carry no generation: a survivor would dial the rank it replaced, dead or not)
    make = rendezvous(2, 2)
    handlers = [make(), make()]
    infos = join_all(handlers)
    first = next(i for i in infos if i.rank == 0).bootstrap_store_info
    old = dist.TCPStore(first.master_addr, first.master_port, is_master=False, timeout=timedelta(seconds=10))
    old.set("rank_1", b"the address of a worker that is gone")
    again = join_all(handlers)
    second = next(i for i in again if i.rank == 0).bootstrap_store_info
    fresh = dist.TCPStore(second.master_addr, second.master_port, is_master=False, timeout=timedelta(seconds=10))
    assert not fresh.check(["rank_1"])


def test_a_node_beyond_max_is_redundant_until_a_member_leaves(rendezvous):
    make = rendezvous(1, 2)
    members = [make(), make()]
    join_all(members)
    spare = make()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(spare.next_rendezvous)
        wait_for(members[0].rounds.someone_waits, 10, "the spare's marker to reach a member")
        assert members[0].num_nodes_waiting() == 0  # a full round does not restart for a spare
        members[1].leave_without_closing()
        wait_for(lambda: members[0].num_nodes_waiting() > 0, 10, "the member to see the departure")
        infos = [members[0].next_rendezvous(), joined.result(timeout=30)]
    assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}


def test_closing_ends_the_rendezvous_for_members_and_waiters(rendezvous):
    make = rendezvous(2, 3)
    members = [make(), make()]
    join_all(members)
    waiter = rendezvous(3, 3)()  # the same run; it waits for a third node that never comes
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(waiter.next_rendezvous)
        wait_for(lambda: members[0].num_nodes_waiting() == 1, 10, "the waiter's key to reach a member")
        assert members[0].shutdown() is True
        with pytest.raises(RendezvousClosedError):
            waiting.result(timeout=10)
    assert members[1].is_closed()
    with pytest.raises(RendezvousClosedError):
        members[1].next_rendezvous()


def test_an_agent_of_the_old_backend_makes_the_new_one_fail_in_one_line(etcd_server):
    run_id = uuid.uuid4().hex
    old = create_blob_handler(params(etcd_server.endpoint, run_id, 1, 1))
    old.next_rendezvous()
    new = create_handler(params(etcd_server.endpoint, run_id, 1, 2))
    try:
        with pytest.raises(MixedVersionError) as failure:
            new.next_rendezvous()
    finally:
        old.eft_membership.close()
        new.rounds.leave()
    message = str(failure.value)
    assert "\n" not in message and "older eft" in message and "same eft version" in message


def test_a_waiting_node_fails_in_one_line_when_an_old_agent_arrives(etcd_server):
    run_id = uuid.uuid4().hex
    new = create_handler(params(etcd_server.endpoint, run_id, 2, 2))
    old = create_blob_handler(params(etcd_server.endpoint, run_id, 1, 1))
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(new.next_rendezvous)
            old.next_rendezvous()
            with pytest.raises(MixedVersionError):
                waiting.result(timeout=10)
    finally:
        old.eft_membership.close()
        new.rounds.leave()


def test_128_agents_form_a_round_and_idle_membership_writes_nothing(etcd_server):
    result = simulate_round("keys", 128, etcd_server.endpoint, cap=120, idle=3)
    assert result.seconds is not None, result.error
    idle = result.idle_per_minute
    assert idle.revision == 0 and idle.db_bytes == 0  # keep-alives write no revision
    keep_alives_per_minute = 128 * 60 / (3 / 3)  # one per lease every ttl / 3 (the sim's lease_ttl: 3 s)
    assert idle.requests <= 1.5 * keep_alives_per_minute


KILLED_AGENT = textwrap.dedent("""
    import sys
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from elasticft.rendezvous.backend import create_handler
    endpoint, run_id = sys.argv[1:3]
    handler = create_handler(RendezvousParameters(backend="etcd-v3", endpoint=endpoint, run_id=run_id,
        min_nodes=2, max_nodes=3, local_addr="127.0.0.1", last_call_timeout="1", lease_ttl="2"))
    info = handler.next_rendezvous()
    print("joined", info.rank, flush=True)
    sys.stdin.read()
""")


def test_survivors_of_a_killed_node_form_a_new_round_within_the_lease_ttl(rendezvous, etcd_server, etcd):
    make = rendezvous(2, 3)
    survivors = [make(), make()]
    run_id = survivors[0].get_run_id()
    victim = subprocess.Popen([sys.executable, "-c", KILLED_AGENT, etcd_server.endpoint, run_id],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        # the victim in the round first: with three the round is full and forms at once
        wait_for(lambda: etcd.count_prefix(RunKeys(run_id).rdzv_participants(0)) == 1, 60, "the victim to join")
        infos = join_all(survivors)
        assert victim.stdout.readline().startswith("joined")
        assert infos[0].world_size == 3
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        killed = time.monotonic()
        wait_for(lambda: all(s.num_nodes_waiting() > 0 for s in survivors), 10, "survivors to see the loss")
        again = join_all(survivors)
        took = time.monotonic() - killed
    finally:
        victim.kill()
    assert {i.world_size for i in again} == {2}
    # lease TTL 2 s + last call 1 s; loose: a shared CI machine (bench measures it exactly)
    assert took < 2 + 1 + 3
