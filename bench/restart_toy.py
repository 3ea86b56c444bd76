"""A worker that imports torch and megatron-core and does nothing else heavy (bench/restart.py).

It stands for the part of a real job's restart that warm workers remove: the interpreter and
its imports. One gloo process group, a tiny all_reduce per step, eft's hook for heartbeats
(and ``--eft-inject``'s faults, through eft's injector); no model, no checkpoint.

Its opening is in the shape of NVIDIA's ``pretrain_gpt.py`` (core_v0.19.0): a timestamp
before the heavy imports, then torch, then a module of its own beside it that imports
megatron-core (NVIDIA's ``gpt_builders.py``), then more of megatron-core: what ``--eft-preload
auto`` must read through to warm a real Megatron-LM script.
"""

# The program's start, before the heavy imports (as NVIDIA's script takes it).
import time

_PROGRAM_START_TIME = time.time()

import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from restart_toy_builders import build  # noqa: E402 - the script's own module, beside it
from megatron.core import parallel_state  # noqa: E402

from elasticft.worker import Hook  # noqa: E402
from elasticft.worker.inject import FaultInjector  # noqa: E402
from elasticft.worker.phases import watch_process_group  # noqa: E402


def main(steps: int) -> None:
    assert build() and parallel_state  # imported for their cost alone
    watch_process_group()  # eft report: the imports end at init_process_group's call
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
