"""Spares in the memory tier (issue 55, docs/spares.md): real tiers on the session's etcd, real
HTTP on 127.0.0.1, real files (tests/memckpt_parts.py). Each spare keeps an extra copy of every
part of its segment, so that the spare promoted in a lost node's place restores from its own memory.
"""

from __future__ import annotations

import pytest

from bench.launch import wait_for
from elasticft.contract.memory import Restorable
from elasticft.memckpt.index import MemIndex
from elasticft.memckpt.placement import Spares, spare_holders
from tests.memckpt_parts import make_node, shard_name
from tests.test_memckpt_tier import ITER, flush, lose, plan_of, read_whole, save_all


def test_spares_of_the_origins_segment_hold_its_copies_and_without_segments_all_do():
    waiting = {"s0": "rack-a", "s1": "rack-b", "s2": "rack-a"}
    assert spare_holders("n0", Spares(lambda: waiting, segment="rack-a")) == ["s0", "s2"]
    assert spare_holders("n0", Spares(lambda: waiting)) == ["s0", "s1", "s2"]
    assert spare_holders("s1", Spares(lambda: waiting)) == ["s0", "s2"]  # never the origin itself
    assert spare_holders("n0", Spares(lambda: waiting, segment="rack-c")) == []


def writers_of(etcd, key: str) -> set[str]:
    """Every agent that ever wrote ``mem/restorable``: the key's history, replayed by a watch."""
    values, current = [], etcd.get(key).value
    cancel = etcd.watch_prefix(key, lambda events: values.extend(e.value for e in events if e.key == key),
                               start_revision=1)
    try:
        wait_for(lambda: values and values[-1] == current, 10, "the key's history")
    finally:
        cancel()
    return {Restorable.from_json(value).by for value in values}


@pytest.fixture
def members_and_a_spare(etcd, run_keys, tmp_path):
    """n0 and n1 train; a0 (whose name sorts first) waits as a spare until ``promote`` is called."""
    made, waits = [], {"a0": True}
    waiting = lambda: {"a0": ""} if waits["a0"] else {}  # noqa: E731 - the membership watch's live answer

    def make(spare_budget_gb: float = 1.0):
        members = [make_node(etcd, run_keys, tmp_path, f"n{r}", r, spares=Spares(waiting)) for r in range(2)]
        spare = make_node(etcd, run_keys, tmp_path, "a0", 1, budget_gb=spare_budget_gb,
                          spares=Spares(waiting, lambda: waits["a0"]))
        made.extend([*members, spare])
        for node in members:
            node.tier.set_members({"n0": "", "n1": ""})  # the ring: the members, not the spare
            node.start_workers({"n0", "n1", "a0"})
        return members, spare, lambda: waits.update(a0=False)

    yield make
    for node in made:
        node.tier.close()


def test_a_promoted_spare_reads_a_lost_nodes_share_from_its_own_memory(members_and_a_spare, etcd, run_keys,
                                                                          tmp_path):
    members, spare, promote = members_and_a_spare()
    save_all(members, ITER, tmp_path)
    flush([spare])
    parts = {p.node: p for p in MemIndex(etcd, run_keys).parts()}
    # The index names the ring holders only (the spare's copies are extra: restorable without them) ...
    assert {n: p.holders for n, p in parts.items()} == {"n0": ["n0", "n1"], "n1": ["n1", "n0"]}
    # ... and the spare holds a verified copy of every member's part.
    for origin, part in parts.items():
        held = spare.tier.node_dir.held_part(origin, ITER)
        assert sorted(p.name for p in held.iterdir()) == sorted(part.files)
    # A spare computes nothing for the job, though its name sorts first: n0, the first member, does.
    key = MemIndex(etcd, run_keys).restorable_key
    assert Restorable.from_json(etcd.get(key).value).iterations == [ITER]
    assert writers_of(etcd, key) == {"n0"}

    lose(members[1])
    promote()  # a0 takes n1's place (n1's rank)
    served = members[0].tier.served()
    spare.tier.set_members({"n0": "", "a0": ""})
    spare.start_workers({"n0", "a0"}, reached=ITER)
    candidate = next(c for c in plan_of(spare).candidates if c.iteration == ITER)
    assert candidate.ready and all(f.local for f in candidate.files.values()), candidate.files
    assert read_whole(spare, candidate, shard_name(1)) == (members[1].tier.node_dir.own_part(ITER) /
                                                          shard_name(1)).read_bytes()
    assert members[0].tier.served() == served  # not a byte of it from n0: 0 bytes over the network


def test_a_spare_without_room_refuses_its_copies_and_the_members_go_on(members_and_a_spare, etcd, run_keys,
                                                                       tmp_path):
    """A spare's copies stay within its own --eft-mem-ckpt-budget-gb (here 1 kB, less than one
    shard): it refuses them, and the members' iterations are restorable all the same."""
    members, spare, _ = members_and_a_spare(spare_budget_gb=1e-6)
    save_all(members, ITER, tmp_path)
    save_all(members, ITER + 1, tmp_path)  # a refused spare is not asked again for 30 s: one warning a member
    flush([spare])
    assert spare.tier.node_dir.held_parts() == {}
    key = MemIndex(etcd, run_keys).restorable_key
    assert Restorable.from_json(etcd.get(key).value).iterations == [ITER + 1, ITER]
