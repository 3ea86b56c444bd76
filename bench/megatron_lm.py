"""eft's per-iteration cost inside Megatron-LM's own loop, against the same script under torchrun.

tests/megatron_lm/pretrain_gpt.py (Megatron-LM's loop, unmodified; the test's tiny GPT on
the CPU emulation, 2 ranks, DP2) runs ``--iters`` iterations under each of, in one run:

1. torchrun: the baseline;
2. eft-run, the hook alone (``--no-eft-numerics-check``): the vote, heartbeats, sections;
3. eft-run with the numbers check (the default);
4. eft-run with the memory tier (a snapshot every iteration), and Megatron's own torch_dist
   saves every ``--save-every`` iterations in the same run.

The figure is Megatron's own "elapsed time per iteration", the median over the iterations
after ``--warmup``; each launcher runs ``--repeat`` times and the median run is kept. The
memory tier's stall is its row's time over the hook + numbers check's row; beside it, the
median of Megatron's own timer for a torch_dist save of the same state (``save-checkpoint``,
which Megatron keeps out of the iteration's time).
Needs the Megatron-LM lane's interpreter (``bash .ci/setup_mlm``):

    $(bash .ci/setup_mlm | tail -n 1) bench/megatron_lm.py [--iters 80] [--warmup 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, table  # noqa: E402  (also puts the repo on sys.path)

SCRIPT = ROOT / "tests" / "megatron_lm" / "pretrain_gpt.py"
# A tiny GPT; a constant learning rate, so a run's numbers do not depend on its --train-iters.
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
         "--lr-decay-style", "constant", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--distributed-backend", "gloo",
         "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "1234", "--ckpt-format", "torch_dist"]
# TP > 1 asks for one CUDA connection, as on a GPU; torch.compile's warm-up costs seconds a run.
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCHDYNAMO_DISABLE": "1"}

ELAPSED = re.compile(r"\biteration\s+(\d+)/\s*\d+ \| .*?elapsed time per iteration \(ms\): ([0-9.]+)")
SAVED = re.compile(r"save-checkpoint \.+: \(([0-9.]+), ([0-9.]+)\)")  # Megatron's timer: (min, max) over ranks


def run(launcher: list[str], iters: int, warmup: int, save_every: int = 0, model: tuple[str, ...] = ()
        ) -> tuple[float, list[float]]:
    """Median ms per iteration after the warm-up, from Megatron's own log lines, and the
    ms of each of Megatron's saves (every ``save_every`` iterations; 0: none)."""
    env = {**os.environ, **ENV}
    with tempfile.TemporaryDirectory() as tmp:
        saves = ["--save", f"{tmp}/ckpt", "--save-interval", str(save_every)] if save_every else []
        done = subprocess.run([*launcher, str(SCRIPT), *MODEL, *model, "--train-iters", str(iters), *saves],
                              capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{launcher[2]} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-2000:]}")
    log = done.stdout + done.stderr
    times = {int(i): float(ms) for i, ms in ELAPSED.findall(log)}
    # Megatron's second logged line averages the first two iterations: the warm-up skips it.
    return statistics.median(ms for i, ms in times.items() if i > warmup), [float(m) for _, m in SAVED.findall(log)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=80, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=10, help="iterations left out of the median")
    parser.add_argument("--repeat", type=int, default=3, help="runs per launcher (the median run is kept)")
    parser.add_argument("--save-every", type=int, default=20, help="Megatron's torch_dist saves in the memory tier's run")
    parser.add_argument("--hidden-size", type=int, default=64, help="the test GPT's width (64: the tests' model)")
    parser.add_argument("--num-layers", type=int, default=2, help="the test GPT's depth")
    args = parser.parse_args()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    eft = [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", "2",
           "--eft-health-source", "none"]
    model = ("--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers))
    memory = "eft-run, memory tier (a snapshot every iteration)"
    launchers = {
        "torchrun (baseline)": (torchrun, 0),
        "eft-run, hook alone": ([*eft, "--no-eft-numerics-check"], 0),
        "eft-run, hook + numbers check": (eft, 0),
        memory: ([*eft, "--eft-mem-ckpt-interval", "1"], args.save_every),
    }
    figures, saves = {}, []
    for name, (launcher, save_every) in launchers.items():
        runs = sorted((run(launcher, args.iters, args.warmup, save_every, model) for _ in range(args.repeat)),
                      key=lambda r: r[0])
        figures[name], run_saves = runs[len(runs) // 2]
        saves += run_saves
    base = figures["torchrun (baseline)"]
    rows = [[name, ms, f"{(ms / base - 1) * 100:+.1f} %"] for name, ms in figures.items()]
    print(f"Megatron-LM's loop, GPT {args.num_layers} layers x {args.hidden_size}, 2 ranks DP2 on CPU; "
          f"median of {args.repeat} runs of {args.iters} iterations")
    print(table(["launcher", "ms / iteration", "vs torchrun"], rows))
    stall = figures[memory] - figures["eft-run, hook + numbers check"]
    disk = statistics.median(saves) if saves else float("nan")
    print(f"memory snapshot stall {stall:.2f} ms (its row over the hook + numbers check's) vs Megatron's torch_dist "
          f"save of the same state {disk:.2f} ms (median of {len(saves)}): {stall / disk * 100:.1f} % of a disk save")


if __name__ == "__main__":
    main()
