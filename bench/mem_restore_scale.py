"""A memory-tier restore at a new layout on N nodes: bytes each node moves against its share, and time.

N real ``MemoryTier`` agents without workers (``mem_nodes.Nodes``: one process, one embedded
etcd, shard servers on 127.0.0.1, node directories on tmpfs), one replica each. Each node's part
of a snapshot is one shard file of ``--part-mb`` holding two storage items (its halves). The
restart moves every item by half a shard, as a change of tensor-parallel layout does: node i's
new ranks need the second half of shard i and the first half of shard i+1, so its share is one
shard, half of it already local. Each node restarts in turn, alone on this machine's
cores (on a cluster each has its own): its agent prepares its candidates (``prepare_start``: the
index read, the global files), then its ranks read their items through
``worker.ranged_reads.CandidateReader``, as torch's reader does during a load.

Printed per N: bytes each node received (the shard servers' counts) against its share and
against what it needs from other nodes; the slowest node's restore time; etcd writes per
snapshot per node (``mem_index_scale.py`` has the detail). The baseline is the previous design
(every agent assembles the whole checkpoint before its workers start), the same bench run on the
tree of ``--baseline-rev`` in a subprocess: what it moves is every file it does not hold.

    python bench/mem_restore_scale.py [--nodes 4,16,64] [--part-mb 4] [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402  (also puts the repo on sys.path)
from mem_index_scale import metrics, settle  # noqa: E402
from mem_nodes import Nodes, on_previous_tree, parse_with_baseline  # noqa: E402

MB = 1 << 20


def new_layout(n: int, size: int) -> dict[int, list[tuple[str, int, int]]]:
    """node -> the (file, offset, length) its new ranks read: shard i's second half, shard i+1's first."""
    half = size // 2
    return {i: [(f"__{i}_0.distcp", half, size - half), (f"__{(i + 1) % n}_0.distcp", 0, half)] for i in range(n)}


def items_of(n: int, size: int) -> dict[str, tuple[int, int, int]]:
    half = size // 2
    return {**{f"a{r}": (r, 0, half) for r in range(n)}, **{f"b{r}": (r, half, size - half) for r in range(n)}}


def prepared(nodes: Nodes, node: int):
    """One agent's ``prepare_start`` (a restart): its tier and the newest candidate ready."""
    from elasticft.contract.memory import RESTORE_FILE, RestorePlan

    tier = nodes.tiers[node]
    tier.prepare_start(set(nodes.names), None)
    plan = RestorePlan.from_json((tier.run_dir / RESTORE_FILE).read_text())
    return tier, plan, next(c for c in plan.candidates if c.ready)


def restore_ranged(nodes: Nodes, node: int, wants: list[tuple[str, int, int]]) -> float:
    """One agent's prepare, then its ranks' reads of their items by byte ranges; seconds."""
    from elasticft.worker.ranged_reads import CandidateReader

    began = time.perf_counter()
    _, plan, candidate = prepared(nodes, node)
    reader = CandidateReader(candidate, plan.run_id, plan.node)
    try:
        for name, offset, length in wants:
            with reader.open(name, [(offset, length)]) as stream:
                stream.seek(offset)
                assert len(stream.read(length)) == length
    finally:
        reader.close()
    return time.perf_counter() - began


def restore_assembled(nodes: Nodes, node: int, wants: list[tuple[str, int, int]]) -> float:
    """The previous design: the agent assembles the whole checkpoint, then the ranks read locally."""
    began = time.perf_counter()
    tier, _, candidate = prepared(nodes, node)
    for name, offset, length in wants:
        with open(Path(candidate.path) / name, "rb") as f:
            assert len(os.pread(f.fileno(), length, offset)) == length
    seconds = time.perf_counter() - began
    nodes.assembled[node] = received(nodes, node, ranged=False)
    tier.node_dir.clear_restore()  # 64 whole checkpoints would not fit in this machine's memory
    return seconds


def received(nodes: Nodes, node: int, ranged: bool) -> int:
    """Bytes ``node`` received for its restore: the servers' counts, or (previous design) its
    assembled directory's files that are no hard link of its own copies."""
    name = nodes.names[node]
    if ranged:
        return sum(tier.served().get(name, 0) for tier in nodes.tiers)
    if node in nodes.assembled:
        return nodes.assembled[node]
    restore = nodes.tiers[node].node_dir.restore
    return sum(p.stat().st_size for p in restore.rglob("*") if p.is_file() and p.stat().st_nlink == 1)


def measure(n: int, part_mb: float, work: Path, ranged: bool) -> dict:
    size = int(part_mb * MB) // 2 * 2
    layout = new_layout(n, size)
    with Nodes(n, work, part_bytes=size) as nodes:
        for iteration in (1, 2):  # two snapshots: both restorable, as in a running job
            nodes.snapshot(iteration, items_of(n, size))
        settle(nodes.server.endpoint)
        before = metrics(nodes.server.endpoint)
        nodes.snapshot(3, items_of(n, size))
        settle(nodes.server.endpoint)
        after = metrics(nodes.server.endpoint)
        restore = restore_ranged if ranged else restore_assembled
        # One node at a time: on a real cluster each node restores on its own CPUs and NIC; here the
        # N nodes share one process and 2 cores, so all at once would time this machine, not the design.
        nodes.assembled = {}
        seconds = [restore(nodes, i, layout[i]) for i in range(n)]
        got = [received(nodes, i, ranged) for i in range(n)]
    writes = sum(after[k] - before[k] for k in ("Put", "Txn", "DeleteRange")) / n
    return {"nodes": n, "share": size, "remote_share": size // 2, "received_max": max(got),
            "received_median": statistics.median(got), "seconds_max": max(seconds),
            "seconds_median": statistics.median(seconds), "writes": writes}


def baseline(rev: str, args) -> list[dict]:
    return on_previous_tree(__file__, rev, ["--nodes", args.nodes, "--part-mb", str(args.part_mb), "--assembled"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="4,16,64", help="node counts, comma separated")
    parser.add_argument("--part-mb", type=float, default=4.0, help="each node's shard file, MiB")
    parser.add_argument("--assembled", action="store_true", help="restore as the previous design did (baseline run)")
    args = parse_with_baseline(parser)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the tier's home: host memory
    with tempfile.TemporaryDirectory(prefix="eft-mem-restore-", dir=shm) as work:
        rows = [measure(n, args.part_mb, Path(work) / str(n), ranged=not args.assembled)
                for n in map(int, args.nodes.split(","))]
    if args.json:
        print(json.dumps(rows))
        return
    old = [] if args.no_baseline else baseline(args.baseline_rev, args)
    headers = ["design", "nodes", "share MiB", "received MiB (max)", "received / share", "received / remote share",
               "restore s (median / max)", "etcd writes/node/snap"]
    lines = []
    for label, figures in (("ranged reads", rows), (f"assembled ({args.baseline_rev})", old)):
        lines += [[label, r["nodes"], round(r["share"] / MB, 2), round(r["received_max"] / MB, 2),
                   round(r["received_max"] / r["share"], 3), round(r["received_max"] / r["remote_share"], 3),
                   f"{r['seconds_median']:.2f} / {r['seconds_max']:.2f}", round(r["writes"], 2)] for r in figures]
    print(table(headers, lines))
    first, last = rows[0], rows[-1]
    print(f"restore time, {last['nodes']} vs {first['nodes']} nodes: median node "
          f"x{last['seconds_median'] / first['seconds_median']:.2f}, slowest node "
          f"x{last['seconds_max'] / first['seconds_max']:.2f} (goal: within x2)")
    for new, prev in zip(rows, old):
        print(f"{new['nodes']} nodes: bytes received x{new['received_max'] / max(prev['received_max'], 1):.3f}, "
              f"restore time x{new['seconds_max'] / max(prev['seconds_max'], 1e-9):.2f} of the previous design")


if __name__ == "__main__":
    main()
