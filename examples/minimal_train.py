"""A minimal elastic training loop wired to eft: DDP on synthetic data, checkpoints, the hook.

Run it under eft-run (or torchrun, where the hook is inert). Kill a node and the
survivors resume from the last complete checkpoint with the new world size; run
`eft ckpt save` (or touch the --eft-save-switch file) and every rank saves the same
iteration. It stands in for the Megatron GPT example until that lands.

  eft-run --standalone --nproc-per-node 2 examples/minimal_train.py --steps 50
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticft.worker import CheckpointDir, Hook


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--save", default=os.path.join(os.getcwd(), "minimal-ckpt"))
    parser.add_argument("--save-interval", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="extra time per step (a model's compute)")
    parser.add_argument("--log-interval", type=int, default=0,
                        help="rank 0 prints 'iteration N loss X' every N steps (0: only at saves)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    checkpoints = CheckpointDir(args.save, keep=2)

    def load(path: str, step: int) -> None:
        state = torch.load(os.path.join(path, "model.pt"))
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    step, _ = checkpoints.load_latest(load)
    step = step or 0
    hook = Hook(save_interval=args.save_interval, last_saved_iteration=step)
    if rank == 0:
        print(f"world size {world}, starting at step {step}", flush=True)

    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    while step < args.steps:
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(32, 16, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_seconds)
        step += 1
        action = hook.step(step)
        if rank == 0 and args.log_interval and step % args.log_interval == 0:
            print(f"iteration {step} loss {loss.item():.4f}", flush=True)
        if action.save or step % args.save_interval == 0:
            started = time.time()
            path = checkpoints.path_for(step)
            if rank == 0:  # DDP replicas are identical: one copy is the checkpoint
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict()},
                           os.path.join(path, "model.pt"))
            dist.barrier()
            if rank == 0:
                checkpoints.commit(step)
                print(f"step {step} loss {loss.item():.4f} (saved{', ' + action.reason if action.reason else ''})",
                      flush=True)
            hook.saved(step, path, time.time() - started)
        if action.exit:
            if rank == 0:
                print(f"stopped at step {step}: {action.reason}", flush=True)
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
