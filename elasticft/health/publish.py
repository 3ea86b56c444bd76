"""Publishing each GPU's last sample and risk to etcd, under the node's lease.

The record lives at ``/eft/<run>/health/<node>/<gpu>`` and vanishes with the lease
when the node dies or leaves; ``eft top`` reads it. docs/health.md shows a record.
"""

from __future__ import annotations

import json

from elasticft.contract.keys import RunKeys
from elasticft.health.risk import RiskScore
from elasticft.health.sample import GpuSample
from elasticft.store import EtcdClient, Lease


def health_record(sample: GpuSample, score: RiskScore) -> dict:
    """The JSON-ready record of one GPU: who, when, the risk, and the raw sample."""
    record = {"node": sample.node, "gpu": sample.gpu, "timestamp": sample.timestamp}
    record.update(score.to_dict())
    sample_data = sample.to_dict()
    record["time"] = sample_data.pop("time")
    for key in ("node", "gpu", "timestamp"):
        sample_data.pop(key)
    record["sample"] = sample_data
    return record


class EtcdHealthPublisher:
    """``publish(records)`` for HealthSampler: one put per GPU, under ``lease``."""

    def __init__(self, client: EtcdClient, keys: RunKeys, node_id: str, lease: Lease | None):
        self.client = client
        self.keys = keys
        self.node_id = node_id
        self.lease = lease

    def __call__(self, records: list[tuple[GpuSample, RiskScore]]) -> None:
        for sample, score in records:
            record = health_record(sample, score)
            record["node"] = self.node_id
            self.client.put(
                self.keys.health(self.node_id, sample.gpu),
                json.dumps(record, separators=(",", ":")),
                lease=self.lease,
            )

    def clear(self) -> None:
        """Remove this node's records now (a clean shutdown need not wait for the lease)."""
        self.client.delete_prefix(self.keys.health(self.node_id))
