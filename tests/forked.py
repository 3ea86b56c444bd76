"""Ranks forked from the test process, with nothing of the parent's left to their garbage collector.

A pytest worker has used gRPC (the tests' etcd clients) before it forks ranks. gRPC's core
threads do not exist in a forked child, and a child whose collector frees an inherited gRPC
object calls into that core and can abort mid-test (grpc/grpc#32992: an etcd client, then
torch's forked workers). ``gc.freeze()`` before the fork, Python's own advice for a fork
without exec, puts every inherited object out of the child's collector's reach; the parent
unfreezes once its children are forked (and, with ``join``, have ended).
"""

from __future__ import annotations

import gc
from typing import Callable

import torch.multiprocessing as mp


def start_processes(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True):
    """``torch.multiprocessing.start_processes(..., start_method="fork")`` with the parent's objects frozen."""
    gc.collect()
    gc.freeze()
    try:
        return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="fork")
    finally:
        gc.unfreeze()
