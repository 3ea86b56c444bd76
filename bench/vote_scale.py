"""What the hook's per-iteration vote costs against the number of ranks, measured and modelled.

Every iteration, every rank joins one ``all_reduce(MAX)`` of the vote's int64s
(``elasticft/worker/vote.py``: the save slots, the numbers check's, the memory tier's and
the async save's ballots) over gloo. gloo's default all_reduce of a tiny tensor is its ring:
2·(N−1) dependent sends, so the vote's latency grows linearly with N. This bench measures
it on real gloo groups of N processes on loopback, with the vote's exact width, and beside
it a baseline that does not grow: what one rank does alone each iteration to read a
decision from its node (its iteration into its slot of a shared page, the node's decision
sequence out of it), the primitive a decision fixed ahead of time by the agents costs a rank.

  python bench/vote_scale.py [--sizes 2,4,8,16] [--iterations 200] [--hop-us 30]

Ranks beyond this machine's cores share them: the measured rows show the shape, and the
model row extrapolates with a stated per-hop latency (``--hop-us``: one TCP hop inside a
datacenter, tens of µs) to the 16,384 ranks eft is built for, against a 1 s iteration.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import table

from elasticft.store import free_port
from elasticft.worker.async_save import AsyncSaves
from elasticft.worker.memory import MemoryCheckpoints
from elasticft.worker.numerics import NumericsGuard
from elasticft.worker.vote import FILTERED

# The vote's width with every ballot on: the save slots, the numbers check, memory, async saves.
VOTE_WIDTH = FILTERED + 1 + NumericsGuard.width + MemoryCheckpoints.width + AsyncSaves.width
MODEL_RANKS = 16_384


def _rank(rank: int, world: int, port: int, iterations: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    vote = torch.zeros(VOTE_WIDTH, dtype=torch.int64)
    times = []
    for i in range(iterations + 20):  # 20 to warm gloo's pairs up
        started = time.perf_counter()
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        if i >= 20:
            times.append(time.perf_counter() - started)
    if rank == 0:
        Path(out).write_text(str(statistics.median(times)))
    dist.destroy_process_group()


def vote_seconds(world: int, iterations: int) -> float:
    """The median per-iteration time of the vote on ``world`` gloo ranks (rank 0's view)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "median")
        mp.start_processes(_rank, args=(world, free_port(), iterations, out), nprocs=world, start_method="spawn")
        return float(Path(out).read_text())


def local_read_seconds(iterations: int) -> float:
    """The median per-iteration time of one rank's local decision read: its iteration put in
    its slot of the node's shared page (where its agent reads it) and the node's decision
    sequence read from the same page. No other rank, no system call."""
    with tempfile.TemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as backing:
        backing.truncate(mmap.PAGESIZE)
        page = mmap.mmap(backing.fileno(), mmap.PAGESIZE)
        slot, decision = struct.Struct("<q"), struct.Struct("<qq")
        times = []
        for i in range(iterations):
            started = time.perf_counter()
            slot.pack_into(page, 64, i)
            decision.unpack_from(page, 0)
            times.append(time.perf_counter() - started)
        page.close()
        return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16", help="ranks per measured row, comma-separated")
    parser.add_argument("--iterations", type=int, default=200, help="votes timed per row (median)")
    parser.add_argument("--hop-us", type=float, default=30.0, help="per-hop latency of the model row, µs")
    args = parser.parse_args()
    local = local_read_seconds(args.iterations)
    rows = []
    for world in (int(s) for s in args.sizes.split(",")):
        vote = vote_seconds(world, args.iterations)
        rows.append([world, f"{vote * 1e3:.3f}", f"{local * 1e3:.4f}", f"{vote / local:,.0f}x"])
    hop = args.hop_us * 1e-6
    modelled = 2 * (MODEL_RANKS - 1) * hop
    rows.append([f"{MODEL_RANKS} (model)", f"{modelled * 1e3:.0f}", f"{local * 1e3:.4f}", f"{modelled / local:,.0f}x"])
    print(f"the vote: all_reduce(MAX) of {VOTE_WIDTH} int64 over gloo (its ring); the baseline: one rank's "
          f"iteration and decision through its node's shared page")
    print(table(["ranks", "vote ms", "local read ms", "vote / local"], rows))
    print(f"model: 2*(N-1) hops of {args.hop_us:g} us: {modelled * 1e3:.0f} ms a vote at {MODEL_RANKS} ranks, "
          f"{modelled * 100:.1f} % of a 1 s iteration (goal: < 1 %); the local read is "
          f"{local * 1e6:.2f} us at any N")


if __name__ == "__main__":
    main()
