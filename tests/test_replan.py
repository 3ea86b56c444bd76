"""Re-planning on restart: Megatron arguments rewritten for the GPUs that remain."""

import json
import time

import pytest

from bench.launch import agent_of, generation, read_jsonl, wait_for

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--global-batch-size", "8", "--micro-batch-size", "1"]


def flag(args: list[str], name: str) -> int:
    return int(args[args.index(name) + 1])


def layout_of(record: dict) -> tuple[int, int]:
    args = record["args"]
    return flag(args, "--tensor-model-parallel-size"), flag(args, "--pipeline-model-parallel-size")


@pytest.mark.slow
def test_survivor_restarts_with_a_layout_legal_for_two_gpus(tmp_path, etcd, run_keys, eft_job):
    starts = tmp_path / "starts.jsonl"
    nodes = [eft_job("allreduce_loop.py", tmp_path, *MODEL, "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2", nodes="1:2", nproc=2, eft_flags=["--max-restarts", "0"])
             for _ in range(2)]
    first = wait_for(lambda: generation(starts, 4), 120, "4 workers in a world of 4")
    # The user's TP is kept (no reshard needed); PP and DP follow the cost model.
    tp, pp = layout_of(first[0])
    assert {layout_of(r) for r in first} == {(tp, pp)} and tp == 2
    dp = 4 // (tp * pp)
    assert {tuple(r["layout"]) for r in first} == {(str(tp), str(pp), str(dp))}
    layout = json.loads(etcd.get(run_keys.layout).value)
    assert (layout["tp"], layout["pp"], layout["dp"], layout["used"]) == (tp, pp, dp, 4)

    victim = next(n for n in nodes if n.proc.pid != agent_of(next(r["pid"] for r in first if r["group_rank"] == 0)))
    killed_at = time.time()
    victim.kill_node()
    second = wait_for(lambda: generation(starts, 2, after=killed_at), 60, "the survivor at world size 2")
    tp, pp = layout_of(second[0])
    assert {layout_of(r) for r in second} == {(tp, pp)}
    assert 2 % (tp * pp) == 0 and 4 % tp == 0 and 4 % pp == 0
    # Keep the previous TP when it is still legal: fewer reshards.
    assert tp == 2
    layout = json.loads(etcd.get(run_keys.layout).value)
    assert (layout["tp"], layout["pp"], layout["tp"] * layout["pp"] * layout["dp"]) == (tp, pp, 2)
    assert layout["world_size"] == 2 and layout["spare"] == []
    (tmp_path / "finish").touch()
    survivor = next(n for n in nodes if n is not victim)
    assert survivor.wait(60) == 0, survivor.output()


def test_no_legal_layout_stops_the_agent_with_one_line(tmp_path, eft_job):
    # 3 GPUs for a model whose 4 heads and 4 layers need TP and PP in {1, 2, 4} and
    # a global batch of 8 that 3-way data parallelism cannot split.
    result = eft_job("allreduce_loop.py", tmp_path, *MODEL, nproc=3, eft_flags=["--eft-min-dp", "3"])
    assert result.wait(120) != 0
    lines = result.output().strip().splitlines()
    assert lines[-1].startswith("eft-run: error:") and "layout" in lines[-1], lines[-3:]
    assert not (tmp_path / "starts.jsonl").exists()


@pytest.mark.slow
def test_spare_ranks_get_no_worker(tmp_path, eft_job):
    # 3 GPUs: 4 heads and 4 layers allow TP and PP of 1, 2 or 4, and GBS 8 no DP of 3,
    # so the best layout uses 2 GPUs and local rank 2 sits out.
    node = eft_job("allreduce_loop.py", tmp_path, *MODEL, nproc=3)
    starts = wait_for(lambda: generation(tmp_path / "starts.jsonl", 2), 120, "2 workers in a world of 2")
    assert sorted(r["local_rank"] for r in starts) == [0, 1]
    assert "spare ranks [2]" in node.output()
    (tmp_path / "finish").touch()
    assert node.wait(60) == 0, node.output()
    assert len(read_jsonl(tmp_path / "starts.jsonl")) == 2


class CountingClient:
    """The test's real etcd client, counting the read requests the round's planners send."""

    def __init__(self, client):
        self._client, self.reads = client, 0

    def __getattr__(self, name):
        method = getattr(self._client, name)
        if name.startswith("get"):
            def counted(*args, **kwargs):
                self.reads += 1
                return method(*args, **kwargs)
            return counted
        return method


@pytest.mark.parametrize("nodes", [4, 16])
def test_a_round_s_planners_agree_in_reads_that_grow_as_the_nodes_not_their_square(etcd, nodes):
    """Every agent of a round plans from every node's GPU count; before, each read all N counts
    (N² reads a round, bench/restart_scale.py's replan phase); now rank 0 reads them once."""
    import threading
    import uuid
    from datetime import timedelta

    from elasticft.agent.replan import RoundPlanner
    from elasticft.config import PlannerConfig
    from elasticft.store.c10d_store import EtcdStore

    client = CountingClient(etcd)
    store = EtcdStore(client, f"/eft-test/{uuid.uuid4().hex}/c10d/", timeout=timedelta(seconds=60))
    gpus = [2] * (nodes - 1) + [1]  # the last node lost a GPU
    shares: dict[int, object] = {}

    def agent(rank: int) -> None:
        planner = RoundPlanner.for_worker(tuple(MODEL), PlannerConfig())
        shares[rank] = planner.assign(store, rank, nodes, gpus[rank])

    threads = [threading.Thread(target=agent, args=(rank,)) for rank in reversed(range(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(shares) == list(range(nodes))
    assert all(shares[r].plan == shares[0].plan for r in shares)  # one plan, agreed without talking further
    plan = shares[0].plan
    assert [shares[r].first_rank for r in range(nodes)] == [sum(plan.used_per_node[:r]) for r in range(nodes)]
    assert all(shares[r].local_workers <= gpus[r] for r in range(nodes))
    assert client.reads <= 3 * nodes  # a read or two a node (and a wait's re-read), not N a node
