"""A minimal elastic training loop: DDP on synthetic data, checkpoint and resume.

Run it under eft-run (or torchrun); kill a node and the survivors resume from the
last checkpoint with the new world size. It stands in for the Megatron GPT example
until that lands.

  eft-run --standalone --nproc-per-node 2 examples/minimal_train.py --steps 50
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--save", default=os.path.join(os.getcwd(), "minimal-ckpt"))
    parser.add_argument("--save-interval", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    path = os.path.join(args.save, "latest.pt")
    step = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
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
        step += 1
        if step % args.save_interval == 0 and rank == 0:
            os.makedirs(args.save, exist_ok=True)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
            torch.save(state, path + ".tmp")
            os.replace(path + ".tmp", path)  # never a half-written "latest"
            print(f"step {step} loss {loss.item():.4f} (saved)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
