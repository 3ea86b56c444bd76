"""Seconds from kill -9 of one node to the survivors' workers running again.

Three simulated nodes (agents with one worker each, ``--nnodes 2:3``) sit in a gloo
all_reduce loop. One node that is not rank 0 (torchrun's c10d store lives on rank 0,
so losing it ends a torchrun job outright) is killed with its workers; we time until
both survivors' new workers have started with WORLD_SIZE=2.

Rows: torchrun with the c10d defaults users get, torchrun with last_call_timeout=1
(to separate torch's 30 s last call from its 15 s heartbeat), and eft-run.

  python bench/node_loss.py [--repeats 1] [--give-up 120] [--variants torchrun,eft]
"""

from __future__ import annotations

import argparse
import tempfile
import uuid
from pathlib import Path

import psutil
from common import table
from launch import (
    WORKERS,
    Launched,
    agent_of,
    eft_run,
    generation,
    rdzv_command,
    time_recovery,
    torchrun,
    wait_for,
)

from elasticft.store import EmbeddedEtcd, free_port


def trial(launcher: list[str], backend: str, endpoint: str, extra: list[str], work: Path,
          give_up: float = 120.0) -> tuple[float, float] | None:
    starts = work / "starts.jsonl"
    cmd = rdzv_command(launcher, str(WORKERS / "allreduce_loop.py"), str(work), nnodes="2:3", nproc=1,
                       backend=backend, endpoint=endpoint, run_id=uuid.uuid4().hex,
                       flags=["--max-restarts", "3", *extra])
    nodes = [Launched(cmd, work / f"node{i}.log") for i in range(3)]
    try:
        first = wait_for(lambda: generation(starts, 3), 300, "a world of 3")
        # Neither rank 0 nor the agent hosting c10d's rendezvous store (whichever agent
        # bound the endpoint's port first): torchrun cannot survive losing those.
        port = int(endpoint.rsplit(":", 1)[1])
        agents = {agent_of(r["pid"]): r["group_rank"] for r in first}
        victim = next(n for n in nodes if agents.get(n.proc.pid) != 0 and not _listens_on(n.proc.pid, port))
        return time_recovery(nodes, victim, work, 2, give_up)
    finally:
        for node in nodes:
            node.stop()


def _listens_on(pid: int, port: int) -> bool:
    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.Process(pid).net_connections())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--give-up", type=float, default=120.0,
                        help="seconds after the kill before a row counts as no recovery")
    parser.add_argument("--variants", default="torchrun,torchrun-last-call-1,eft",
                        help="rows to run, of: torchrun, torchrun-last-call-1, eft")
    args = parser.parse_args()
    rows = []
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        variants = {
            "torchrun": ("torchrun c10d (defaults)", torchrun(), "c10d", None, []),
            "torchrun-last-call-1": ("torchrun c10d, last_call_timeout=1", torchrun(), "c10d", None,
                                     ["--rdzv-conf", "last_call_timeout=1"]),
            "eft": ("eft-run etcd-v3 (defaults)", eft_run(), "etcd-v3", etcd.endpoint, []),
        }
        results = {}
        for key in args.variants.split(","):
            name, launcher, backend, endpoint, extra = variants[key]
            runs = []
            for r in range(args.repeats):
                work = Path(tmp) / f"{len(results)}-{r}"
                work.mkdir()
                runs.append(trial(launcher, backend, endpoint or f"127.0.0.1:{free_port()}", extra, work,
                                  args.give_up))
            done = [r for r in runs if r is not None]
            results[name] = min(done) if done else None
            print(f"{name}: {len(done)} of {len(runs)} recovered; best {results[name]}", flush=True)
        for name, best in results.items():
            if best is None:
                rows.append([name, f"no recovery within {args.give_up:g} s", ""])
            else:
                rows.append([name, best[0], best[1]])
    print()
    print("kill -9 of one of 3 nodes -> survivors' workers running at WORLD_SIZE=2 (best of %d)" % args.repeats)
    print("eft's target: workers running again within the lease TTL (3 s) + 1 s")
    print(table(["launcher", "workers started, s", "gloo joined, s"], rows))


if __name__ == "__main__":
    main()
