"""A run's etcd records written the way eft's agents write them, through their own code.

Node records under leases (``NodeLease``), health through the risk model and
``EtcdHealthPublisher``, layouts from the planner and ``layout_record``, the
checkpoint protocol and the event log: ``eft top`` tests read what agents write.
"""

from __future__ import annotations

import time

from elasticft.agent.checkpoints import CheckpointCoordinator
from elasticft.agent.ckpt_protocol import CheckpointProtocol
from elasticft.agent.events import EventLog
from elasticft.config import RiskConfig
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord, layout_record
from elasticft.health import EtcdHealthPublisher, GpuSample, RiskModel, RiskScore
from elasticft.planner.layout import BatchFacts, ModelFacts, plan
from elasticft.rendezvous.membership import NodeLease
from elasticft.store import EtcdClient

MODEL = ModelFacts(num_layers=8, num_attention_heads=8, hidden_size=512, seq_length=128)
BATCH = BatchFacts(global_batch_size=64, micro_batch_size=1)
GIB = 1024.0


def gpu_sample(node: str, gpu: int, timestamp: float, *, temperature: float = 55.0, memory: float = 0.5,
               xids: tuple[int, ...] = (), only_temperature: bool = False) -> GpuSample:
    """A busy GPU at ``temperature`` with ``memory`` of its 80 GiB in use."""
    if only_temperature:  # a GPU that reports nothing else: temperature alone sets its risk
        return GpuSample(timestamp, node, gpu, temperature_c=temperature)
    return GpuSample(
        timestamp, node, gpu, uuid=f"GPU-{node}-{gpu}", temperature_c=temperature,
        memory_used_mib=memory * 80 * GIB, memory_total_mib=80 * GIB, power_w=300.0, power_limit_w=400.0,
        utilization_pct=95.0, ecc_corrected=3, ecc_uncorrected=0, xids=xids,
    )


class RunWriter:
    def __init__(self, client: EtcdClient, keys: RunKeys):
        self.client = client
        self.keys = keys
        self.leases: dict[str, NodeLease] = {}
        self.models: dict[str, RiskModel] = {}
        self.restarts = 0

    def start(self) -> float:
        """The run's start time, as the first agent writes it."""
        return CheckpointCoordinator._job_start_time(self.client, self.keys)

    def join(self, node_id: str, gpus: int, ttl: float = 30.0) -> NodeLease:
        record = NodeRecord(node_id=node_id, host=f"host-{node_id}", rdzv_addr=f"host-{node_id}", pid=1000,
                            gpus=list(range(gpus)))
        lease = self.leases[node_id] = NodeLease(self.client, self.keys, record, ttl)
        EventLog(self.client, self.keys, node_id).record(EventKind.NODE_JOINED, host=record.host, gpus=gpus)
        return lease

    def publish(self, node_id: str, samples: list[GpuSample]) -> list[RiskScore]:
        """One sampler round: score the samples with the node's model, publish under its lease."""
        scores = self.models.setdefault(node_id, RiskModel(RiskConfig())).update(samples)
        EtcdHealthPublisher(self.client, self.keys, node_id, self.leases[node_id].lease)(list(zip(samples, scores)))
        return scores

    def layout(self, gpus_per_node: list[int], rank0: str, round_id: int = 1):
        """The rendezvous leader's plan for the round, and its event."""
        chosen = plan(MODEL, BATCH, gpus_per_node)
        self.client.put(self.keys.layout, layout_record(chosen, round_id))
        EventLog(self.client, self.keys, rank0).record(
            EventKind.LAYOUT, tp=chosen.tp, pp=chosen.pp, dp=chosen.dp, used=chosen.used,
            world_size=chosen.world, spare=chosen.spare,
        )
        return chosen

    def lose(self, node_id: str, *survivors: str) -> None:
        """The node dies: its lease goes without a clean exit; survivors log the loss."""
        self.leases.pop(node_id).close(clean=False)
        self.restarts += 1
        for survivor in survivors:
            EventLog(self.client, self.keys, survivor).record(EventKind.NODE_LOST, nodes=[node_id], restarts=self.restarts)

    def leave(self, node_id: str) -> None:
        self.leases.pop(node_id).close(clean=True)

    def checkpoints(self, source: str) -> CheckpointProtocol:
        return CheckpointProtocol(self.client, self.keys, source)

    def close(self) -> None:
        for lease in list(self.leases.values()):
            lease.close(clean=True)
        self.leases.clear()


def two_nodes(run: RunWriter, layout: bool = True) -> dict:
    """node-a (4 quiet GPUs), node-b: gpu3 with a critical Xid, gpu1 above its slowdown temperature."""
    run.join("node-a", 4)
    run.join("node-b", 4)
    if layout:
        run.layout([4, 4], "node-a")
    t = time.time()
    scores = {}
    for node in ("node-a", "node-b"):
        samples = [gpu_sample(node, g, t, temperature=50 + g) for g in range(4)]
        if node == "node-b":
            samples[1] = gpu_sample(node, 1, t, temperature=88, only_temperature=True)
            samples[3] = gpu_sample(node, 3, t, temperature=70, xids=(79,))
        scores.update({(s.node, s.gpu): round(s.score, 2) for s in run.publish(node, samples)})
    return scores


def many_gpus(run: RunWriter) -> dict:
    """Three nodes of 8 GPUs; one GPU per node at 80-82 C reporting nothing else (risk about 0.5)."""
    t = time.time()
    scores = {}
    for n in range(3):
        node = f"node-{n}"
        run.join(node, 8)
        samples = [gpu_sample(node, g, t, temperature=50 + g) for g in range(8)]
        samples[n + 2] = gpu_sample(node, n + 2, t, temperature=80 + n, only_temperature=True)
        scores.update({(s.node, s.gpu): round(s.score, 2) for s in run.publish(node, samples)})
    run.layout([8, 8, 8], "node-0")
    return scores
