"""bench/mem_ckpt.py's replication over HTTP: node A's part pushed to node B's shard server
(the replica), later read back from B: fetched whole into a restore dir, or named to the
ranks, who read their byte ranges during the load (``elasticft.worker.ranged_reads``)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

from elasticft.contract.memory import CHUNKS_SUFFIX, RangedFile, RestoreCandidate, is_shard_file
from elasticft.memckpt import transfer
from elasticft.memckpt.chunks import checksum_part
from elasticft.memckpt.node_dir import NodeDir, iter_name
from elasticft.memckpt.server import ShardServer


class Replication:
    """Node A's part pushed to node B's shard server (the replica), later read back from B:
    transfer.push / fetch, ShardServer, and the ranks' ranged reads."""

    RUN = "bench-run"

    def __init__(self, root: Path, iteration: int):
        self.iteration = iteration
        self.a, self.b = NodeDir(root / "node-a"), NodeDir(root / "node-b")
        self.a.create()
        self.b.create()
        self.part = self.a.new_generation()[1] / iter_name(iteration)
        self.server = ShardServer(self.b, "node-b", self.RUN, "127.0.0.1").start()
        self.crcs: dict[str, list[int]] = {}

    def checksum(self) -> None:
        self.crcs = checksum_part(self.part)  # and the chunk tables

    def push(self) -> None:
        for name, (_, crc) in self.crcs.items():
            transfer.push(self.server.address, self.RUN, "node-a", self.iteration, self.part / name, crc)

    def drop_replica(self) -> None:
        shutil.rmtree(self.b.held_part("node-a", self.iteration), ignore_errors=True)

    def fetch(self, dest: Path, ranged: bool = False) -> str:
        """Every file into ``dest``, or (``ranged``) the checkpoint-wide ones: the candidate, as JSON."""
        holders = [["node-b", self.server.address]]
        files = {n: RangedFile(n, "node-a", *c, holders=holders, chunks=self.crcs.get(n + CHUNKS_SUFFIX))
                 for n, c in self.crcs.items() if is_shard_file(n)}
        for name, (_, crc) in self.crcs.items():
            if not name.endswith(CHUNKS_SUFFIX) and not (ranged and name in files):
                transfer.fetch(self.server.address, self.RUN, "node-a", self.iteration, name, dest / name, crc)
        return json.dumps(asdict(RestoreCandidate(self.iteration, str(dest), True, files=files if ranged else {})))
