"""What a restart's memory planning reads from etcd at N nodes: this design against the previous one.

N real ``MemoryTier`` agents without workers (``mem_nodes.Nodes``: one process, one embedded etcd),
one snapshot of every node's part, then every agent's ``prepare_start`` at once, as after a
rendezvous. Counted: the keys each agent's etcd client read (its answers), the bytes etcd sent
(its /metrics), and the time until every agent had prepared its candidates. Before, every agent
read every node's record (N² keys a restart); now the first node reads them and shares what the
restart needs in ``mem/plan`` (``elasticft/memckpt/plan.py``). The baseline is the tree of
``--baseline-rev``, this same file in a subprocess (``git archive``), on a fresh etcd of its own.

    python bench/mem_plan_reads.py [--nodes 4,16,64] [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402  (also puts the repo on sys.path)
from mem_index_scale import metrics, settle  # noqa: E402
from mem_nodes import Nodes, on_previous_tree, parse_with_baseline  # noqa: E402

BASELINE_REV = "de46700"  # every agent reads every record at a restart


def counted(client, reads: list[int], at: int) -> None:
    """Count the keys each read of ``client`` returns into ``reads[at]`` (the methods a tree has)."""
    sizes = {"get_prefix": lambda r: len(r[0]), "get_range": lambda r: len(r[0]), "get": lambda r: r is not None,
             "get_with_revision": lambda r: r[0] is not None, "last_modified": lambda r: 1,
             "oldest": len, "keys_with_prefix": len}
    for name, size in sizes.items():
        read = getattr(client, name, None)
        if read is None:
            continue

        def reading(*args, read=read, size=size, **kwargs):
            answer = read(*args, **kwargs)
            reads[at] += int(size(answer))
            return answer

        setattr(client, name, reading)


def measure(n: int, work: Path) -> dict:
    with Nodes(n, work, part_bytes=4096) as nodes:
        nodes.snapshot(1)
        settle(nodes.server.endpoint)
        reads = [0] * n
        for i, client in enumerate(nodes.clients):
            counted(client, reads, i)
        before = metrics(nodes.server.endpoint)
        began = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda tier: tier.prepare_start(set(nodes.names), None), nodes.tiers))
        seconds = time.perf_counter() - began
        sent = metrics(nodes.server.endpoint)["sent_bytes"] - before["sent_bytes"]
    return {"nodes": n, "keys": sum(reads), "most": max(reads), "kib": sent / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="4,16,64", help="node counts, comma separated")
    args = parse_with_baseline(parser)
    if args.baseline_rev == parser.get_default("baseline_rev"):
        args.baseline_rev = BASELINE_REV
    with tempfile.TemporaryDirectory(prefix="eft-mem-plan-") as work:
        rows = [measure(n, Path(work) / str(n)) for n in map(int, args.nodes.split(","))]
    if args.json:
        print(json.dumps(rows))
        return
    old = [] if args.no_baseline else on_previous_tree(__file__, args.baseline_rev, ["--nodes", args.nodes])
    lines = [[label, r["nodes"], r["keys"], round(r["keys"] / r["nodes"], 2), r["most"], round(r["kib"], 1),
              round(r["seconds"], 2)]
             for label, figures in (("one plan", rows), (f"every agent reads all ({args.baseline_rev})", old))
             for r in figures]
    print(table(["design", "nodes", "keys read", "per node", "most by one", "KiB etcd sent", "all prepared s"],
                lines))
    print("N agents' prepare_start at once after one snapshot (one process, one etcd, 2 cores shared)")


if __name__ == "__main__":
    main()
