"""etcd going away is not a failure of the job: the workers train on, nobody is lost.

Two agents on a real etcd train the example loop; etcd is killed and started again on
the same port and data (a crash, an upgrade). The workers must never stop: one start of
the loop in the logs, no lost node, saves going on after etcd is back, each agent's
outage said in a few lines and recorded as one ``etcd_unavailable`` event.
"""

import json
import re
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


# 60 s down: the chaos table's "etcd down 60 s" row (tests/test_chaos.py), no restart allowed
@pytest.mark.parametrize("down", [5])
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


def workers(node: Launched) -> list:
    return [p for p in node.processes()[1:] if "minimal_train" in " ".join(p.cmdline())]


def starts(node: Launched) -> list[tuple[int, int]]:
    """(world size, first step) of every start of the workers this node's log shows."""
    return [(int(w), int(s)) for w, s in re.findall(r"world size (\d+), starting at step (\d+)", node.output())]


def test_a_worker_that_dies_while_etcd_is_away_restarts_when_etcd_is_back(tmp_path):
    with EmbeddedEtcd() as server:
        nodes = [Launched([*eft_run(), "--nnodes", "1:2", "--max-restarts", "3", "--rdzv-backend", "etcd-v3",
                           "--rdzv-endpoint", server.endpoint, "--rdzv-id", "outage", "--monitor-interval", "0.1",
                           str(LOOP), "--steps", "1000000", "--step-seconds", "0.05", "--save",
                           str(tmp_path / "ckpt")], tmp_path / f"node{i}.log") for i in range(2)]
        try:
            wait_for(lambda: any(saves(n) for n in nodes), 120, "the first save")
            server.kill()
            wait_for(lambda: all("is unreachable" in n.output() for n in nodes), 30, "both agents to miss etcd")
            committed = max(max(saves(n), default=0) for n in nodes)
            workers(nodes[1])[0].kill()  # the fault: a rank dies while etcd is away
            wait_for(lambda: all("waits for it, up to 600 s" in n.output() for n in nodes), 30,
                     "both agents to wait for etcd to restart their workers")
            server.restart()
            wait_for(lambda: len(sum((starts(n) for n in nodes), [])) >= 2, 90, "the workers to start again")
            logs = "".join(n.output() for n in nodes)
            assert all(n.proc.poll() is None for n in nodes), logs[-3000:]
            first, again = sum((starts(n) for n in nodes), [])
            assert first == (2, 0) and again[0] == 2 and again[1] >= committed, (first, again)
            # what the agents recorded while etcd was away was held, and written when it was back
            client = connect(StoreOptions(server.endpoint))
            events = [json.loads(kv.value) for kv in client.get_prefix(RunKeys("outage").events)[0]]
            client.close()
            restarts = [e for e in events if e["kind"] == EventKind.RESTART]
            assert {e["source"] for e in restarts} == {e["source"] for e in events if e["kind"] == "node_joined"}
        finally:
            for node in nodes:
                node.stop()


def test_a_rendezvous_waits_for_etcd_only_up_to_the_outage_limit(tmp_path):
    with EmbeddedEtcd() as server:
        node = Launched([*eft_run(), "--nnodes", "1", "--max-restarts", "3", "--eft-etcd-outage-limit", "2",
                         "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", server.endpoint, "--rdzv-id", "limit",
                         "--monitor-interval", "0.1", str(LOOP), "--steps", "1000000", "--step-seconds", "0.05",
                         "--save", str(tmp_path / "ckpt")], tmp_path / "node.log")
        try:
            wait_for(lambda: saves(node), 120, "the first save")
            server.kill()
            wait_for(lambda: "is unreachable" in node.output(), 30, "the agent to miss etcd")
            workers(node)[0].kill()
            assert node.wait(60) == 2, node.output()[-3000:]
            last = node.output().strip().splitlines()[-1]
            assert last.startswith("eft-run: error:") and "--eft-etcd-outage-limit" in last, last
            assert "Traceback" not in node.output()
        finally:
            node.stop()
