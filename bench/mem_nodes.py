"""N memory-tier agents without workers, in one process, on one embedded etcd: the scale benches' nodes.

Each node is a real ``MemoryTier`` (its own etcd client, shard server on 127.0.0.1, node
directory, replicator thread); its "workers" leave a synthetic part per snapshot: one shard file
``__<rank>_0.distcp`` of random bytes and, on rank 0's node, a real DCP ``.metadata`` whose
storage items are given by the caller (``items``: fqn -> (rank, offset, length)) beside
``common.pt`` and ``metadata.json``. Used by ``mem_index_scale.py`` (etcd load per snapshot)
and ``mem_restore_scale.py`` (bytes and time of a restore at a new layout); the first also
runs it on the previous design's tree, so it uses only what both trees have.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


BASELINE_REV = "792bca3"  # the last tree with one etcd key per part and whole-checkpoint assembly (issue 33)


def parse_with_baseline(parser) -> object:
    """The flags both scale benches take for their baseline run; the previous tree imported where asked."""
    parser.add_argument("--baseline-rev", default=BASELINE_REV, help="git revision of the previous design")
    parser.add_argument("--no-baseline", action="store_true", help="measure this tree only")
    parser.add_argument("--json", action="store_true", help="print this tree's figures as one JSON line")
    parser.add_argument("--tree", help="import elasticft from this directory (the baseline's run)")
    args = parser.parse_args()
    if args.tree:
        sys.path.insert(0, args.tree)
    return args


def on_previous_tree(script: str, rev: str, argv: list[str]) -> list[dict]:
    """``script --json --tree T *argv`` with T the ``elasticft`` of git revision ``rev`` (the previous
    design, measured in the same run): the figures it prints as its last line."""
    with tempfile.TemporaryDirectory(prefix="eft-baseline-") as tree:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "elasticft"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        out = subprocess.run([sys.executable, script, *argv, "--json", "--tree", tree],
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_metadata(folder: Path, items: dict[str, tuple[int, int, int]], scratch: Path) -> None:
    """A real ``.metadata``: one 1-D uint8 tensor per fqn, stored at (rank's file, offset, length)."""
    import torch
    import torch.distributed.checkpoint as dcp

    scratch.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({fqn: torch.zeros(length, dtype=torch.uint8) for fqn, (_, _, length) in items.items()},
                 storage_writer=dcp.FileSystemWriter(str(scratch), thread_count=1), no_dist=True)
    metadata = pickle.loads((scratch / ".metadata").read_bytes())
    for index, info in list(metadata.storage_data.items()):
        rank, offset, length = items[index.fqn]
        metadata.storage_data[index] = type(info)(f"__{rank}_0.distcp", offset, length)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


class Nodes:
    """``count`` tiers on one embedded etcd (``with Nodes(...) as nodes:``)."""

    def __init__(self, count: int, work: Path, replicas: int = 1, part_bytes: int = 64 << 10):
        self.count = count
        self.work = Path(work)
        self.replicas = replicas
        self.part_bytes = part_bytes
        self.names = [f"n{i:04d}" for i in range(count)]

    def __enter__(self) -> Nodes:
        from elasticft.config import MemoryConfig
        from elasticft.contract.keys import RunKeys
        from elasticft.contract.run_dir import WorkerEnv
        from elasticft.memckpt import MemoryTier
        from elasticft.store import EmbeddedEtcd, StoreOptions, connect

        self.keys = RunKeys(uuid.uuid4().hex)
        self.server = EmbeddedEtcd().__enter__()
        self.clients, self.tiers, self.dirs = [], [], []
        for name in self.names:
            client = connect(StoreOptions(self.server.endpoint))
            config = MemoryConfig(mem_ckpt_interval=1, mem_ckpt_replicas=self.replicas, mem_ckpt_budget_gb=64.0,
                                  mem_ckpt_dir=str(self.work / "shm"))
            run_dir = self.work / "run" / name
            run_dir.mkdir(parents=True)
            tier = MemoryTier(config, name, "127.0.0.1", client, self.keys, run_dir, lambda *a, **k: None,
                              timeout=60.0)
            tier.start()
            self.clients.append(client)
            self.tiers.append(tier)
        self.env = WorkerEnv
        for tier in self.tiers:
            tier.set_members({name: "" for name in self.names})
        self.start_workers()
        return self

    def start_workers(self) -> list[Path]:
        """Every agent's ``prepare_start`` (a restart): the workers' write directories, per node."""
        self.dirs = [Path(tier.prepare_start(set(self.names), None)[self.env.MEM_DIR.value]) for tier in self.tiers]
        return self.dirs

    def snapshot(self, iteration: int, items: dict[str, tuple[int, int, int]] | None = None) -> float:
        """Every node's workers write a part of ``iteration``; returns the seconds until every agent is done."""
        items = items or {f"w{r}": (r, 0, self.part_bytes) for r in range(self.count)}
        began = time.perf_counter()
        for rank, (tier, folder) in enumerate(zip(self.tiers, self.dirs)):
            part = folder / f"iter_{iteration:07d}"
            part.mkdir(parents=True)
            (part / f"__{rank}_0.distcp").write_bytes(os.urandom(self.part_bytes))
            if rank == 0:
                write_metadata(part, items, self.work / f"dcp-{iteration}")
                (part / "common.pt").write_bytes(b"\0" * 100)
                (part / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
            tier.on_saved(iteration, str(part))
        for _ in range(2):  # the origins' pushes, then the holders' receipts
            for tier in self.tiers:
                tier.flush(600)
        return time.perf_counter() - began

    def __exit__(self, *exc) -> None:
        for tier in self.tiers:
            tier.close()
        for client in self.clients:
            client.close()
        self.server.__exit__(*exc)
