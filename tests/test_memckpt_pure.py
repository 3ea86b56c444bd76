"""The memory tier's pure functions: replica placement and which iterations are complete."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticft.contract.memory import MemPart
from elasticft.memckpt.index import complete_iterations, memory_summary, restorable_iterations
from elasticft.memckpt.placement import replica_holders

node_ids = st.lists(st.text("abcdefgh0123456789", min_size=1, max_size=4), min_size=1, max_size=12, unique=True)


@st.composite
def memberships(draw):
    nodes = draw(node_ids)
    domains = draw(st.lists(st.sampled_from(["", "r1", "r2", "r3"]), min_size=len(nodes), max_size=len(nodes)))
    return dict(zip(nodes, domains)), draw(st.integers(0, 5))


@settings(max_examples=300, deadline=None)
@given(memberships())
def test_holders_are_others_distinct_and_as_many_as_can_be(case):
    domains, replicas = case
    for origin in domains:
        holders = replica_holders(origin, domains, replicas)
        assert origin not in holders
        assert len(set(holders)) == len(holders) == min(replicas, len(domains) - 1)
        assert replica_holders(origin, dict(reversed(domains.items())), replicas) == holders  # order-free


@settings(max_examples=300, deadline=None)
@given(memberships())
def test_other_failure_domains_come_first(case):
    domains, replicas = case
    for origin, mine in domains.items():
        if not mine:
            continue
        holders = replica_holders(origin, domains, replicas)
        elsewhere = [n for n in domains if domains[n] and domains[n] != mine]
        # Every holder in another known domain precedes every one that is not, and none was passed over.
        flags = [bool(domains[h]) and domains[h] != mine for h in holders]
        assert flags == sorted(flags, reverse=True)
        assert sum(flags) == min(len(elsewhere), len(holders))


@settings(max_examples=300, deadline=None)
@given(node_ids, st.integers(0, 5), st.sampled_from(["", "r1"]))
def test_without_a_domain_preference_every_node_holds_exactly_its_share(nodes, replicas, domain):
    """One domain (or none known): the ring gives each node exactly min(R, N-1) others to hold."""
    domains = {n: domain for n in nodes}
    load = Counter(h for origin in nodes for h in replica_holders(origin, domains, replicas))
    share = min(replicas, len(nodes) - 1)
    assert all(load[n] == share for n in nodes)


@settings(max_examples=300, deadline=None)
@given(memberships())
def test_with_domains_the_load_adds_up(case):
    """Domains may shift load (a small rack holds for a big one), but never past one part per other node."""
    domains, replicas = case
    load = Counter(h for origin in domains for h in replica_holders(origin, domains, replicas))
    assert sum(load.values()) == len(domains) * min(replicas, len(domains) - 1)
    assert all(v <= len(domains) - 1 for v in load.values())


def test_the_ring_starts_after_the_origin():
    domains = {n: "" for n in ("a", "b", "c", "d")}
    assert replica_holders("b", domains, 2) == ["c", "d"]
    assert replica_holders("d", domains, 2) == ["a", "b"]
    assert replica_holders("b", {**domains, "a": "x", "b": "y", "c": "y"}, 1) == ["a"]  # another rack first
    assert replica_holders("a", {"a": "x"}, 3) == []


def part(node, iteration, files, holders, needs=None, replicas=0):
    return MemPart(node, iteration, f"{node}:1", {f: [10, 1] for f in files}, list(holders),
                   {h: f"{h}:1" for h in holders}, replicas=replicas, needs=needs)


NEEDS = [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_complete_when_every_needed_file_has_an_alive_holder():
    parts = [part("a", 5, [".metadata", "__0_0.distcp"], ["a", "b"], NEEDS), part("b", 5, ["__1_0.distcp"], ["b", "a"])]
    (done,) = complete_iterations(parts, {"a", "b"})
    assert done.iteration == 5 and sorted(done.files) == sorted(NEEDS) and done.size == 30
    assert done.files["__1_0.distcp"].holders == [("b", "b:1"), ("a", "a:1")]
    (done,) = complete_iterations(parts, {"a"})  # b is gone; a holds its replica
    assert done.files["__1_0.distcp"].holders == [("a", "a:1")]
    assert complete_iterations(parts, {"c"}) == []


def test_incomplete_cases():
    rank0 = part("a", 5, [".metadata", "__0_0.distcp"], ["a"], NEEDS)
    assert complete_iterations([rank0], {"a", "b"}) == []  # b's part never published
    assert complete_iterations([rank0, part("b", 5, ["__1_0.distcp"], ["b"])], {"a"}) == []  # b and no replica
    no_needs = [part("a", 5, [".metadata", "__0_0.distcp"], ["a"]), part("b", 5, ["__1_0.distcp"], ["b"])]
    assert complete_iterations(no_needs, {"a", "b"}) == []  # nothing says what the whole is
    other_iteration = [rank0, part("b", 4, ["__1_0.distcp"], ["b"])]
    assert complete_iterations(other_iteration, {"a", "b"}) == []


def test_newest_first():
    parts = [part(n, k, [".metadata", "__0_0.distcp", "__1_0.distcp"], [n], NEEDS) for n, k in (("a", 4), ("a", 7))]
    assert [c.iteration for c in complete_iterations(parts, {"a"})] == [7, 4]


def test_a_share_lost_with_every_holder_is_named_and_an_unpublished_one_is_not():
    from elasticft.contract.memory import MemPart
    from elasticft.memckpt.index import lost_share

    def part(node, iteration, holders):
        return MemPart(node, iteration, "h:1", {f"__{node}_0.distcp": [1, 1]}, holders=holders)

    parts = [part("a", 12, ["a", "b"]), part("b", 12, ["b", "c"]), part("c", 12, ["c", "a"]),
             part("a", 13, ["a", "b"]), part("b", 13, ["b", "c"])]  # c died before publishing 13
    assert lost_share(parts, {"a", "b", "c"}, None) is None
    assert lost_share(parts, {"a"}, None) == (13, "b's share has no live copy (held by b, c)")
    assert lost_share(parts, {"a"}, 13) is None  # nothing newer than what can be restored
    assert lost_share(parts, {"b", "c"}, None) is None  # a's shares live on b


def test_restorable_when_complete_with_every_replica_in_place():
    def pair(k, a_holders, b_holders):
        return [part("a", k, [".metadata", "__0_0.distcp"], a_holders, NEEDS, replicas=1),
                part("b", k, ["__1_0.distcp"], b_holders, replicas=1)]

    parts = pair(5, ["a", "b"], ["b", "a"]) + pair(6, ["a", "b"], ["b"]) + pair(7, ["a"], ["b"])
    alive = {"a", "b"}
    assert [c.iteration for c in complete_iterations(parts, alive)] == [7, 6, 5]
    assert restorable_iterations(parts, alive) == [5]  # 6 and 7 still wait for a replica
    assert restorable_iterations(parts, {"a"}) == []  # b is gone: 5 is complete, but one replica short
    summary = memory_summary(parts, alive)
    assert (summary["iteration"], summary["newest_written"], summary["restorable"], summary["lag"]) == (7, 7, 5, 2)
    assert memory_summary(pair(7, ["a"], ["b"]), alive)["restorable"] is None
    assert memory_summary(pair(7, ["a"], ["b"]), alive)["lag"] == 1
    lone = [part("a", 3, NEEDS, ["a"], NEEDS)]  # a one-node job pushes to nobody: complete is restorable
    assert restorable_iterations(lone, {"a"}) == [3]


def test_the_list_of_every_file_stays_small_at_16k_ranks_and_comes_back_whole():
    from elasticft.contract.memory import NodeParts

    needs = sorted([f"__{r}_0.distcp" for r in range(16_384) if r != 77] + [".metadata", "common.pt",
                                                                             "metadata.json", "__5_1.distcp"])
    part = MemPart("n0", 3, "h:1", {".metadata": [10, 1]}, holders=["n0"], needs=needs)
    raw = NodeParts("n0", [part, dataclasses.replace(part, iteration=4)]).to_json()
    assert len(raw) < 2_000  # etcd takes requests up to 1.5 MB; the plain list alone is ~330 KB
    assert [p.needs for p in NodeParts.from_json(raw).parts] == [needs, needs]
    assert MemPart.from_json(json.dumps({**json.loads(part.to_json()), "needs": needs})).needs == needs  # a plain list
