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
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, table  # noqa: E402  (also puts the repo on sys.path)

from elasticft.contract.checkpoints import COMPLETE_MARKER  # noqa: E402
from elasticft.contract.run_dir import OUTBOX_DIR, OutboxKind  # noqa: E402

# Host memory for --agent none's snapshots (no agent prunes them: the run's directory goes after it).
MEMORY = os.environ.get("EFT_MEM_CKPT_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)

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
# On a GPU: nccl and bf16, and no fused kernel that needs Transformer Engine or apex (the local layer
# spec runs on plain torch); the test GPT's width and depth come from the bench's flags.
ON_GPU = ["--distributed-backend", "nccl", "--bf16", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
          "--no-bias-dropout-fusion", "--no-rope-fusion"]


def model_args(device: str, hidden_size: int, num_layers: int, seq_length: int = 32) -> list[str]:
    """The test GPT's arguments at a size, for the CPU emulation or a GPU (Megatron's parser keeps
    the last of a repeated flag)."""
    sized = ["--hidden-size", str(hidden_size), "--num-layers", str(num_layers), "--seq-length", str(seq_length),
             "--max-position-embeddings", str(seq_length), "--num-attention-heads", str(max(4, hidden_size // 128))]
    if device == "cuda":
        sized += ["--vocab-size", "32000", *ON_GPU]
    return [*MODEL, *sized]

ELAPSED = re.compile(r"\biteration\s+(\d+)/\s*\d+ \| .*?elapsed time per iteration \(ms\): ([0-9.]+)")
SAVED = re.compile(r"save-checkpoint \.+: \(([0-9.]+), ([0-9.]+)\)")  # Megatron's timer: (min, max) over ranks


def run(launcher: list[str], iters: int, warmup: int, save_every: int = 0, model: list[str] = MODEL,
        worker_env: dict | None = None) -> tuple[float, list[float], str]:
    """Median ms per iteration after the warm-up, from Megatron's own log lines, the ms of each
    of Megatron's saves (every ``save_every`` iterations; 0: none), and the log.

    ``worker_env`` (``--agent none``): eft's worker side under this launcher, with the run
    directory and variables eft-run gives its workers, plus these; a ``request`` key writes a
    checkpoint request into the run directory first, as an agent relays ``eft ckpt save``."""
    env = {**os.environ, **ENV}
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(prefix="eft-bench-", dir=MEMORY) as mem:
        wanted = save_every or (worker_env is not None and "request" in worker_env)
        saves = ["--save", f"{tmp}/ckpt", "--save-interval", str(save_every or 100000)] if wanted else []
        if worker_env is not None:
            env.update(agentless_env(Path(tmp), Path(mem), worker_env))
        done = subprocess.run([*launcher, str(SCRIPT), *model, "--train-iters", str(iters), *saves],
                              capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
        log = done.stdout + done.stderr
        if worker_env is not None:  # what an agent would have read: the request's marker, the snapshots' stalls
            log += "".join(f"\ncomplete marker: {p.parent.name}" for p in Path(tmp, "ckpt").glob(f"*/{COMPLETE_MARKER}"))
            for message in sorted(Path(tmp, "run", OUTBOX_DIR).glob("*.json")):
                record = json.loads(message.read_text())
                if record.get("type") == OutboxKind.MEM_SAVED:
                    log += f"\nsnapshot of iteration {record['iteration']}: stall {record['stall']:.4f} s, " \
                           f"written in {record['seconds']:.2f} s, {record['bytes']} bytes"
    if done.returncode != 0:
        raise SystemExit(f"{launcher[2]} failed ({done.returncode}):\n{log[-6000:]}")
    times = {int(i): float(ms) for i, ms in ELAPSED.findall(log)}
    # Megatron's second logged line averages the first two iterations: the warm-up skips it.
    return statistics.median(ms for i, ms in times.items() if i > warmup), [float(m) for _, m in SAVED.findall(log)], log


def agentless_env(tmp: Path, mem: Path, extra: dict) -> dict:
    """What eft-run gives a Megatron-LM job's workers (the run directory, its boot directory
    first on PYTHONPATH, memory snapshots in ``mem``), with ``extra``'s EFT_* knobs."""
    from elasticft.contract.records import CheckpointRequest, RequestReason
    from elasticft.contract.run_dir import REQUEST_FILE, WorkerEnv, write_atomically
    from elasticft.megatron_lm.mode import worker_environment

    run_dir = tmp / "run"
    run_dir.mkdir()
    env = {WorkerEnv.RUN_DIR.value: str(run_dir), WorkerEnv.MEM_DIR.value: str(mem),
           **{k: v for k, v in extra.items() if k != "request"}}
    env.update(worker_environment("on", str(SCRIPT), []))  # eft's boot directory first on PYTHONPATH
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT)])
    if "request" in extra:  # answered at the first vote: Megatron's save of iteration 1
        write_atomically(run_dir / REQUEST_FILE, CheckpointRequest("bench", RequestReason.MANUAL.value).to_json())
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=80, help="iterations per run")
    parser.add_argument("--warmup", type=int, default=10, help="iterations left out of the median")
    parser.add_argument("--repeat", type=int, default=3, help="runs per launcher (the median run is kept)")
    parser.add_argument("--save-every", type=int, default=20, help="Megatron's torch_dist saves in the memory tier's run")
    parser.add_argument("--hidden-size", type=int, default=64, help="the test GPT's width (64: the tests' model)")
    parser.add_argument("--num-layers", type=int, default=2, help="the test GPT's depth")
    parser.add_argument("--seq-length", type=int, default=32, help="the test GPT's sequence length")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the CPU emulation, gloo, fp32; cuda: the GPUs, nccl, bf16 (no TE or apex needed)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (data parallel; default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--agent", choices=("eft-run", "none"), default="eft-run",
                        help="none: eft's worker side alone, under torchrun with the run directory and variables "
                             "eft-run gives its workers (for a torch eft's agent does not support); its hook row "
                             "also answers a checkpoint request through Megatron's save")
    args = parser.parse_args()
    nproc = str(args.nproc or (1 if args.device == "cuda" else 2))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", nproc]
    health = "nvml" if args.device == "cuda" else "none"
    eft = [sys.executable, "-m", "launcher.eft_run", "--standalone", "--nproc-per-node", nproc,
           "--eft-health-source", health]
    model = model_args(args.device, args.hidden_size, args.num_layers, args.seq_length)
    memory = "eft, memory tier (a snapshot every iteration)"
    if args.agent == "none":  # the launcher is torchrun; eft is in the workers alone
        launchers = {
            "torchrun (baseline)": (torchrun, 0, None),
            "eft, hook alone": (torchrun, 0, {"EFT_NUMERICS_CHECK": "0", "request": True}),
            "eft, hook + numbers check": (torchrun, 0, {}),
            memory: (torchrun, args.save_every, {"EFT_MEM_CKPT_INTERVAL": "1"}),
        }
    else:
        launchers = {
            "torchrun (baseline)": (torchrun, 0, None),
            "eft, hook alone": ([*eft, "--no-eft-numerics-check"], 0, None),
            "eft, hook + numbers check": (eft, 0, None),
            memory: ([*eft, "--eft-mem-ckpt-interval", "1"], args.save_every, None),
        }
    figures, saves, logs = {}, [], {}
    for name, (launcher, save_every, worker_env) in launchers.items():
        runs = sorted((run(launcher, args.iters, args.warmup, save_every, model, worker_env)
                       for _ in range(args.repeat)), key=lambda r: r[0])
        figures[name], run_saves, logs[name] = runs[len(runs) // 2]
        if name == memory:
            saves += run_saves
        print(f"{name}: {figures[name]:.2f} ms / iteration", file=sys.stderr, flush=True)
    base = figures["torchrun (baseline)"]
    rows = [[name, ms, f"{(ms / base - 1) * 100:+.1f} %"] for name, ms in figures.items()]
    where = "CPU (fp32, gloo)" if args.device == "cpu" else "GPU (bf16, nccl)"
    agent = "eft-run" if args.agent == "eft-run" else "eft's worker side under torchrun, no agent"
    print(f"Megatron-LM's loop, GPT {args.num_layers} layers x {args.hidden_size}, seq {args.seq_length}, "
          f"{nproc} rank(s) DP{nproc} on {where}, {agent}; "
          f"median of {args.repeat} runs of {args.iters} iterations")
    print(table(["launcher", "ms / iteration", "vs torchrun"], rows))
    stall = figures[memory] - figures["eft, hook + numbers check"]
    disk = statistics.median(saves) if saves else float("nan")
    print(f"memory snapshot stall {stall:.2f} ms (its row over the hook + numbers check's) vs Megatron's torch_dist "
          f"save of the same state {disk:.2f} ms (median of {len(saves)}): {stall / disk * 100:.1f} % of a disk save")

    if args.agent == "none":  # the request written before the start: answered by Megatron's save at iteration 1
        hook_log = logs["eft, hook alone"]
        saved = re.findall(r"successfully saved checkpoint from iteration\s+(\d+)", hook_log)
        marked = re.findall(r"complete marker: (\S+)", hook_log)
        print(f"checkpoint request answered: Megatron saved iteration(s) {saved}, marked complete: {marked}")
        snapshots = re.findall(r"snapshot of iteration (\d+): stall ([0-9.]+) s, written in ([0-9.]+) s, (\d+) bytes",
                               logs[memory])
        if snapshots:
            stalls = [float(s[1]) * 1000 for s in snapshots]
            print(f"memory snapshots: {len(snapshots)} of {args.iters} iterations (one at a time, the next waits for "
                  f"the write), {int(snapshots[-1][3]) / 1e9:.2f} GB each; stall per snapshot: median "
                  f"{statistics.median(stalls):.1f} ms, max {max(stalls):.1f} ms "
                  f"({statistics.median(stalls) / disk * 100:.1f} % of the disk save); written in "
                  f"{statistics.median(float(s[2]) for s in snapshots):.2f} s on a thread")


if __name__ == "__main__":
    main()
