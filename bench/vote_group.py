"""What making the vote's group costs each rank at every start of the workers: the previous
group and this one.

The previous group: ``new_group(backend="gloo")``, which connects gloo's full mesh when it is
made (each rank opens a TCP connection to each of the N−1 others, each found through the
job's store). This one (``elasticft/worker/vote_group.py``): the same gloo group with its
connections made on demand, so that a rank opens only those the vote's tree uses, at the first
vote. Both are measured on N real gloo ranks on loopback (a TCPStore, as under eft-run): the
group's making, then the vote's first tree MAX (where the lazy group connects), per rank, and
the sockets each rank opened for both; medians over the ranks and over ``--repeats`` groups of
each kind, after one uncounted round of both (a process's first gloo group pays for its start).

  python bench/vote_group.py [--sizes 8,16,32] [--repeats 3]

Ranks beyond this machine's cores share them: the rows show the shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import table

from elasticft import torch_seam  # noqa: F401 - imported ahead, as eft's Megatron workers have it (attach.py)
from elasticft.store import free_port
from elasticft.worker.tree_max import tree_max_
from elasticft.worker.vote import DECISION_WIDTH
from elasticft.worker.vote_group import vote_group

GROUPS = {"eager (before)": lambda: dist.new_group(backend="gloo"), "lazy": vote_group}


def _sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


def _rank(rank: int, world: int, port: int, repeats: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    vote = torch.zeros(DECISION_WIDTH + 1, dtype=torch.int64)
    mine: dict[str, list] = {name: [] for name in GROUPS}
    for repeat in range(repeats + 1):  # the first round warms the process up (gloo's first group), uncounted
        for name, make in GROUPS.items():
            dist.barrier()  # every rank starts together: its own time, not the skew
            before = _sockets()
            started = time.perf_counter()
            group = make()
            made = time.perf_counter()
            tree_max_(vote, group)
            voted = time.perf_counter()
            if repeat:
                mine[name].append((made - started, voted - made, _sockets() - before))
            dist.barrier()
            dist.destroy_process_group(group)
            del group
            gc.collect()  # its connections closed before the next group counts its own
    Path(out, f"rank{rank}.json").write_text(json.dumps(mine))
    dist.destroy_process_group()


def measure(world: int, repeats: int) -> dict[str, tuple[float, float, float, int]]:
    """Per group kind: the median new_group s, first vote s and sockets over ranks and repeats, and
    the most sockets any rank opened."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world, free_port(), repeats, tmp), nprocs=world, start_method="fork")
        samples = [json.loads(Path(tmp, f"rank{rank}.json").read_text()) for rank in range(world)]
    return {name: (*(statistics.median(s[name][i][k] for s in samples for i in range(repeats)) for k in range(3)),
                   max(s[name][i][2] for s in samples for i in range(repeats))) for name in GROUPS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,16,32", help="ranks per row, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="groups made per kind and row")
    args = parser.parse_args()
    rows = []
    for world in (int(s) for s in args.sizes.split(",")):
        got = measure(world, args.repeats)
        (e_make, e_vote, e_socks, e_most), (l_make, l_vote, l_socks, l_most) = got["eager (before)"], got["lazy"]
        rows.append([world, f"{e_make * 1e3:.1f}", f"{l_make * 1e3:.1f}", f"{e_make / l_make:.1f}x",
                     f"{e_vote * 1e3:.2f}", f"{l_vote * 1e3:.2f}", f"{(e_make + e_vote) / (l_make + l_vote):.1f}x",
                     f"{e_socks:g} / {e_most}", f"{l_socks:g} / {l_most}", f"{e_socks / l_socks:.1f}x"])
    print("the vote's group, made at every start of the workers: gloo's full mesh (before) against "
          "connections on demand; medians per rank")
    print(table(["ranks", "new_group ms (before)", "new_group ms", "ratio", "first vote ms (before)",
                 "first vote ms", "both, ratio", "sockets (before), median / most",
                 "sockets, median / most", "ratio"], rows))


if __name__ == "__main__":
    main()
