"""Goodput per policy at 1,024 / 16,384 / 100,000 GPUs over 54 days, from ``eft simulate``.

Runs the command end to end (a fresh Python process per size, ``python -m launcher.cli``
from this checkout, its defaults: Llama 3's failure rate and causes, the costs of
``launcher/simulate_cmd.py``'s DEFAULT_COSTS, seed 0) and prints a Markdown table of
goodput per policy and the wall time of each run. ``--plot FILE`` also writes the picture
of the 16,384-GPU run (docs/goodput-simulated.svg is this).

    python bench/goodput.py [--seed N] [--plot docs/goodput-simulated.svg]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = (1024, 16384, 100_000)
DAYS = 54
BUDGET_S = 60.0  # issue 20: 16,384 GPUs x 54 days in under a minute


def run(gpus: int, seed: int, plot: str | None) -> tuple[dict, float]:
    args = [sys.executable, "-m", "launcher.cli", "simulate", "--gpus", str(gpus), "--days", str(DAYS),
            "--seed", str(seed), "--json"] + (["--plot", plot] if plot else [])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", help="picture of the 16,384-GPU run (.svg or .html)")
    options = parser.parse_args()
    rows = []
    for gpus in SIZES:
        record, wall = run(gpus, options.seed, options.plot if gpus == 16384 else None)
        rows.append((gpus, record, wall))
    policies = [p["policy"] for p in rows[0][1]["policies"]]
    print("| GPUs | failures (job MTBF) | " + " | ".join(policies) + " | `eft simulate` wall time |")
    print("| ---: | ---: | " + " | ".join("---:" for _ in policies) + " | ---: |")
    for gpus, record, wall in rows:
        cells = " | ".join(f"{p['goodput']:.1%}" for p in record["policies"])
        print(f"| {gpus:,} | {record['failures']} ({record['job_mtbf_hours']:.2f} h) | {cells} | {wall:.1f} s |")
    slow = [wall for gpus, _, wall in rows if gpus == 16384 and wall > BUDGET_S]
    print(f"\n16,384 GPUs x {DAYS} days, all policies: {rows[1][2]:.1f} s end to end "
          f"(simulation alone {rows[1][1]['seconds']:.2f} s); budget {BUDGET_S:.0f} s: "
          f"{'NOT met' if slow else 'met'}")


if __name__ == "__main__":
    main()
