"""The memory tier's etcd load per snapshot at N nodes: this design against the previous one, one run.

N real ``MemoryTier`` agents (no workers) in one process, each with its own etcd client, shard
server on 127.0.0.1 and node directory, on one embedded etcd; every node's "workers" write a
synthetic part (one shard file of ``--part-kb``; rank 0's node also a real DCP ``.metadata``)
and the tier publishes, replicates, computes what is restorable and prunes, as in a job. After
two warm-up snapshots, ``--snapshots`` more are measured: etcd's own counters (``/metrics``,
gRPC requests handled and watch events sent) divided by snapshots and nodes.

The baseline is the previous design (one key per part, one compare-and-swap per replica, every
agent reading the whole index after each snapshot), measured by running this same file in a
subprocess on the tree of ``--baseline-rev`` (``git archive``), on a fresh etcd of its own.

    python bench/mem_index_scale.py [--nodes 4,16,64] [--snapshots 5] [--part-kb 64] [--baseline-rev REV]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402  (also puts the repo on sys.path)
from mem_nodes import Nodes, on_previous_tree, parse_with_baseline  # noqa: E402

KV = ("Range", "Put", "Txn", "DeleteRange")


def metrics(endpoint: str) -> dict[str, float]:
    """etcd's KV requests handled (by method) and watch events sent, from its /metrics."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    out = {m: 0.0 for m in KV}
    for method in KV:
        for value in re.findall(r'grpc_server_handled_total\{[^}]*grpc_method="%s"[^}]*\} (\S+)' % method, text):
            out[method] += float(value)
    out["events"] = float(re.search(r"^etcd_debugging_mvcc_events_total (\S+)", text, re.M).group(1))
    out["sent_bytes"] = sum(float(v) for v in re.findall(r"^etcd_network_client_grpc_sent_bytes_total (\S+)",
                                                         text, re.M))
    return out


def settle(endpoint: str, quiet: float = 0.3, limit: float = 30.0) -> None:
    """Until etcd took no write for ``quiet`` seconds (the agents' reactions to the snapshot are done);
    read from /metrics, which is no etcd request."""
    def writes() -> float:
        m = metrics(endpoint)
        return m["Put"] + m["Txn"] + m["DeleteRange"]

    deadline = time.monotonic() + limit
    last, since = writes(), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(0.05)  # a bench's poll of a counter; no test relies on it
        now = writes()
        if now != last:
            last, since = now, time.monotonic()


def measure(nodes: int, snapshots: int, kb: int, work: Path) -> dict:
    """One design (whichever ``elasticft`` imports) at ``nodes`` nodes: etcd load per snapshot per node."""
    with Nodes(nodes, work, part_bytes=kb * 1024) as cluster:
        def snapshot(iteration: int) -> float:
            began = time.perf_counter()
            cluster.snapshot(iteration)
            settle(cluster.server.endpoint)
            return time.perf_counter() - began

        for iteration in (1, 2):
            snapshot(iteration)
        before = metrics(cluster.server.endpoint)
        seconds = [snapshot(iteration) for iteration in range(3, 3 + snapshots)]
        after = metrics(cluster.server.endpoint)
    per = snapshots * nodes
    delta = {k: (after[k] - before[k]) / per for k in after}
    return {"nodes": nodes, "writes": delta["Put"] + delta["Txn"] + delta["DeleteRange"], "reads": delta["Range"],
            "events": delta["events"], "kb_sent": delta["sent_bytes"] / 1024, "seconds": sorted(seconds)[len(seconds) // 2]}


def baseline(rev: str, args) -> list[dict]:
    return on_previous_tree(__file__, rev, ["--nodes", args.nodes, "--snapshots", str(args.snapshots),
                                            "--part-kb", str(args.part_kb)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", default="4,16,64", help="node counts to measure, comma separated")
    parser.add_argument("--snapshots", type=int, default=5, help="snapshots measured at each node count")
    parser.add_argument("--part-kb", type=int, default=64, help="size of each node's part (one shard file)")
    args = parse_with_baseline(parser)
    counts = [int(n) for n in args.nodes.split(",")]
    with tempfile.TemporaryDirectory(prefix="eft-mem-index-") as work:
        rows = [measure(n, args.snapshots, args.part_kb, Path(work) / str(n)) for n in counts]
    if args.json:
        print(json.dumps(rows))
        return
    old = [] if args.no_baseline else baseline(args.baseline_rev, args)
    headers = ["design", "nodes", "writes/node/snap", "reads/node/snap", "watch events/node/snap",
               "KiB sent/node/snap", "snapshot s (all nodes)"]
    lines = []
    for label, figures in (("one key a node", rows), (f"one key a part ({args.baseline_rev})", old)):
        lines += [[label, r["nodes"], round(r["writes"], 2), round(r["reads"], 2), round(r["events"], 2),
                   round(r["kb_sent"], 1), round(r["seconds"], 3)] for r in figures]
    print(table(headers, lines))
    for new, prev in zip(rows, old):
        print(f"{new['nodes']} nodes: etcd writes x{new['writes'] / max(prev['writes'], 1e-9):.2f}, "
              f"reads x{new['reads'] / max(prev['reads'], 1e-9):.2f}, "
              f"bytes sent x{new['kb_sent'] / max(prev['kb_sent'], 1e-9):.2f} of the previous design")


if __name__ == "__main__":
    main()
