"""Membership changes on a real etcd: a node lost by kill -9, a node joining."""

import time

import pytest

from bench.launch import agent_of, generation, read_jsonl, wait_for
from elasticft.agent.events import EventLog
from elasticft.contract.events import EventKind

LEASE_TTL = 3.0


def agent(eft_job, nnodes: str, out, *flags):
    """One node of this test's job: one worker of allreduce_loop.py."""
    return eft_job("allreduce_loop.py", out, nodes=nnodes,
                   eft_flags=["--max-restarts", "0", "--eft-lease-ttl", LEASE_TTL, *flags])


@pytest.mark.seam
@pytest.mark.slow
def test_killed_node_is_replaced_by_a_smaller_world_within_lease_ttl(tmp_path, eft_job):
    starts = tmp_path / "starts.jsonl"
    nodes = [agent(eft_job, "2:3", tmp_path) for _ in range(3)]
    first = wait_for(lambda: generation(starts, 3), 120, "3 workers in a world of 3")
    # Kill the rank-0 node: it also hosts the workers' store, the hardest case.
    victim_pid = next(r["pid"] for r in first if r["group_rank"] == 0)
    victim = next(n for n in nodes if n.proc.pid == agent_of(victim_pid))
    killed_at = time.time()
    victim.kill_node()
    second = wait_for(lambda: generation(starts, 2, after=killed_at), 60, "the survivors at world size 2")
    # Running again: the new worker processes exist with the smaller WORLD_SIZE.
    recovery = max(r["started"] for r in second) - killed_at
    assert recovery <= LEASE_TTL + 5, f"survivors took {recovery:.1f} s"
    # --max-restarts 0: a membership change must not count as a restart.
    assert {r["sum"] for r in second} == {3.0}
    (tmp_path / "finish").touch()
    for node in nodes:
        if node is not victim:
            assert node.wait(60) == 0, node.output()


@pytest.mark.slow
def test_new_node_is_admitted_at_the_next_round(tmp_path, eft_job, etcd, run_keys):
    """--eft-join-at now: at once (at the next save: tests/test_join_at.py)."""
    starts = tmp_path / "starts.jsonl"
    nodes = [agent(eft_job, "2:4", tmp_path, "--eft-join-at", "now") for _ in range(3)]
    wait_for(lambda: generation(starts, 3), 120, "3 workers in a world of 3")
    joined_at = time.time()
    nodes.append(agent(eft_job, "2:4", tmp_path, "--eft-join-at", "now"))
    fourth = wait_for(lambda: generation(starts, 4, after=joined_at), 120, "a world of 4")
    assert {r["sum"] for r in fourth} == {10.0}
    assert len(read_jsonl(starts)) == 3 + 4
    assert not [e for e in EventLog(etcd, run_keys, "test").read() if e["kind"] == EventKind.JOIN_HELD]
    (tmp_path / "finish").touch()
    for node in nodes:
        assert node.wait(60) == 0, node.output()

