"""A toy training loop wired to eft's worker hook, with Megatron-style checkpoints.

Usage: toy_train.py OUT --ckpt DIR --iters N [--save-interval K] [--iter-time S]
                    [--save-delay S] [--slow RANK:SECONDS] [--keep K] [--ckpt-bytes B]
                    [--megatron args are ignored]
Faults from --eft-inject (rank_hung, rank_killed, ...) fire after each iteration.
Every rank appends JSON lines to OUT/events.jsonl: resume (the iteration it starts
from), save (iteration, reason), exit. Rank 0 writes OUT/run.json with EFT_ENDPOINT
and EFT_RUN_ID so a test can talk to the run. The model state is one number per rank,
the count of iterations trained, so a resume shows exactly what was lost.
"""

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist

from elasticft.worker import CheckpointDir, Hook
from elasticft.worker.inject import FaultInjector

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--ckpt", "--save", dest="ckpt", required=True)
parser.add_argument("--iters", type=int, required=True)
parser.add_argument("--save-interval", type=int, default=0)
parser.add_argument("--iter-time", type=float, default=0.05)
parser.add_argument("--save-delay", type=float, default=0.0, help="rank 0 stalls this long mid-save")
parser.add_argument("--slow", default="", help="RANK:SECONDS: that rank's work takes this much longer per step")
parser.add_argument("--keep", type=int, default=2, help="complete checkpoints kept (Megatron-LM keeps them all)")
parser.add_argument("--ckpt-bytes", type=int, default=0, help="each rank's checkpoint carries this many more bytes")
parser.add_argument("--exit-signal-handler", action="store_true",
                    help="no eft hook: save and exit on SIGTERM, as Megatron-LM's flag of that name does")
args, _ = parser.parse_known_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
slow_rank, _, slow_seconds = args.slow.partition(":")
extra_time = float(slow_seconds) if args.slow and int(slow_rank) == rank else 0.0


def record(event: str, **fields) -> None:
    with open(os.path.join(args.out, "events.jsonl"), "a") as f:
        f.write(json.dumps({"rank": rank, "world_size": world, "event": event, "time": time.time(), **fields}) + "\n")


if rank == 0:
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump({"endpoint": os.environ.get("EFT_ENDPOINT"), "run_id": os.environ.get("EFT_RUN_ID")}, f)

checkpoints = CheckpointDir(args.ckpt, keep=args.keep)


def load(path, _iteration):
    """This rank's state; in a world that grew since the save, rank 0's (every rank's count is the same)."""
    own = os.path.join(path, f"rank{rank}.pt")
    return torch.load(own if os.path.exists(own) else os.path.join(path, "rank0.pt"))


resumed, state = checkpoints.load_latest(load)
iteration = resumed or 0
trained = state["trained"] if state else torch.zeros(1)
if args.exit_signal_handler:
    import signal

    class MegatronStyle:
        """What unmodified Megatron-LM does: a SIGTERM flag, agreed across ranks, save, exit."""

        def __init__(self):
            self.received = False
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "received", True))

        def step(self, _iteration):
            flag = torch.tensor([1.0 if self.received else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            hit = flag.item() > 0
            return argparse.Namespace(save=hit, exit=hit, reason="signal" if hit else None, request_id=None)

        def saved(self, *_):
            pass

        def section(self, _name):
            return contextlib.nullcontext()

        def compute(self):
            return contextlib.nullcontext()

        def close(self):
            pass

    hook = MegatronStyle()
else:
    hook = Hook(save_interval=args.save_interval or None, last_saved_iteration=resumed)
record("resume", iteration=iteration, pid=os.getpid())
injector = FaultInjector.from_env()

while iteration < args.iters:
    with hook.compute():
        time.sleep(args.iter_time + extra_time)
    trained += 1
    dist.all_reduce(torch.zeros(1))  # a collective per step, like real training
    iteration += 1
    action = hook.step(iteration)
    decided = time.time()
    periodic = args.save_interval and iteration % args.save_interval == 0
    if action.save or periodic:
        started = time.time()
        with hook.section("checkpointing"):
            path = checkpoints.path_for(iteration)
            torch.save({"trained": trained, "iteration": iteration, "weights": torch.zeros(args.ckpt_bytes, dtype=torch.uint8)},
                       os.path.join(path, f"rank{rank}.pt"))
            if rank == 0 and args.save_delay:
                time.sleep(args.save_delay)  # a slow file system: the window a crash can hit
            dist.barrier()
            if rank == 0:
                checkpoints.commit(iteration)
        hook.saved(iteration, str(path), time.time() - started)
        record("save", iteration=iteration, reason=action.reason or "periodic", request_id=action.request_id,
               decided=decided)
    if action.exit:
        record("exit", iteration=iteration)
        break
    injector.after_iteration(iteration)

hook.close()
dist.destroy_process_group()
