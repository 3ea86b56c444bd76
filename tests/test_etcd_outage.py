"""etcd going away is not a failure of the job: the workers train on, nobody is lost.

Two agents on a real etcd train the example loop; etcd is killed and started again on
the same port and data (a crash, an upgrade). The workers must never stop: one start of
the loop in the logs, no lost node, saves going on after etcd is back, each agent's
outage said in a few lines and recorded as one ``etcd_unavailable`` event.
"""

import json
import time

import pytest

from bench.launch import ROOT, Launched, eft_run, wait_for
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.store import EmbeddedEtcd, StoreOptions, connect

pytestmark = pytest.mark.slow

LOOP = ROOT / "examples" / "minimal_train.py"


def saves(node: Launched) -> list[int]:
    return [int(line.split()[1]) for line in node.output().splitlines() if line.startswith("step ")]


@pytest.mark.parametrize("down", [5, 60])
def test_the_workers_train_on_through_an_etcd_restart(tmp_path, down):
    with EmbeddedEtcd() as server:
        nodes = [Launched([*eft_run(), "--nnodes", "1:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint",
                           server.endpoint, "--rdzv-id", "outage", "--monitor-interval", "0.1", str(LOOP),
                           "--steps", "1000000", "--step-seconds", "0.05", "--save", str(tmp_path / "ckpt")],
                          tmp_path / f"node{i}.log") for i in range(2)]
        try:
            wait_for(lambda: any(saves(n) for n in nodes), 120, "the first save")
            server.kill()
            time.sleep(down)  # the fault: etcd away this long
            server.restart()
            wait_for(lambda: all("answers again after" in n.output() for n in nodes), 60,
                     "both agents to see etcd back")
            last = max(max(saves(n), default=0) for n in nodes)
            wait_for(lambda: max(max(saves(n), default=0) for n in nodes) >= last + 20, 60, "training to go on")
            logs = "".join(n.output() for n in nodes)
            assert all(n.proc.poll() is None for n in nodes), logs[-3000:]
            assert logs.count("starting at step") == 1, logs[-3000:]  # the workers never restarted
            assert "lost node" not in logs
            # said once when it went away, once when it came back (a line every 30 s between)
            assert all(n.output().count("is unreachable: eft waits for it") == 1 for n in nodes)
            assert all(n.output().count("could not") <= 2 for n in nodes), logs[-3000:]
            client = connect(StoreOptions(server.endpoint))
            events = [json.loads(kv.value) for kv in client.get_prefix(RunKeys("outage").events)[0]]
            client.close()
            outages = [e for e in events if e["kind"] == EventKind.ETCD_UNAVAILABLE]
            assert len(outages) == 2 and all(e["seconds"] >= down - 1 for e in outages), outages
        finally:
            for node in nodes:
                node.stop()
