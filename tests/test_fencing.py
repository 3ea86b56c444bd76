"""A node the job went on without stops its workers and rejoins, instead of exiting.

Two agents train the example loop (``--nnodes 1:2``); one is frozen whole (agent and
workers, SIGSTOP) for longer than its lease TTL, as a kernel stall or a paused VM does.
The other must go on alone; the frozen one, once thawed, must find that etcd let its
lease expire, kill its workers (they belong to a round that is over: fenced off), register
again under the same node id and rejoin, so that the job is back at world size 2, resumed
from no earlier than the last checkpoint committed before the freeze.
"""

import json
import re
import signal
import time

import pytest

from bench.launch import ROOT, Launched, eft_run, wait_for
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.store import EmbeddedEtcd, StoreOptions, connect

pytestmark = pytest.mark.slow

LOOP = ROOT / "examples" / "minimal_train.py"
FROZEN = 10.0  # seconds: over three lease TTLs (3 s)


def starts(logs: str) -> list[tuple[int, int]]:
    """(world size, first step) of every start of the workers."""
    return [(int(w), int(s)) for w, s in re.findall(r"world size (\d+), starting at step (\d+)", logs)]


def saved(node: Launched) -> list[int]:
    return [int(n) for n in re.findall(r"checkpoint of iteration (\d+) complete", node.output())]


def test_a_frozen_node_is_fenced_off_and_rejoins(tmp_path):
    with EmbeddedEtcd() as server:
        nodes = [Launched([*eft_run(), "--nnodes", "1:2", "--rdzv-backend", "etcd-v3", "--rdzv-endpoint",
                           server.endpoint, "--rdzv-id", "frozen", "--monitor-interval", "0.1", str(LOOP),
                           "--steps", "1000000", "--step-seconds", "0.05", "--save", str(tmp_path / "ckpt")],
                          tmp_path / f"node{i}.log") for i in range(2)]
        survivor, frozen = nodes
        try:
            wait_for(lambda: saved(survivor) or saved(frozen), 120, "the first save")
            frozen.signal_node(signal.SIGSTOP)
            frozen_at = time.monotonic()
            committed = max(saved(survivor) + saved(frozen))
            wait_for(lambda: any(world == 1 for world, _ in starts(survivor.output())), 60,
                     "the survivor to go on alone")
            before = len(starts(survivor.output()))
            time.sleep(max(0.0, frozen_at + FROZEN - time.monotonic()))  # the fault: frozen this long
            frozen.signal_node(signal.SIGCONT)
            wait_for(lambda: "fenced off" in frozen.output(), 30, "the thawed node to find itself fenced off")
            wait_for(lambda: len(starts(survivor.output())) > before, 60, "a new round with the thawed node")
            logs = survivor.output() + frozen.output()
            assert all(node.proc.poll() is None for node in nodes), logs[-3000:]
            alone, together = starts(survivor.output())[-2:]
            assert alone[0] == 1 and alone[1] >= committed, starts(logs)  # nothing committed was lost
            assert together[0] == 2 and together[1] >= alone[1], starts(logs)
            assert "registered again after" in frozen.output()
            assert "rendezvous was closed" not in logs
            client = connect(StoreOptions(server.endpoint))
            events = [json.loads(kv.value) for kv in client.get_prefix(RunKeys("frozen").events)[0]]
            nodes_now = client.get_prefix(RunKeys("frozen").nodes)[0]
            client.close()
            fenced = [e for e in events if e["kind"] == EventKind.NODE_FENCED]
            assert len(fenced) == 1 and fenced[0]["silent"] >= FROZEN - 1, fenced
            assert len(nodes_now) == 2  # the thawed node is a member again, under the same id
        finally:
            for node in nodes:
                node.stop()
