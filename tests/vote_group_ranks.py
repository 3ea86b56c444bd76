"""Real gloo ranks that make the vote's group and vote on it, each reporting the sockets it
opened (tests/test_vote_group.py, the torch seam's test).

Run as ``python -m tests.vote_group_ranks MODE RANKS ROOT``: a fresh interpreter, with no
thread yet, forks the ranks (FileStore rendezvous under ROOT); each writes ROOT/rank<r>.json.
Modes:

* ``seam``: ``torch_seam.lazy_gloo_group()``, a tree MAX on it, then a plain ``new_group``;
* ``vote``: ``vote_group()`` as the Megatron loops make it, a Hook voting on it (a request
  one rank's agent relayed, ``agree``), then ``all_gather_object`` on it, then today's
  ``new_group(backend="gloo")`` as the baseline;
* ``counted``: the world on a backend that is not gloo (``CountedGloo``, registered with torch's
  ``Backend.register_backend``), and a user's ``Hook()`` given no group.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def sockets() -> int:
    """The sockets this process has open (its gloo connections and listeners among them)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor, closed by now
    return count


class CountedGloo(dist.ProcessGroup):
    """A training backend that is not gloo by name (a stand-in for NCCL): every message goes over a
    real gloo group underneath, and ``ops`` counts the messages and collectives it carried."""

    NAME = "counted"

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self.inner = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.ops = 0

    def getBackendName(self) -> str:
        return self.NAME

    def _carry(self, name: str, *args):
        self.ops += 1
        return getattr(self.inner, name)(*args)

    def send(self, tensors, dst, tag):
        return self._carry("send", tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._carry("recv", tensors, src, tag)

    def allreduce(self, tensors, opts=None):
        return self._carry("allreduce", tensors, opts)

    def allgather(self, outputs, inputs, opts=None):
        return self._carry("allgather", outputs, inputs, opts)

    def broadcast(self, tensors, opts=None):
        return self._carry("broadcast", tensors, opts)

    def barrier(self, opts=None):
        return self._carry("barrier", opts)


def _seam(rank: int, ranks: int) -> dict:
    from elasticft import torch_seam
    from elasticft.worker.tree_max import group_max

    before = sockets()
    group = torch_seam.lazy_gloo_group()
    made = sockets()
    agreed = group_max([rank, ranks - rank], group, torch.device("cpu"))
    voted = sockets()
    dist.new_group(backend="gloo")  # the user's own, after eft's: a full mesh as before
    return {"made": made - before, "voted": voted - before, "plain": sockets() - voted, "agreed": agreed,
            "backend": str(dist.get_backend(group)), "env": os.environ.get("TORCH_GLOO_LAZY_INIT")}


def _hook_votes(hook, rank: int, ranks: int, run_dir: Path) -> dict:
    """Three votes, a request relayed to the last rank's agent before the second."""
    from tests.gloo_job import write_request

    actions = []
    for iteration in (1, 2, 3):
        if iteration == 2 and rank == ranks - 1:
            write_request(run_dir, "req-1", reason="manual")
        action = hook.step(iteration, vote=True)
        actions.append([iteration, action.save, action.reason])
    return {"actions": actions, "agreed": hook.agree([rank, 7])}


def _vote(rank: int, ranks: int, run_dir: Path) -> dict:
    from elasticft.worker import Hook
    from elasticft.worker.vote_group import vote_group

    before = sockets()
    hook = Hook(group=vote_group())
    result = _hook_votes(hook, rank, ranks, run_dir)
    voted = sockets()
    everyone: list = [None] * ranks
    dist.all_gather_object(everyone, {"rank": rank}, group=hook.group)
    gathered = sockets()
    dist.new_group(backend="gloo")  # today's group, for the baseline
    return {**result, "voted": voted - before, "gathered": gathered - before, "eager": sockets() - gathered,
            "everyone": everyone, "backend": str(dist.get_backend(hook.group))}


def _counted(rank: int, ranks: int, run_dir: Path) -> dict:
    from elasticft.worker import Hook

    world = dist.group.WORLD
    before, ops = sockets(), world.ops
    hook = Hook()
    result = _hook_votes(hook, rank, ranks, run_dir)
    return {**result, "world_ops": world.ops - ops, "voted": sockets() - before,
            "backend": str(dist.get_backend(hook.group)), "own_group": hook.group is not None}


def _rank(rank: int, mode: str, ranks: int, root: str) -> None:
    run_dir = Path(root) / f"run{rank}"
    run_dir.mkdir()
    os.environ.update(EFT_RUN_DIR=str(run_dir), EFT_VOTE_BUDGET="0")
    backend = "gloo"
    if mode == "counted":
        dist.Backend.register_backend(CountedGloo.NAME, CountedGloo, devices=["cpu"])
        # The stand-in carries sends and collectives, but torch's all_gather_object asks a group for
        # its backend per device, which a Python group lacks: a Hook whose numbers check gathered on
        # it (as before, on the default group) would fail there instead of being counted.
        os.environ["EFT_NUMERICS_CHECK"] = "false"
        backend = CountedGloo.NAME
    dist.init_process_group(backend, init_method=f"file://{root}/init", rank=rank, world_size=ranks)
    result = {"seam": _seam, "vote": lambda r, n: _vote(r, n, run_dir),
              "counted": lambda r, n: _counted(r, n, run_dir)}[mode](rank, ranks)
    dist.barrier()  # no rank leaves while another still talks to it
    (Path(root) / f"rank{rank}.json").write_text(json.dumps(result))


def run(mode: str, ranks: int, root: str) -> None:
    mp.start_processes(_rank, args=(mode, ranks, root), nprocs=ranks, start_method="fork")


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), sys.argv[3])
