"""The numbers check: what it adds to ``hook.step`` per iteration, against the previous hook.

Forks N ranks in a real gloo group. Every rank holds two hooks on the same group: one with
the numbers check on (``hook.step(i, loss=..., grad_norm=...)``: four more int64s in the
vote, the spike rule's median and MAD over the window) and one with it off
(``EFT_NUMERICS_CHECK=false``: the hook as it was before the check, the baseline). Blocks
of calls to each alternate with blocks of a bare ``all_reduce`` of the 5 int64s the old
vote carries, the floor any agreement costs. Rank 0's microseconds per call.

    python bench/numerics.py [--ranks 4] [--iterations 600]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import table  # noqa: E402  (also puts the repo on sys.path)

BLOCK = 50


def _make_hook(check: bool):
    from elasticft.worker import Hook

    os.environ["EFT_NUMERICS_CHECK"] = str(check).lower()
    return Hook(save_interval=1000, last_saved_iteration=0)


def _rank_main(rank: int, ranks: int, iterations: int, root: str) -> None:
    for name in [n for n in os.environ if n.startswith("EFT_")]:
        del os.environ[name]
    os.environ.update(EFT_RUN_DIR=os.path.join(root, f"run{rank}"), EFT_NODE_ID=f"node{rank}", LOCAL_RANK="0")
    dist.init_process_group("gloo", init_method=f"file://{root}/init", rank=rank, world_size=ranks)
    with_check, without = _make_hook(True), _make_hook(False)
    flags = torch.zeros(5, dtype=torch.int64)
    samples: dict[str, list[int]] = {"check on": [], "check off": [], "all_reduce": []}
    iteration = 0
    while len(samples["check on"]) < iterations:
        for name in samples:
            for _ in range(BLOCK):
                iteration += 1
                loss = 2.0 + 2.0 * math.exp(-iteration / 300) + 0.01 * math.sin(iteration * 7.0 + rank)
                start = time.perf_counter_ns()
                if name == "check on":
                    action = with_check.step(iteration, loss=loss, grad_norm=1.0)
                elif name == "check off":
                    action = without.step(iteration)
                else:
                    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
                    action = None
                samples[name].append(time.perf_counter_ns() - start)
                assert action is None or not action.exit
    if rank == 0:
        Path(root, "rank0.json").write_text(json.dumps(samples))
    dist.destroy_process_group()


def measure(ranks: int, iterations: int) -> dict[str, dict]:
    with tempfile.TemporaryDirectory(prefix="eft-bench-") as tmp:
        for rank in range(ranks):
            Path(tmp, f"run{rank}").mkdir()
        mp.start_processes(_rank_main, args=(ranks, iterations, tmp), nprocs=ranks, join=True, start_method="fork")
        samples = json.loads(Path(tmp, "rank0.json").read_text())
    out = {}
    for name, ns in samples.items():
        us = sorted(v / 1000 for v in ns)
        out[name] = {"median": statistics.median(us), "p90": us[int(0.9 * (len(us) - 1))]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=600, help="calls of each kind per rank")
    args = parser.parse_args(argv)
    got = measure(args.ranks, args.iterations)
    base = got["check off"]["median"]
    rows = [[name, f"{v['median']:.0f}", f"{v['p90']:.0f}", f"{v['median'] / base:.2f}x"] for name, v in got.items()]
    print(f"hook.step per call, rank 0 of {args.ranks} gloo ranks, {args.iterations} calls each (µs)")
    print(table(["what", "median", "p90", "vs check off"], rows))
    print(f"the check adds {got['check on']['median'] - base:+.0f} µs per iteration (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
