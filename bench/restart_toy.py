"""A worker that imports torch and megatron-core and does nothing else heavy (bench/restart.py).

It stands for the part of a real job's restart that warm workers remove: the interpreter and
its imports. One gloo process group, a tiny all_reduce per step, eft's hook for heartbeats
(and ``--eft-inject``'s faults, through eft's injector); no model, no checkpoint.
"""

import sys
import time

import megatron.core  # the import a real job pays for at every restart
import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel

from elasticft.worker import Hook
from elasticft.worker.inject import FaultInjector


def main(steps: int) -> None:
    assert megatron.core.__version__ and GPTModel  # imported for their cost alone
    dist.init_process_group("gloo")
    hook = Hook()
    injector = FaultInjector.from_env()  # --eft-inject: the bench's SIGKILL
    value = torch.ones(1)
    for iteration in range(1, steps + 1):
        dist.all_reduce(value)
        time.sleep(0.05)  # a step
        hook.step(iteration)
        injector.after_iteration(iteration)
    hook.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40)
