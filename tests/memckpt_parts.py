"""Helpers for the memory tier's tests: real MemoryTier instances on the session's etcd, and parts.

A "part" is what a node's workers would leave in ``own/g<n>/iter_K``: one ``__<rank>_0.distcp``
per rank (random bytes: nothing loads them here) and, on rank 0's node, a real DCP ``.metadata``
(written by ``torch.distributed.checkpoint.save`` in this one process, then pointed at every
rank's shard file, as a multi-rank save would have) beside ``common.pt`` and ``metadata.json``.
"""

from __future__ import annotations

import os
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from elasticft.config import MemoryConfig
from elasticft.contract.memory import DCP_METADATA
from elasticft.contract.run_dir import WorkerEnv
from elasticft.memckpt import MemoryTier
from elasticft.memckpt.placement import Spares

SHARD_BYTES = 4096


def shard_name(rank: int) -> str:
    return f"__{rank}_0.distcp"


def write_metadata(folder: Path, world: int, scratch: Path) -> None:
    """A real ``.metadata`` whose storage spans ``world`` ranks' shard files."""
    scratch.mkdir(parents=True, exist_ok=True)
    state = {f"w{r}": torch.full((4,), float(r)) for r in range(world)}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(str(scratch), thread_count=1), no_dist=True)
    with open(scratch / DCP_METADATA, "rb") as f:
        metadata = pickle.load(f)
    for index, info in list(metadata.storage_data.items()):
        rank = int(index.fqn[1:])
        metadata.storage_data[index] = type(info)(shard_name(rank), info.offset, info.length)
    with open(folder / DCP_METADATA, "wb") as f:
        pickle.dump(metadata, f)


@dataclass
class Node:
    node_id: str
    rank: int
    tier: MemoryTier
    run_dir: Path
    events: list[tuple[str, dict]] = field(default_factory=list)
    mem_dir: Path | None = None

    def start_workers(self, alive: set[str], reached: int | None = None) -> dict[str, str]:
        env = self.tier.prepare_start(alive, reached)
        self.mem_dir = Path(env[WorkerEnv.MEM_DIR])
        return env

    def save(self, iteration: int, world: int, scratch: Path) -> Path:
        """What this node's workers do for one snapshot, then the outbox message to the agent."""
        part = self.mem_dir / f"iter_{iteration:07d}"
        part.mkdir(parents=True)
        (part / shard_name(self.rank)).write_bytes(os.urandom(SHARD_BYTES))
        if self.rank == 0:
            write_metadata(part, world, scratch / f"dcp-{self.node_id}-{iteration}")
            (part / "common.pt").write_bytes(os.urandom(100))
            (part / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        self.tier.on_saved(iteration, str(part))
        return part

    def kinds(self, kind: str) -> list[dict]:
        return [fields for k, fields in self.events if k == kind]


def make_node(etcd, run_keys, tmp_path: Path, node_id: str, rank: int, *, replicas: int = 1,
              budget_gb: float = 1.0, label: str = "", timeout: float = 10.0, spares: Spares | None = None) -> Node:
    config = MemoryConfig(mem_ckpt_interval=1, mem_ckpt_replicas=replicas, mem_ckpt_budget_gb=budget_gb,
                          mem_ckpt_dir=str(tmp_path / "shm"), node_label=label)
    run_dir = tmp_path / "run" / node_id
    run_dir.mkdir(parents=True)
    events: list[tuple[str, dict]] = []
    tier = MemoryTier(config, node_id, "127.0.0.1", etcd, run_keys, run_dir,
                      lambda kind, **fields: events.append((kind, fields)), timeout=timeout)
    tier.spares = spares or tier.spares  # as the agent sets it: before start
    tier.start()
    return Node(node_id, rank, tier, run_dir, events)
