"""What the ranks' vote costs against the number of ranks: the previous design and this one.

The previous design: every iteration, every rank joined one ``all_reduce(MAX)`` of the
vote's int64s over gloo, whose all_reduce of a tiny tensor is its ring: 2·(N−1) dependent
sends, linear in N. This one (``elasticft/worker/tree_max.py``, ``cadence.py``): a binomial
tree, 2·⌈log2 N⌉ hops, held every iteration only while it costs under ``--eft-vote-budget``
(1 %) of a step, else every k-th iteration. Both are measured on real gloo groups of N
processes on loopback with the vote's exact width, and modelled at 16,384 ranks with a
stated per-hop latency (``--hop-us``: one TCP hop inside a datacenter, tens of µs).

  python bench/vote_scale.py [--sizes 2,4,8,16] [--iterations 200] [--hop-us 30] [--step-s 1]

Ranks beyond this machine's cores share them: the measured rows show the shape.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import table

from elasticft.store import free_port
from elasticft.worker.async_save import AsyncSaves
from elasticft.worker.cadence import votes_every
from elasticft.worker.memory import MemoryCheckpoints
from elasticft.worker.numerics import NumericsGuard
from elasticft.worker.tree_max import tree_max_
from elasticft.worker.vote import DECISION_WIDTH

# The vote's width with every ballot on: the save slots, the numbers check, memory, async saves.
VOTE_WIDTH = DECISION_WIDTH + 1 + NumericsGuard.width + MemoryCheckpoints.width + AsyncSaves.width
MODEL_RANKS = 16_384
BUDGET = 0.01  # --eft-vote-budget's default


def _rank(rank: int, world: int, port: int, iterations: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    vote = torch.zeros(VOTE_WIDTH, dtype=torch.int64)
    medians = []
    for exchange in (lambda: dist.all_reduce(vote, op=dist.ReduceOp.MAX), lambda: tree_max_(vote)):
        times = []
        for i in range(iterations + 20):  # 20 to warm gloo's pairs up
            dist.barrier()  # every rank starts each vote together: its own time, not the skew
            started = time.perf_counter()
            exchange()
            if i >= 20:
                times.append(time.perf_counter() - started)
        medians.append(statistics.median(times))
    if rank == 0:
        Path(out).write_text(" ".join(map(str, medians)))
    dist.destroy_process_group()


def vote_seconds(world: int, iterations: int) -> tuple[float, float]:
    """The median time of one vote on ``world`` gloo ranks, ring then tree (rank 0's view)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "median")
        mp.start_processes(_rank, args=(world, free_port(), iterations, out), nprocs=world, start_method="spawn")
        ring, tree = map(float, Path(out).read_text().split())
        return ring, tree


def per_iteration(vote: float, step: float) -> tuple[float, int]:
    """What votes cost an iteration of ``step`` seconds under the budget, and k."""
    k = votes_every(vote, step, BUDGET)
    return vote / k, k


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8,16", help="ranks per measured row, comma-separated")
    parser.add_argument("--iterations", type=int, default=200, help="votes timed per row (median)")
    parser.add_argument("--hop-us", type=float, default=30.0, help="per-hop latency of the model row, µs")
    parser.add_argument("--step-s", type=float, default=1.0, help="the iteration the cost is a share of, s")
    args = parser.parse_args()
    rows = []
    for world in (int(s) for s in args.sizes.split(",")):
        ring, tree = vote_seconds(world, args.iterations)
        rows.append(row(world, ring, tree, args.step_s))
    hop = args.hop_us * 1e-6
    ring, tree = 2 * (MODEL_RANKS - 1) * hop, 2 * math.ceil(math.log2(MODEL_RANKS)) * hop
    rows.append(row(f"{MODEL_RANKS} (model)", ring, tree, args.step_s))
    print(f"a vote of {VOTE_WIDTH} int64 over gloo: the previous design's all_reduce (its ring, every iteration) "
          f"and this one's tree, held every iteration while under {BUDGET:.0%} of a {args.step_s:g} s step")
    print(table(["ranks", "ring ms (before)", "tree ms", "ring / tree", "before, % of a step",
                 "now, % of a step", "votes every"], rows))
    print(f"model: 2*(N-1) hops (ring) against 2*ceil(log2 N) (tree) of {args.hop_us:g} us; goal: under 1 % "
          f"of a 1 s iteration at {MODEL_RANKS} ranks")


def row(ranks, ring: float, tree: float, step: float) -> list:
    cost, k = per_iteration(tree, step)
    return [ranks, f"{ring * 1e3:.3f}", f"{tree * 1e3:.3f}", f"{ring / tree:.1f}x", f"{100 * ring / step:.3f}",
            f"{100 * cost / step:.3f}", f"{k} iteration(s)"]


if __name__ == "__main__":
    main()
