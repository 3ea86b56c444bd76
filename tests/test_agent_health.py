"""The health sampler inside a real eft-run agent: scores in etcd, under the node lease."""

import json
import uuid
from pathlib import Path

import pytest

from bench.launch import WORKERS, Launched, eft_run, wait_for
from elasticft.store import RunKeys

TRACE = Path(__file__).parent / "data" / "healthy.csv"


@pytest.mark.slow
def test_agent_publishes_scores_under_its_lease_and_they_vanish_with_it(tmp_path, etcd_server, etcd):
    run_id = uuid.uuid4().hex
    keys = RunKeys(run_id)
    node = Launched(
        [*eft_run(), "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
         "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id, "--eft-node-id", "node-a",
         "--eft-health-source", f"replay:{TRACE}", "--eft-health-interval", "0.5",
         str(WORKERS / "allreduce_loop.py"), str(tmp_path)],
        tmp_path / "node.log",
    )
    try:
        def all_gpus():
            records, _ = etcd.get_prefix(keys.health("node-a"))
            return records if len(records) == 8 else None

        records = wait_for(all_gpus, 60, "8 GPU health records")
        lease = etcd.get(keys.node("node-a")).lease
        assert {r.lease for r in records} == {lease} and lease != 0
        values = [json.loads(r.value) for r in records]
        assert sorted(v["gpu"] for v in values) == list(range(8))
        for value in values:
            assert value["node"] == "node-a"
            assert 0.0 <= value["score"] < 0.95 and not value["triggered"], value
        node.kill_node()
        wait_for(lambda: not etcd.get_prefix(keys.health("node-a"))[0], 10, "the records to expire with the lease")
    finally:
        node.stop()
