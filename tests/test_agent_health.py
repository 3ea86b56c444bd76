"""The health sampler inside a real eft-run agent: scores in etcd, under the node lease."""

import json
from pathlib import Path

import pytest

from bench.launch import wait_for

TRACE = Path(__file__).parent / "data" / "healthy.csv"


@pytest.mark.slow
def test_agent_publishes_scores_under_its_lease_and_they_vanish_with_it(tmp_path, etcd, run_keys, eft_job):
    node = eft_job("allreduce_loop.py", tmp_path, eft_flags=[
        "--eft-node-id", "node-a", "--eft-health-source", f"replay:{TRACE}", "--eft-health-interval", "0.5"])

    def all_gpus():
        records, _ = etcd.get_prefix(run_keys.health("node-a"))
        return records if len(records) == 8 else None

    records = wait_for(all_gpus, 60, "8 GPU health records")
    lease = etcd.get(run_keys.node("node-a")).lease
    assert {r.lease for r in records} == {lease} and lease != 0
    values = [json.loads(r.value) for r in records]
    assert sorted(v["gpu"] for v in values) == list(range(8))
    for value in values:
        assert value["node"] == "node-a"
        assert 0.0 <= value["score"] < 0.8 and not value["triggered"], value
    node.kill_node()
    wait_for(lambda: not etcd.get_prefix(run_keys.health("node-a"))[0], 10, "the records to expire with the lease")
