"""How long the planner takes, from 8 to 100,000 GPUs (8 per node).

Prints the median of several ``plan()`` calls per world size, then the wall time of the
``eft plan`` command end to end for 100,000 GPUs (a fresh Python process each run,
``python -m launcher.cli`` from this checkout), next to the time of the imports alone.

    python bench/planner.py [--runs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elasticft.planner.layout import BatchFacts, ModelFacts, Policy, plan  # noqa: E402

GPUS_PER_NODE = 8
WORLD_SIZES = (8, 64, 512, 4096, 32768, 100_000)
BUDGET_S = 1.0  # issue 5: 100,000 GPUs in well under a second

# The worked example of docs/planner.md (about 20B parameters, must split over >= 8 GPUs
# to fit 80 GB) with a global batch large enough to keep 100,000 GPUs busy.
MODEL = ModelFacts(num_layers=24, num_attention_heads=32, hidden_size=8192, seq_length=2048,
                   vocab_size=51200)
BATCH = BatchFacts(global_batch_size=4096, micro_batch_size=1)
POLICY = Policy(memory_per_gpu_gb=80, preferred_tp=2)
CLI_FLAGS = ["--num-layers", "24", "--num-attention-heads", "32", "--hidden-size", "8192",
             "--seq-length", "2048", "--vocab-size", "51200", "--global-batch-size", "4096",
             "--micro-batch-size", "1", "--memory-per-gpu-gb", "80", "--previous-tp", "2"]


def nodes_for(world: int) -> list[int]:
    full, partial = divmod(world, GPUS_PER_NODE)
    return [GPUS_PER_NODE] * full + ([partial] if partial else [])


def median_seconds(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs per measurement (median)")
    args = parser.parse_args()

    print(f"plan(): median of {args.runs} runs, {GPUS_PER_NODE} GPUs per node")
    print(f"{'GPUs':>8} {'nodes':>7} {'median ms':>10} {'of budget':>10}  layout (used, spare)")
    for world in WORLD_SIZES:
        nodes = nodes_for(world)
        chosen = plan(MODEL, BATCH, nodes, POLICY)
        seconds = median_seconds(lambda: plan(MODEL, BATCH, nodes, POLICY), args.runs)
        print(f"{world:>8} {len(nodes):>7} {seconds * 1e3:>10.2f} {seconds / BUDGET_S:>10.1%}"
              f"  TP={chosen.tp} PP={chosen.pp} DP={chosen.dp} "
              f"({chosen.used}, {len(chosen.spare)})")

    env = dict(os.environ, PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "launcher.cli", "plan", "--world-size", "100000",
               "--gpus-per-node", str(GPUS_PER_NODE), "--json", *CLI_FLAGS]
    imports = [sys.executable, "-c", "import launcher.cli"]
    runs = max(3, args.runs // 2)

    def run(argv):
        subprocess.run(argv, check=True, env=env, cwd=REPO, stdout=subprocess.DEVNULL)

    end_to_end = median_seconds(lambda: run(command), runs)
    startup = median_seconds(lambda: run(imports), runs)
    print(f"\neft plan --world-size 100000 --json, end to end: median of {runs} processes")
    print(f"{'whole command':>24} {end_to_end * 1e3:8.0f} ms")
    print(f"{'python + imports only':>24} {startup * 1e3:8.0f} ms")


if __name__ == "__main__":
    main()
