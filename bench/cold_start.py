"""Where a worker's cold start goes, phase by phase, and what a warm interpreter would save.

A restart starts fresh worker processes: an interpreter, its imports (torch, megatron-core),
the device, the process group, the model, the first step. Issue 34's warm workers would
start the interpreter and do the imports before the failure. This measures, for one worker:

* cold: a new process does everything after the restart (today);
* warm: a process started ahead did the imports, then waits; the restart hands it "go";
* warm+device: the same, with the device's context made ahead too (only valid where the
  worker keeps its device across restarts).

Each phase is the time from the restart ("go", or the spawn for a cold start) to its end;
the figures are medians of ``--repeat`` runs, same machine, same run.

  python bench/cold_start.py --device cuda [--hidden-size 1024 --num-layers 12] [--repeat 3]
  python bench/cold_start.py --device cpu --no-model      # the machinery, on a machine without a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PHASES = ["interpreter", "import torch", "import megatron-core", "device", "process group", "model built",
          "first step"]
VARIANTS = {"cold": [], "warm": ["--warm"], "warm+device": ["--warm", "--warm-device"]}


def child(args: argparse.Namespace) -> None:
    """The worker: timestamps (time.time) of each phase's end, one JSON line on stdout."""
    stamps = {"interpreter": time.time()}

    def imports() -> None:
        import torch  # noqa: F401

        stamps["import torch"] = time.time()
        if not args.no_model:
            import megatron.core  # noqa: F401
            from megatron.core.models.gpt import GPTModel  # noqa: F401
        stamps["import megatron-core"] = time.time()

    def device() -> None:
        import torch

        if args.device == "cuda":
            torch.cuda.set_device(0)
            torch.zeros(1, device="cuda").add_(1)
            torch.cuda.synchronize()
        stamps["device"] = time.time()

    imports()
    if args.warm_device:
        device()
    if args.warm:
        print("ready", flush=True)
        sys.stdin.readline()  # the restart
        stamps = {k: v for k, v in stamps.items() if k not in PHASES} | {"go": time.time()}
    if "device" not in stamps:
        device()
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    stamps["process group"] = time.time()
    if not args.no_model:
        from megatron.core import parallel_state, tensor_parallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        config = TransformerConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                                   num_attention_heads=args.hidden_size // 64, bf16=True,
                                   params_dtype=torch.bfloat16)
        model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=32000,
                         max_sequence_length=args.seq_length).to(args.device, torch.bfloat16)
        stamps["model built"] = time.time()
        tokens = torch.randint(0, 32000, (1, args.seq_length), device=args.device)
        positions = torch.arange(args.seq_length, device=args.device).unsqueeze(0)
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        if args.device == "cuda":
            torch.cuda.synchronize()
        stamps["first step"] = time.time()
    dist.destroy_process_group()
    print(json.dumps(stamps), flush=True)


def one_run(flags: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Seconds from the restart to each phase's end, for one worker of one variant."""
    command = [sys.executable, __file__, "--child", *flags, "--device", args.device,
               "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers),
               "--seq-length", str(args.seq_length)] + (["--no-model"] if args.no_model else [])
    spawned = time.time()
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if "--warm" in flags:
        assert proc.stdout.readline().strip() == "ready"
        proc.stdin.write("go\n")
        proc.stdin.flush()
    out, _ = proc.communicate(timeout=600)
    stamps = json.loads(out.strip().splitlines()[-1])
    start = stamps.pop("go", spawned)
    return {phase: stamps[phase] - start for phase in PHASES if phase in stamps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warm-device", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--no-model", action="store_true", help="no megatron-core import, model or step")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    medians = {}
    for name, flags in VARIANTS.items():
        runs = [one_run(flags, args) for _ in range(args.repeat)]
        medians[name] = {p: statistics.median(r[p] for r in runs) for p in PHASES if p in runs[0]}
    print(f"one worker's start, seconds from the restart to the end of each phase (median of {args.repeat}); "
          f"device {args.device}" + ("" if args.no_model else
                                     f", GPT {args.num_layers} layers x {args.hidden_size}, bf16"))
    print(f"{'phase':<22}" + "".join(f"{name:>14}" for name in VARIANTS))
    for phase in PHASES:
        if phase in medians["cold"]:
            print(f"{phase:<22}" + "".join(f"{medians[n].get(phase, float('nan')):>14.2f}" for n in VARIANTS))
    cold, warm = medians["cold"], medians["warm"]
    last = PHASES[-1] if PHASES[-1] in cold else "process group"
    print(f"to the {last}: cold {cold[last]:.2f} s, warm {warm[last]:.2f} s ({cold[last] / warm[last]:.1f}x), "
          f"warm+device {medians['warm+device'][last]:.2f} s")


if __name__ == "__main__":
    main()
