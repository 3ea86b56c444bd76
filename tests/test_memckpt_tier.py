"""MemoryTier end to end: real tiers on the session's etcd, real HTTP on 127.0.0.1, real files.

Each node is a MemoryTier in this process with its own node directory; "losing" a node is
leaving it out of ``alive`` (its files stay, as a dead node's would be unreachable anyway:
we also close its server so nothing can read from it).
"""

from __future__ import annotations

import logging
import shutil
import socket
from pathlib import Path

import pytest

from bench.launch import wait_for
from elasticft.contract.events import EventKind
from elasticft.contract.memory import LAG_MARKER, PAUSE_MARKER, RESTORE_FILE, RestorePlan, Restorable
from elasticft.memckpt.index import MemIndex, restorable_iterations
from elasticft.worker.ranged_reads import CandidateReader, CorruptRange
from tests.memckpt_parts import SHARD_BYTES, make_node, shard_name

ITER = 5


@pytest.fixture
def cluster(etcd, run_keys, tmp_path):
    made = []

    def make(n: int, **kwargs):
        nodes = [make_node(etcd, run_keys, tmp_path, f"n{r}", r, **kwargs) for r in range(n)]
        for node in nodes:
            node.tier.set_members({m.node_id: "" for m in nodes})
            node.start_workers({m.node_id for m in nodes})
        made.extend(nodes)
        return nodes

    yield make
    for node in made:
        node.tier.close()


def save_all(nodes, iteration, tmp_path):
    for node in nodes:
        node.save(iteration, len(nodes), tmp_path)
    flush(nodes)
    # Every node learns what is restorable from one watched key, a moment after the last record
    # is written: wait until each has seen what the index says (a job's snapshots are far apart).
    etcd, keys = nodes[0].tier.client, nodes[0].tier.keys
    expected = restorable_iterations(MemIndex(etcd, keys).parts(), {n.node_id for n in nodes})
    if expected:
        wait_for(lambda: all(n.tier.restorable_seen == expected[0] for n in nodes), 10, "every node to see it")


def flush(nodes):
    for _ in range(2):  # origins' pushes first, then the holders' receipts they queued
        for node in nodes:
            assert node.tier.flush(30)


def lose(node):
    node.tier._server.close()  # a lost node answers nobody


def plan_of(node) -> RestorePlan:
    return RestorePlan.from_json((node.run_dir / RESTORE_FILE).read_text())


def test_each_part_is_published_with_its_replica_holder(cluster, etcd, run_keys, tmp_path):
    nodes = cluster(3)
    save_all(nodes, ITER, tmp_path)
    parts = {p.node: p for p in MemIndex(etcd, run_keys).parts()}
    assert {n: p.holders for n, p in parts.items()} == {"n0": ["n0", "n1"], "n1": ["n1", "n2"], "n2": ["n2", "n0"]}
    assert parts["n0"].needs == sorted([".metadata", "common.pt", "metadata.json", *map(shard_name, range(3))])
    for origin, holder in (("n0", "n1"), ("n1", "n2"), ("n2", "n0")):
        own = nodes[int(origin[1])].tier.node_dir.own_part(ITER)
        held = nodes[int(holder[1])].tier.node_dir.held_part(origin, ITER)
        assert sorted(p.name for p in held.iterdir()) == sorted(parts[origin].files)
        for name in parts[origin].files:
            assert (held / name).read_bytes() == (own / name).read_bytes()


def read_whole(node, candidate, name: str) -> bytes:
    """What a restarting rank of ``node`` reads of ``name`` when its load plan asks for all of it."""
    plan = plan_of(node)
    reader = CandidateReader(candidate, plan.run_id, plan.node, timeout=10)
    try:
        stream = reader.open(name, [(0, candidate.files[name].size)])
        with stream:
            return stream.read()
    finally:
        reader.close()


def test_a_lost_nodes_files_are_read_from_its_replica_and_only_the_checkpoint_wide_ones_move(cluster, tmp_path):
    nodes = cluster(3)
    save_all(nodes, ITER, tmp_path)
    lose(nodes[1])
    before = nodes[2].tier.served()
    nodes[0].start_workers({"n0", "n2"}, reached=ITER + 2)
    plan = plan_of(nodes[0])
    assert plan.reached == ITER + 2 and plan.generation == 2
    assert (plan.node, plan.run_id) == ("n0", nodes[0].tier.keys.run_id)
    (candidate,) = plan.candidates
    assert (candidate.iteration, candidate.ready) == (ITER, True)
    restored = Path(candidate.path)
    # The checkpoint-wide files are there (n0 wrote them); of the shard files only links of n0's copies:
    # its own and n2's replica. n1's is read from n2, its only other holder.
    assert sorted(p.name for p in restored.iterdir()) == sorted(
        [".metadata", "common.pt", "metadata.json", shard_name(0), shard_name(0) + ".chunks", shard_name(2),
         shard_name(2) + ".chunks"])
    files = candidate.files
    assert sorted(files) == [shard_name(r) for r in range(3)]
    assert [files[shard_name(r)].local for r in range(3)] == [True, False, True]
    assert files[shard_name(1)].holders == [["n2", nodes[2].tier.address]]
    assert nodes[2].tier.served() == before  # preparing moved no shard bytes
    for rank in range(3):
        original = nodes[rank].tier.node_dir.own_part(ITER) / shard_name(rank)
        assert read_whole(nodes[0], candidate, shard_name(rank)) == original.read_bytes()
    table = len((nodes[2].tier.node_dir.held_part("n1", ITER) / (shard_name(1) + ".chunks")).read_bytes())
    assert nodes[2].tier.served().get("n0", 0) - before.get("n0", 0) == SHARD_BYTES + table


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_range_is_refused_naming_the_file_and_range_and_a_good_copy_elsewhere_is_read(cluster, tmp_path):
    nodes = cluster(3)
    save_all(nodes, ITER, tmp_path)
    save_all(nodes, ITER + 1, tmp_path)
    flip_byte(nodes[0].tier.node_dir.held_part("n2", ITER + 1) / shard_name(2))  # n0's copy of n2's part
    lose(nodes[1])
    flip_byte(nodes[2].tier.node_dir.held_part("n1", ITER + 1) / shard_name(1))  # the only live copy of n1's
    nodes[0].start_workers({"n0", "n2"})
    newest, before = plan_of(nodes[0]).candidates  # shards are checked where they are read, not here
    assert [(c.iteration, c.ready) for c in (newest, before)] == [(ITER + 1, True), (ITER, True)]
    with pytest.raises(CorruptRange) as raised:
        read_whole(nodes[0], newest, shard_name(1))
    bad = raised.value
    assert (bad.file, bad.start, bad.end, bad.iteration) == (shard_name(1), 0, SHARD_BYTES, ITER + 1)
    assert "checksum mismatch" in bad.why and "n2" in bad.why
    # n0's own copy of n2's part is corrupt too, but n2 holds an intact one: read from it.
    original = nodes[2].tier.node_dir.own_part(ITER + 1) / shard_name(2)
    assert read_whole(nodes[0], newest, shard_name(2)) == original.read_bytes()
    assert read_whole(nodes[0], before, shard_name(1)) == (
        nodes[1].tier.node_dir.own_part(ITER) / shard_name(1)).read_bytes()


def test_a_checkpoint_wide_file_no_holder_delivers_intact_falls_back_to_the_iteration_before(cluster, tmp_path):
    nodes = cluster(3)
    save_all(nodes, ITER, tmp_path)
    save_all(nodes, ITER + 1, tmp_path)
    lose(nodes[1])  # the only other holder of n0's part, which holds .metadata
    flip_byte(nodes[0].tier.node_dir.own_part(ITER + 1) / ".metadata")
    nodes[0].start_workers({"n0", "n2"})
    newest, before = plan_of(nodes[0]).candidates
    assert (newest.iteration, newest.ready) == (ITER + 1, False)
    assert "checksum" in newest.why and ".metadata" in newest.why
    assert (before.iteration, before.ready) == (ITER, True)
    assert nodes[0].kinds(EventKind.MEM_CKPT_FALLBACK) == [
        {"iteration": ITER + 1, "why": newest.why, "then": f"iteration {ITER} from memory"}]

    flip_byte(nodes[0].tier.node_dir.own_part(ITER) / ".metadata")
    nodes[0].start_workers({"n0", "n2"})
    assert [c.ready for c in plan_of(nodes[0]).candidates] == [False, False]
    assert nodes[0].kinds(EventKind.MEM_CKPT_FALLBACK)[-1]["then"] == "the newest disk checkpoint"
    assert not any(nodes[0].tier.node_dir.restore.iterdir())  # nothing half-prepared is left


def test_a_copy_gone_from_the_only_node_that_holds_it_leaves_that_iteration_not_ready(cluster, tmp_path):
    nodes = cluster(3)
    save_all(nodes, ITER, tmp_path)
    lose(nodes[1])
    shutil.rmtree(nodes[2].tier.node_dir.held_part("n1", ITER))  # n2 held n1's only other copy
    nodes[2].start_workers({"n0", "n2"})
    (candidate,) = plan_of(nodes[2]).candidates
    assert not candidate.ready and shard_name(1) in candidate.why and "no other node holds one" in candidate.why


def test_an_origin_and_its_only_holder_gone_leave_no_candidate(cluster, tmp_path):
    nodes = cluster(3)
    save_all(nodes, ITER, tmp_path)
    lose(nodes[1])
    lose(nodes[2])  # n2 held n1's only replica
    assert nodes[0].tier.newest_complete({"n0"}) is None
    assert nodes[0].tier.newest_complete({"n0", "n2"}) == ITER
    nodes[0].start_workers({"n0"})
    assert plan_of(nodes[0]).candidates == []


def test_on_restored_drops_newer_parts_and_generations_increase(cluster, etcd, run_keys, tmp_path):
    nodes = cluster(2)
    save_all(nodes, ITER, tmp_path)
    save_all(nodes, ITER + 1, tmp_path)
    for node in nodes:
        node.start_workers({"n0", "n1"})
        assert node.mem_dir.name == "g2"
    for node in nodes:
        node.tier.on_restored(ITER, is_rank0_node=node.rank == 0)
    assert sorted((p.node, p.iteration) for p in MemIndex(etcd, run_keys).parts()) == [("n0", ITER), ("n1", ITER)]
    for node in nodes:
        assert ITER + 1 not in node.tier.node_dir.own_parts()
        assert all(ITER + 1 not in held for held in node.tier.node_dir.held_parts().values())
    nodes[0].tier.on_restored(None, is_rank0_node=True)
    assert MemIndex(etcd, run_keys).parts() == []
    assert nodes[0].start_workers({"n0", "n1"})  # and the next generation is g3
    assert nodes[0].mem_dir.name == "g3"


def test_a_part_larger_than_the_budget_pauses_once(cluster, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="elasticft.memckpt")
    (node,) = cluster(1, budget_gb=1e-6)  # 1000 bytes; a part is over 4 KB
    node.save(ITER, 1, tmp_path)
    node.save(ITER + 1, 1, tmp_path)
    flush([node])
    assert (node.run_dir / PAUSE_MARKER).exists()
    paused = [r.getMessage() for r in caplog.records if "paused" in r.getMessage()]
    assert len(paused) == 1 and "--eft-mem-ckpt-budget-gb" in paused[0]
    assert [e["paused"] for e in node.kinds(EventKind.MEM_CKPT_PAUSED)] == [True]
    assert len([r for r in caplog.records if "replica(s) asked for" in r.getMessage()]) == 1


def test_pruning_under_the_budget_goes_on(cluster, tmp_path):
    nodes = cluster(2, budget_gb=10e-6)  # 10 kB: n1's own part and n0's replica leave no room for another
    save_all(nodes, ITER, tmp_path)
    n1 = nodes[1]
    assert (n1.run_dir / PAUSE_MARKER).exists()
    n1.tier.on_restored(None, is_rank0_node=False)  # the workers went back to disk: every part goes
    assert not (n1.run_dir / PAUSE_MARKER).exists()
    assert [e["paused"] for e in n1.kinds(EventKind.MEM_CKPT_PAUSED)] == [True, False]


def test_while_a_part_waits_for_its_replica_the_workers_are_told_to_hold_the_next_snapshot(
        cluster, etcd, run_keys, tmp_path):
    """A peer that accepts the push and then says nothing (a stalled host): one save being
    pushed is the slack the workers get; a second one queued behind it raises the origin's
    lag marker until the pushes end (here: the peer drops the connection). Neither is dropped."""
    nodes = cluster(2)
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(4)
    etcd.put(run_keys.mem_server("n1"), "127.0.0.1:%d" % stalled.getsockname()[1])
    marker = nodes[0].run_dir / LAG_MARKER
    nodes[0].save(ITER, 2, tmp_path)
    connection, _ = stalled.accept()  # the push is under way, and will wait
    assert not marker.exists()
    nodes[0].save(ITER + 1, 2, tmp_path)
    assert marker.exists()
    connection.close()
    stalled.close()
    assert nodes[0].tier.flush(30) and not marker.exists()
    parts = sorted((p.iteration, p.holders) for p in MemIndex(etcd, run_keys).parts() if p.node == "n0")
    assert parts == [(ITER, ["n0"]), (ITER + 1, ["n0"])]  # both published; no copy claimed that does not exist


def lagging_pair(cluster, etcd, run_keys, tmp_path):
    """Two nodes; after ITER, n1's pushes to n0 are refused (its address points at a port that takes
    no connection), so none of n1's later parts has its replica and ITER stays the newest restorable
    iteration while three more snapshots are taken (one more than --eft-mem-ckpt-max-lag's 2)."""
    nodes = cluster(2)
    save_all(nodes, ITER, tmp_path)
    refusing = socket.socket()
    refusing.bind(("127.0.0.1", 0))  # bound, never listening: every connection is refused
    etcd.put(run_keys.mem_server("n0"), "127.0.0.1:%d" % refusing.getsockname()[1])
    for iteration in range(ITER + 1, ITER + 4):
        save_all(nodes, iteration, tmp_path)
    return nodes, refusing


def test_a_node_keeps_the_restorable_iteration_however_far_replication_lags(cluster, etcd, run_keys, tmp_path):
    (n0, n1), refusing = lagging_pair(cluster, etcd, run_keys, tmp_path)
    with refusing:
        assert ITER in n0.tier.node_dir.own_parts() and n0.tier.node_dir.held_part("n1", ITER).is_dir()
        for node in (n0, n1):  # over the most lag: the workers hold their snapshots, and an event says why
            assert (node.run_dir / LAG_MARKER).exists()
            assert node.kinds(EventKind.MEM_CKPT_LAG) == [
                {"lagging": True, "lag": 3, "newest": ITER + 3, "restorable": ITER, "max_lag": 2}]
        lose(n1)
        n0.start_workers({"n0"})  # n1's newer shares have no copy on n0: ITER, not nothing
        assert [(c.iteration, c.ready) for c in plan_of(n0).candidates] == [(ITER, True)]


def test_when_replication_catches_up_the_lag_ends_and_the_old_iteration_goes(cluster, etcd, run_keys, tmp_path):
    (n0, n1), refusing = lagging_pair(cluster, etcd, run_keys, tmp_path)
    refusing.close()
    etcd.put(run_keys.mem_server("n0"), n0.tier.address)  # n1 pushes again what n0 refused (while it lags)
    markers = [node.run_dir / LAG_MARKER for node in (n0, n1)]
    # The markers go once the lag is back under 2 (ITER + 1 restorable); caught up is ITER + 3 seen by both,
    # before the next snapshot's record is written (it lists what that node keeps at that moment).
    wait_for(lambda: not any(m.exists() for m in markers)
             and all(node.tier.restorable_seen == ITER + 3 for node in (n0, n1)), 30, "replication to catch up")
    save_all([n0, n1], ITER + 4, tmp_path)  # each node reads the index again after it, and prunes
    for node in (n0, n1):
        assert [e["lagging"] for e in node.kinds(EventKind.MEM_CKPT_LAG)] == [True, False]
    parts = {(p.node, p.iteration): p.holders for p in MemIndex(etcd, run_keys).parts()}
    assert parts[("n1", ITER + 3)] == ["n1", "n0"] and min(k for _, k in parts) >= ITER + 2
    assert min(n0.tier.node_dir.own_parts()) >= ITER + 2  # the two newest restorable, and newer
    assert min(n0.tier.node_dir.held_parts()["n1"]) >= ITER + 2


def test_a_snapshot_costs_etcd_one_write_per_node_and_one_for_the_job(cluster, etcd, run_keys, tmp_path):
    nodes = cluster(4)
    for iteration in (1, 2):  # two restorable iterations seen: pruning (and its writes) in steady state
        save_all(nodes, iteration, tmp_path)
    _, revision = etcd.get_range(run_keys.root, run_keys.root + "\xff")
    events = []
    cancel = etcd.watch_range(run_keys.root, run_keys.root + "\xff", events.extend, start_revision=revision + 1)
    try:
        for iteration in (3, 4, 5):
            save_all(nodes, iteration, tmp_path)
        spare = nodes[3].mem_dir / "iter_0000006"  # a node whose workers wrote nothing (data parallel)
        spare.mkdir()
        nodes[3].tier.on_saved(6, str(spare))
        flush(nodes)
        wait_for(lambda: restorable(etcd, run_keys)[:1] == [5], 30, "iteration 5 to be restorable")
        _, now = etcd.get_range(run_keys.root, run_keys.root + "\xff")
        wait_for(lambda: events and events[-1].revision >= now, 10, "the watch to catch up")
    finally:
        cancel()
    writes: dict[str, int] = {}
    for event in events:
        writes[event.key] = writes.get(event.key, 0) + 1
    index = MemIndex(etcd, run_keys)
    assert writes == {**{index.key(n.node_id): 3 for n in nodes}, run_keys.mem_restorable: 3}, writes
    # What each node keeps stays bounded: the two newest restorable iterations. Its record drops the
    # one it pruned last at its next write (that would be iteration 6's).
    wait_for(lambda: all(sorted(n.tier.node_dir.own_parts())[:2] == [4, 5] for n in nodes), 10, "the nodes to prune")
    assert sorted({p.iteration for p in index.parts()}) == [3, 4, 5]


def restorable(etcd, run_keys) -> list[int]:
    found = etcd.get(run_keys.mem_restorable)
    return Restorable.from_json(found.value).iterations if found else []


def test_a_lost_nodes_record_goes_once_nothing_in_it_can_be_restored(cluster, etcd, run_keys, tmp_path):
    nodes = cluster(3)
    for iteration in (1, 2):
        save_all(nodes, iteration, tmp_path)
    index = MemIndex(etcd, run_keys)
    lose(nodes[2])
    survivors = nodes[:2]
    for node in survivors:
        node.tier.set_members({"n0": "", "n1": ""})
    save_all(survivors, 3, tmp_path)
    assert etcd.get(index.key("n2")) is not None  # its replicas of 1 and 2 may still be what a restore needs
    save_all(survivors, 4, tmp_path)
    wait_for(lambda: restorable(etcd, run_keys) == [4, 3], 10, "iterations 4 and 3 to be restorable")
    wait_for(lambda: etcd.get(index.key("n2")) is None, 10, "the lost node's record to go")
    assert etcd.get(index.key("n0")) is not None and etcd.get(index.key("n1")) is not None
