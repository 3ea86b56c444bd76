"""A restart reads the memory index once for the job, not once per node (issue 53).

Every agent prepares its restore candidates at a restart from the iterations the live nodes
complete, which takes every node's record (``mem/parts/<node>``). Before, each agent read them
all: N² keys a restart. Now the first live node reads them and shares what the restart needs
in ``mem/plan``; every other agent reads that key and one key's name (``memckpt/plan.py``).
N real memory tiers on one etcd (``bench/mem_nodes.py``), restarting together after a snapshot;
the keys each one's etcd client read are counted.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from bench.mem_nodes import Nodes
from bench.mem_plan_reads import counted
from elasticft.contract.memory import RESTORE_FILE, RestorePlan

pytestmark = pytest.mark.timeout(240)


def restart(n: int, tmp_path) -> tuple[list[int], list[RestorePlan]]:
    with Nodes(n, tmp_path / f"nodes-{n}", part_bytes=4096) as nodes:
        nodes.snapshot(1)
        reads = [0] * n
        for i, client in enumerate(nodes.clients):
            counted(client, reads, i)
        with ThreadPoolExecutor(n) as pool:  # every agent at once, as after a rendezvous
            list(pool.map(lambda tier: tier.prepare_start(set(nodes.names), None), nodes.tiers))
        plans = [RestorePlan.from_json((tier.run_dir / RESTORE_FILE).read_text()) for tier in nodes.tiers]
        return reads, plans


def test_a_restart_reads_the_memory_index_once_for_the_job_not_once_per_node(tmp_path):
    for n in (4, 16):
        reads, plans = restart(n, tmp_path)
        for plan in plans:  # every node still prepares the snapshot, from the one shared read
            assert plan.candidates and plan.candidates[0].ready and plan.candidates[0].iteration == 1, plan
        # the planner: the n records; every other node: the plan and the index's newest change
        assert sum(reads) <= n + 2 * (n - 1), (n, reads)


def test_with_the_rounds_revision_no_agent_asks_etcd_for_the_index_newest_change(tmp_path):
    """Given the revision the round counted its members at (eft's rendezvous knows it), a node takes
    the plan read since then as this restart's: one key read, not also ``last_modified``, which etcd
    answers by visiting every node's key (N² visits a restart). A plan of an earlier restart for the
    same nodes, read before that revision, is still refused: the node waits for this restart's."""
    n = 6
    with Nodes(n, tmp_path / "nodes", part_bytes=4096) as nodes:
        nodes.snapshot(1)
        client = nodes.clients[0]
        with ThreadPoolExecutor(n) as pool:  # a first restart: its plan stays in mem/plan
            list(pool.map(lambda tier: tier.prepare_start(set(nodes.names), None), nodes.tiers))
        nodes.snapshot(2)
        since = client.revision()  # this restart's round, counted after the newer snapshot
        asked = []
        for c in nodes.clients:
            c.last_modified = lambda prefix, asked=asked: asked.append(prefix)
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda tier: tier.prepare_start(set(nodes.names), None, since), nodes.tiers))
        plans = [RestorePlan.from_json((tier.run_dir / RESTORE_FILE).read_text()) for tier in nodes.tiers]
    assert asked == []
    for plan in plans:  # the earlier restart's plan (iteration 1 newest) was not taken
        assert plan.candidates and plan.candidates[0].ready and plan.candidates[0].iteration == 2, plan
