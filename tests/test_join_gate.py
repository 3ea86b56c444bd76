"""--eft-join-at on a real etcd: the members' gate (agent/join_gate.py) and the held node's wait (rendezvous/held.py)."""

import dataclasses
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from bench.launch import wait_for
from tests.rdzv_subjects import join_all
from elasticft.agent.join_gate import JoinGate, newest_checkpoint
from elasticft.contract.events import EventKind
from elasticft.contract.memory import MemPart
from elasticft.memckpt.index import MemIndex
from elasticft.contract.records import JoinHold
from elasticft.rendezvous.backend import create_handler, hold_joins
from elasticft.rendezvous.held import HeldWait
from elasticft.store.keyset import KeySet

DISK = ["disk every 10 iterations"]


@dataclass(frozen=True)
class Formed:
    number: int = 0
    rank: int = 0
    size: int = 2
    revision: int = 0


@pytest.fixture
def control(etcd, run_keys):
    """The control keys as a member's rendezvous watches them, with one node waiting for round 1."""
    etcd.put(run_keys.rdzv_waiting(1), "newcomer_1_0")
    keys = KeySet(etcd, run_keys.rdzv_control, lambda: None, end=run_keys.rdzv_watched_end)
    yield keys
    keys.close()


def part(node: str, iteration: int) -> MemPart:
    """``node``'s whole memory checkpoint of ``iteration`` (complete on its own)."""
    return MemPart(node=node, iteration=iteration, address="h:1", files={"a": [1, 0]}, holders=[node], needs=["a"])


def held(etcd, run_keys) -> JoinHold | None:
    found = etcd.get(run_keys.rdzv_held(1))
    return JoinHold.from_json(found.value) if found else None


def kinds(ctx) -> list[str]:
    return [e["kind"] for e in ctx.events.read()]


def test_rank0_holds_until_a_memory_iteration_is_complete_and_every_member_follows(
        etcd, run_keys, agent_context, control):
    etcd.put(run_keys.ckpt_latest, json.dumps({"iteration": 10}))
    first, second = agent_context("n0"), agent_context("n1")
    decider = JoinGate(first, "save", 30.0, DISK, memory=True)
    member = JoinGate(second, "save", 30.0, DISK, memory=True)
    assert not decider.admit(Formed(rank=0), control)
    assert held(etcd, run_keys) == JoinHold(by="n0", waiting="newcomer_1_0", after=10, wait=30.0)
    wait_for(lambda: run_keys.rdzv_held(1) in control, 10, "the hold in the control watch")
    assert not member.admit(Formed(rank=1), control) and not decider.admit(Formed(rank=0), control)
    index = MemIndex(etcd, run_keys)
    index.write("n0", [part("n0", 8)])  # older than the disk save: no
    index.write("n0", [part("n0", 8), dataclasses.replace(part("n0", 12), needs=None)])
    assert not decider.admit(Formed(rank=0), control)  # a part without the list of files: not complete
    index.write("n0", [part("n0", 8), part("n0", 12)])
    wait_for(lambda: decider.admit(Formed(rank=0), control), 10, "the decider to let it in")
    assert held(etcd, run_keys).let_in == "checkpoint" and held(etcd, run_keys).iteration == 12
    wait_for(lambda: member.admit(Formed(rank=1), control), 10, "the member to follow")
    assert kinds(first).count(EventKind.JOIN_HELD) == 1 and kinds(first).count(EventKind.JOIN_LET_IN) == 1
    let_in = next(e for e in first.events.read() if e["kind"] == EventKind.JOIN_LET_IN)
    assert let_in["why"] == "checkpoint" and let_in["iteration"] == 12 and let_in["round"] == 1


def test_the_wait_bounds_the_hold_and_a_disk_save_lets_in(etcd, run_keys, agent_context, control):
    gate = JoinGate(agent_context("n0"), "save", 0.3, DISK, memory=False)
    assert not gate.admit(Formed(), control)
    assert held(etcd, run_keys).after is None
    wait_for(lambda: gate.admit(Formed(), control), 10, "the wait to run out")
    assert held(etcd, run_keys).let_in == "waited"
    # the next round's newcomer: a disk save lets it in
    etcd.put(run_keys.rdzv_waiting(2), "newcomer_2_0")
    gate = JoinGate(agent_context("n2"), "save", 30.0, DISK, memory=False)
    assert not gate.admit(Formed(number=1), control)
    etcd.put(run_keys.ckpt_latest, json.dumps({"iteration": 20}))
    wait_for(lambda: gate.admit(Formed(number=1), control), 10, "the disk save to let it in")


def test_now_and_a_job_without_checkpoints_let_in_at_once(agent_context, control, etcd, run_keys, caplog):
    ctx = agent_context("n0")
    assert JoinGate(ctx, "now", 600.0, DISK, memory=False).admit(Formed(), control)
    with caplog.at_level(logging.INFO, logger="elasticft.agent.join_gate"):
        assert JoinGate(ctx, "save", 600.0, [], memory=False).admit(Formed(), control)
    assert "no checkpoint tier" in caplog.text
    assert held(etcd, run_keys) is None and EventKind.JOIN_HELD not in kinds(ctx)


def test_newest_checkpoint_of_either_tier():
    assert newest_checkpoint(None, [], {"n0"}) is None
    assert newest_checkpoint(b'{"iteration": 7}', [part("n0", 9)], {"n0"}) == 9
    assert newest_checkpoint(b'{"iteration": 7}', [part("n1", 9)], {"n0"}) == 7  # no live holder
    assert newest_checkpoint(b"not json", [], {"n0"}) is None


def test_a_held_node_waits_the_hold_longer_and_says_so(caplog):
    wait = HeldWait("newcomer_1_0", join_timeout=5.0)
    now = time.monotonic()
    hold = JoinHold(by="n0", waiting="newcomer_1_0", after=10, wait=100.0)
    assert wait.deadline(1, None, now + 5) == now + 5
    with caplog.at_level(logging.INFO, logger="elasticft.rendezvous.held"):
        later = wait.deadline(1, hold.to_json().encode(), now + 5)
        assert wait.deadline(1, hold.to_json().encode(), later) == later  # once per record
        let_in = JoinHold(by="n0", waiting="newcomer_1_0", after=10, wait=100.0, let_in="checkpoint", iteration=20)
        assert wait.deadline(1, let_in.to_json().encode(), later) == later
    assert later >= now + 105
    assert "newcomer_1_0 waits to join: held until the next checkpoint (at most 100 s)" in caplog.text
    assert "joins round 1: let in (checkpoint)" in caplog.text


def test_a_member_that_moved_on_is_not_held(etcd, run_keys, agent_context):
    """Its workers failed and it waits for the next round: the round restarts for it as before."""
    revision = etcd.put(run_keys.rdzv_participant(0, "member_0"), "{}")
    etcd.delete(run_keys.rdzv_participant(0, "member_0"))
    etcd.put(run_keys.rdzv_waiting(1), "member_0")
    control = KeySet(etcd, run_keys.rdzv_control, lambda: None, end=run_keys.rdzv_watched_end)
    try:
        assert JoinGate(agent_context("n0"), "save", 30.0, DISK, memory=False).admit(Formed(revision=revision), control)
    finally:
        control.close()
    assert held(etcd, run_keys) is None


@pytest.fixture
def handlers(etcd_server, run_keys):
    """``handlers(n) -> [handler]``: eft's rendezvous handlers of this test's run (2:3 nodes,
    a 2 s join timeout); all leave at teardown."""
    made = []

    def make(count: int):
        conf = {"last_call_timeout": "1", "join_timeout": "2", "lease_ttl": "2"}
        for _ in range(count):
            made.append(create_handler(RendezvousParameters(
                backend="etcd-v3", endpoint=etcd_server.endpoint, run_id=run_keys.run_id, min_nodes=2, max_nodes=3,
                local_addr="127.0.0.1", **conf)))
        return made[-count:]

    yield make
    for handler in made:
        handler.rounds.leave()




def look(members) -> list[int]:
    """What torch's agent asks each member at every look at its workers."""
    return [m.num_nodes_waiting() for m in members]


def held_round(handlers, agent_context):
    """Two members of a formed round, each with its gate, and a late node waiting for the next."""
    members = handlers(2)
    join_all(members)
    members.sort(key=lambda h: h.round.rank)
    for member in members:
        hold_joins(member, JoinGate(agent_context(f"n{member.round.rank}"), "save", 30.0, DISK, memory=False))
    (late,) = handlers(1)
    return members, late


def test_a_held_node_waits_past_its_join_timeout_and_joins_at_the_save(handlers, agent_context, etcd, run_keys):
    members, late = held_round(handlers, agent_context)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(late.next_rendezvous)
        wait_for(lambda: look(members) == [0, 0] and held(etcd, run_keys), 10, "the hold")
        until = time.monotonic() + 2.5  # past the late node's join timeout
        while time.monotonic() < until:
            assert look(members) == [0, 0] and not joined.done()
            time.sleep(0.1)
        etcd.put(run_keys.ckpt_latest, json.dumps({"iteration": 30}))
        wait_for(lambda: look(members) == [1, 1], 10, "the members to let it in")
        infos = join_all(members) + [joined.result(timeout=30)]
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}
    assert held(etcd, run_keys) is None  # gone with the round it was for


def test_a_member_lost_while_a_join_is_held_restarts_the_round_with_the_newcomer(handlers, agent_context, etcd,
                                                                                   run_keys):
    members, late = held_round(handlers, agent_context)
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(late.next_rendezvous)
        wait_for(lambda: look(members) == [0, 0] and held(etcd, run_keys), 10, "the hold")
        members[1].rounds.leave()
        wait_for(lambda: members[0].num_nodes_waiting() > 0, 10, "the survivor to see the loss")
        infos = join_all(members[:1]) + [joined.result(timeout=30)]
    assert {i.world_size for i in infos} == {2}
