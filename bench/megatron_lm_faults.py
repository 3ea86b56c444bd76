"""An emergency save and a hung rank in Megatron-LM's own loop under eft-run, timed.

One eft-run job runs tests/megatron_lm/pretrain_gpt.py (megatron.training's loop, unmodified)
with a memory snapshot every iteration. After iteration ``--save-at``, ``eft ckpt save`` asks
for an emergency save: Megatron's own torch_dist save, at one iteration on every rank, marked
complete and acknowledged. After iteration ``--hang-at``, rank 0 hangs inside its next step;
eft's step timeout (``--step-timeout``) catches it, logs its stacks and restarts the workers,
which resume from the newest tier (memory). Printed: the emergency save's iteration and time
(Megatron's own timer), the median iteration with a snapshot every iteration, where the restart
resumed and what was re-done, and the time from the last step before the hang to the first step
after the restart, of which the step timeout is the detection. (The snapshot's stall against a
disk save is bench/megatron_lm.py's.)

On the CPU emulation (2 ranks, gloo, fp32) with the lane's interpreter, or on a GPU
(``--device cuda``: 1 rank, nccl, bf16)::

    $(bash .ci/setup_mlm | tail -n 1) bench/megatron_lm_faults.py [--device cuda --hidden-size 1024 ...]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table  # noqa: E402  (also puts the repo on sys.path)
from launch import Launched, wait_for  # noqa: E402
from megatron_lm import ENV, SAVED, SCRIPT, model_args  # noqa: E402

RESUMED = re.compile(r"workers resumed from iteration (\w+) \((\w+)\); (\d+) iteration\(s\) re-done")
ACKED = re.compile(r"checkpoint of iteration (\d+) complete at ")
HUNG = re.compile(r"hang: rank (\d+) .*section '(\w+)' for ([0-9.]+) s")
ENDPOINT = re.compile(r"embedded etcd on (\S+) \(run id (\S+)\)")


def numbers(path: Path) -> list[dict]:
    """Every iteration's record, in the order written (a re-done iteration appears twice)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu emulation or the GPUs")
    parser.add_argument("--hidden-size", type=int, default=64, help="the test GPT's width")
    parser.add_argument("--num-layers", type=int, default=2, help="the test GPT's depth")
    parser.add_argument("--seq-length", type=int, default=32, help="the test GPT's sequence length")
    parser.add_argument("--iters", type=int, default=30, help="iterations of the job")
    parser.add_argument("--save-at", type=int, default=8, help="iteration after which eft ckpt save is asked")
    parser.add_argument("--hang-at", type=int, default=18, help="iteration after which rank 0 hangs in its step")
    parser.add_argument("--step-timeout", type=float, default=10.0, help="eft's step section timeout (s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the whole job may take")
    args = parser.parse_args()
    nproc = "1" if args.device == "cuda" else "2"
    health = "nvml" if args.device == "cuda" else "none"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        ckpt, record = out / "ckpt", out / "numbers.jsonl"
        cmd = [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", nproc,
               "--monitor-interval", "0.1", "--eft-health-source", health, "--max-restarts", "1",
               "--eft-mem-ckpt-interval", "1", "--eft-timeouts", f"step={args.step_timeout:g}",
               "--eft-inject", f"rank_hung:0@{args.hang_at}", str(SCRIPT),
               *model_args(args.device, args.hidden_size, args.num_layers, args.seq_length),
               "--train-iters", str(args.iters), "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "100000"]
        job = Launched(cmd, out / "job.log", env={**ENV, "EFT_TEST_NUMBERS": str(record)})
        try:
            wait_for(lambda: any(r["iteration"] >= args.save_at for r in numbers(record)) or job.proc.poll() is not None,
                     args.timeout, f"iteration {args.save_at}")
            endpoint, run_id = ENDPOINT.search(job.output()).groups()
            subprocess.run([sys.executable, "-m", "launcher.cli", "ckpt", "save", "--endpoint", endpoint,
                            "--run-id", run_id], check=True, capture_output=True, timeout=60)
            asked = time.time()  # the request is in etcd
            code = job.wait(args.timeout)
            log = job.output()
        finally:
            job.stop()
        if code != 0:
            raise SystemExit(f"the job failed ({code}):\n{log[-4000:]}")
        report(args, log, numbers(record), asked)


def report(args, log: str, records: list[dict], asked: float) -> None:
    saves = [float(m) for _, m in SAVED.findall(log)]
    acked = ACKED.findall(log)
    resumed = RESUMED.findall(log)
    hung = HUNG.findall(log)
    times = [r["time"] for r in records]
    first_resumed = next(i for i, r in enumerate(records) if i and r["iteration"] <= records[i - 1]["iteration"])
    last_before, first_after = records[first_resumed - 1], records[first_resumed]
    steps = [b - a for a, b in zip(times, times[1:])]
    print(f"Megatron-LM's loop under eft-run on {args.device}: GPT {args.num_layers} layers x {args.hidden_size}, "
          f"seq {args.seq_length}, {args.iters} iterations, a memory snapshot every iteration")
    rows = [
        ["eft ckpt save: Megatron's torch_dist save (its timer)",
         f"iteration {acked[0]}, {saves[0]:.0f} ms" if saves and acked else "n/a"],
        ["iteration with a snapshot (median wall)", f"{statistics.median(steps[2:first_resumed - 1]) * 1000:.0f} ms"],
        ["hang caught", f"rank {hung[0][0]} in section '{hung[0][1]}' after {float(hung[0][2]):.1f} s"
         if hung else "no"],
        ["resumed from", f"iteration {resumed[0][0]} ({resumed[0][1]}), {resumed[0][2]} re-done" if resumed else "n/a"],
        ["last step before the hang -> first step after the restart",
         f"{first_after['time'] - last_before['time']:.1f} s (step timeout {args.step_timeout:g} s of it)"],
        ["stacks of the hung rank in the log", "yes" if re.search(r"stacks of rank \d+|prints its stacks", log) else "no"],
    ]
    print(table(["what", "measured"], rows))
    asked_after = max((r["iteration"] for r in records if r["time"] <= asked), default=0)
    print(f"(eft ckpt save's request was in etcd after iteration {asked_after}; the save answered it at the "
          f"next vote)")


if __name__ == "__main__":
    main()
