"""Rendezvous at scale: N simulated agents per design against one real etcd, one table.

For each N and design (``keys``: eft's handler; ``blob``: the pickled-state backend
eft used before; ``c10d``: torch's own on a TCPStore), time for N agents to form one
round, what the round sent to etcd (bytes, requests, revisions, database growth, etcd
CPU), compare-and-swaps lost, and the same per idle minute afterwards. The old designs
are capped (``--cap``, default 60 s): past it the row says "no round within 60 s".

  python bench/rdzv_scale.py [--sizes 8,16,64] [--designs keys,blob,c10d]
  python bench/rdzv_scale.py --sizes 256,1024,2048 --designs keys
  python bench/rdzv_scale.py --sizes 256,1024 --designs keys --baseline-rev de46700
                                                # each N: the keys design of that tree first, same etcd load
  python bench/rdzv_scale.py --real 2,8,32      # real agents with workers vs torchrun c10d
  python bench/rdzv_scale.py --agents 1024,2048  # each node's leases and watches, two vs one
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from common import ROOT, table

if "--tree" in sys.argv:  # a baseline's run (--baseline-rev): that tree's elasticft, before anything imports it
    sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])

from rdzv_sim import simulate_round  # noqa: E402

from elasticft.store import EmbeddedEtcd  # noqa: E402

HEADERS = ["design", "N", "round s", "KiB sent", "KiB out", "requests", "revisions", "events", "db KiB",
           "etcd cpu s", "agents cpu s", "CAS lost", "idle KiB/min", "idle req/min", "idle revs/min"]


def row(r) -> list:
    if r.seconds is None:
        return [r.design, r.agents, r.error[:40]] + [""] * (len(HEADERS) - 3)
    etcd = r.design != "c10d"
    rc, idle = r.round, r.idle_per_minute

    def v(x):
        return x if etcd else "-"

    return [r.design, r.agents, r.seconds, v(rc.received_bytes / 1024), v(rc.sent_bytes / 1024), v(int(rc.requests)),
            v(rc.revision), v(int(rc.events)), v(rc.db_bytes / 1024), v(rc.cpu_seconds), r.agents_cpu, v(r.cas_losses),
            v(idle.received_bytes / 1024), v(int(idle.requests)), v(idle.revision)]


def on_tree(rev: str, tree: str, n: int, args) -> list:
    """The ``keys`` row of git revision ``rev``'s handler (unpacked in ``tree``) at ``n``: this bench in a
    subprocess importing that tree, its own etcd, run right before this tree's row (the same load)."""
    argv = [sys.executable, __file__, "--sizes", str(n), "--designs", "keys", "--json", "--tree", tree,
            "--cap", str(args.cap), "--idle", str(args.idle), "--agents-per-process", str(args.agents_per_process),
            "--lease-ttl", str(args.lease_ttl)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=Path(__file__).parent)
    figures = json.loads(out.stdout.strip().splitlines()[-1])[0]
    return [f"keys@{rev}"] + figures[1:]


def ordered_writes(endpoint: str, n: int) -> tuple[float, float]:
    """etcd alone ordering ``n`` one-key writes (a join's put) from 32 threads over 8 connections:
    (seconds, etcd CPU seconds). What no parallelism of the agents removes from a round."""
    from concurrent.futures import ThreadPoolExecutor

    from rdzv_sim import metric_totals

    from elasticft.store import StoreOptions, connect

    clients = [connect(StoreOptions(endpoint)) for _ in range(8)]
    prefix = f"/floor/{uuid.uuid4().hex}/"
    cpu = metric_totals(endpoint)("process_cpu_seconds_total")
    began = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda i: clients[i % 8].put(f"{prefix}{i:06d}", '{"node": "x"}'), range(n)))
    seconds = time.monotonic() - began
    cpu = metric_totals(endpoint)("process_cpu_seconds_total") - cpu
    clients[0].delete_prefix(prefix)
    for client in clients:
        client.close()
    return seconds, cpu


def unpacked(rev: str, into: str) -> str:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "elasticft"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def simulated(sizes: list[int], designs: list[str], cap: float, idle: float, per_process: int,
              lease_ttl: float, args) -> None:
    rows = []
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="eft-rdzv-baseline-") as tree:
        if args.baseline_rev:
            unpacked(args.baseline_rev, tree)
        for n in sizes:
            if args.baseline_rev:
                rows.append(on_tree(args.baseline_rev, tree, n, args))
                print("  ".join(str(c) if not isinstance(c, float) else f"{c:.2f}" for c in rows[-1]), flush=True)
            for design in designs:
                result = simulate_round(design, n, etcd.endpoint, cap=cap, idle=idle, lease_ttl=lease_ttl,
                                        processes=-(-n // per_process))
                rows.append(row(result))
                print("  ".join(str(c) if not isinstance(c, float) else f"{c:.2f}" for c in rows[-1]), flush=True)
        floors = {n: ordered_writes(etcd.endpoint, n) for n in sizes} if not args.json else {}
    if args.json:
        print(json.dumps(rows))
        return
    print()
    for n, (seconds, cpu) in floors.items():
        print(f"etcd alone, N = {n}: {n} one-key writes ordered in {seconds:.2f} s ({cpu:.2f} s of etcd CPU, "
              f"{1e3 * cpu / n:.2f} ms a write): a round's floor where every agent has cores of its own")
    print(f"one round of N simulated agents (threads, up to {per_process} per process; c10d: one process), "
          f"no workers, one etcd, lease TTL {lease_ttl:g} s; idle over {idle:g} s, per minute")
    print("CAS lost counts every compare-and-swap that lost, the agents' c10d store included; KiB sent: what "
          "etcd received, KiB out: what it sent; events: watch events it delivered; agents cpu s: the simulated "
          "agents' processes (every agent of a real cluster has its own cores: here they share this host's)")
    if args.baseline_rev:
        print(f"keys@{args.baseline_rev}: the keys design of that git revision, run just before this tree's at each N")
    print(table(HEADERS, rows))


def real(sizes: list[int]) -> None:
    """Real agents with workers, launched at once: eft-run etcd-v3 vs torchrun c10d, same run."""
    from launch import eft_run, torchrun
    from rendezvous import launch

    from elasticft.store import free_port

    rows = []
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        for n in sizes:
            work = Path(tmp) / f"c10d-{n}"
            work.mkdir()
            c10d = launch(n, torchrun(), "c10d", f"127.0.0.1:{free_port()}", work)
            work = Path(tmp) / f"eft-{n}"
            work.mkdir()
            eft = launch(n, eft_run(), "etcd-v3", etcd.endpoint, work)
            rows.append([n, c10d, eft, eft / c10d])
            print(f"N={n}: torchrun c10d {c10d:.2f} s, eft-run etcd-v3 {eft:.2f} s", flush=True)
    print()
    print("real agents, launch -> all workers started, seconds")
    print(table(["agents", "torchrun c10d", "eft-run etcd-v3", "eft/torchrun"], rows))


def agents(sizes: list[int], per_process: int, lease_ttl: float, idle: float) -> None:
    """eft's agents' etcd footprint (rdzv_agents.py): two leases and member watches per node
    (the design before) vs one of each (shared), same etcd, same run."""
    from rdzv_agents import DESIGNS, measure

    headers = ["design", "N", "leases", "watches", "keep-alives/min", "requests/min", "events per loss",
               "loss seen s"]
    rows = []
    with EmbeddedEtcd() as etcd:
        for n in sizes:
            for design in DESIGNS:
                r = measure(design, n, etcd.endpoint, lease_ttl=lease_ttl, per_process=per_process, idle=idle)
                rows.append([r.design, r.nodes, r.error] + [""] * 6 if r.error else
                            [r.design, r.nodes, r.leases, r.watchers, r.keepalives_per_min, r.requests_per_min,
                             r.events_per_loss, r.seen_loss_s])
                print("  ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(f"N simulated eft agents (record, membership watch, rendezvous; threads, {per_process} per process), "
          f"one etcd, lease TTL {lease_ttl:g} s; idle over {idle:g} s; one node then dies (its lease revoked)")
    print("two: a lease for the record and one for the rendezvous keys, a watch on nodes/ and one on the "
          "round's participants; shared: one of each (issue 35)")
    print(table(headers, rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,64")
    parser.add_argument("--designs", default="keys,blob,c10d")
    parser.add_argument("--cap", type=float, default=60.0, help="seconds a round may take before it counts as none")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of idle traffic measured after the round")
    parser.add_argument("--agents-per-process", type=int, default=128,
                        help="simulated agents per process (threads); more agents are spread over more processes")
    parser.add_argument("--lease-ttl", type=float, default=3.0,
                        help="the agents' lease TTL (eft's default 3 s; keep-alives every TTL/3)")
    parser.add_argument("--real", default="", help="agent counts for real runs with workers (e.g. 2,8,32)")
    parser.add_argument("--agents", default="", help="node counts for the agents' lease and watch footprint")
    parser.add_argument("--baseline-rev", default="", help="git revision whose keys design runs before this tree's")
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON line (a baseline's run)")
    parser.add_argument("--tree", help="import elasticft from this directory (a baseline's run)")
    args = parser.parse_args()
    if args.agents:
        agents([int(s) for s in args.agents.split(",")], args.agents_per_process, args.lease_ttl, args.idle)
        return
    if args.real:
        real([int(s) for s in args.real.split(",")])
        return
    simulated([int(s) for s in args.sizes.split(",")], args.designs.split(","), args.cap, args.idle,
              args.agents_per_process, args.lease_ttl, args)


if __name__ == "__main__":
    main()
