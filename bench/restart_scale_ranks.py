"""Gloo ranks as threads of one process against one process per rank (``restart_scale.py --ranks``).

The restart harness runs each worker stand-in as a thread holding a ``ProcessGroupGloo`` it
made directly: 1,024 processes that import torch do not fit this machine. Both ways here do
the same: connect to one TCPStore, make the vote's gloo group (eager full mesh, or lazily
connected), one tree vote; timed from a common start (after the imports) to the last rank done.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import threading
import time

from common import table

TIMEOUT = datetime.timedelta(seconds=60)


def _one_rank(port: int, rank: int, size: int, prefix: str) -> float:
    import torch
    import torch.distributed as dist

    from restart_scale_node import use_direct_groups

    from elasticft.worker import tree_max

    use_direct_groups()  # tree_max's calls to a directly made group

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, TIMEOUT)
    tree_max.tree_max_(torch.tensor([rank, 1], dtype=torch.int64), group)
    return time.time()


def _process(port, rank, size, prefix, lazy, ready, go, done) -> None:
    if lazy:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    import restart_scale_node  # noqa: F401 - the imports (torch, eft) come before the clock starts

    ready.put(rank)
    go.wait()
    done.put(_one_rank(port, rank, size, prefix))


def as_processes(size: int, lazy: bool) -> float:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    ctx = multiprocessing.get_context("spawn")
    ready, go, done = ctx.Queue(), ctx.Event(), ctx.Queue()
    children = [ctx.Process(target=_process, args=(server.port, r, size, "p/", lazy, ready, go, done))
                for r in range(size)]
    for child in children:
        child.start()
    for _ in children:
        ready.get(timeout=300)
    began = time.time()
    go.set()
    ended = max(done.get(timeout=120) for _ in children)
    for child in children:
        child.join(30)
    return ended - began


def as_threads(size: int, prefix: str) -> float:
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    ends: list[float] = []
    began = time.time()
    threads = [threading.Thread(target=lambda r=r: ends.append(_one_rank(server.port, r, size, prefix)))
               for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(ends) - began


def _threads_child(size: int, lazy: bool, out) -> None:
    if lazy:
        os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    out.put(as_threads(size, "t/"))


def compare(sizes: list[int]) -> None:
    ctx = multiprocessing.get_context("spawn")
    rows = []
    for size in sizes:
        for lazy in (False, True):
            out = ctx.Queue()
            child = ctx.Process(target=_threads_child, args=(size, lazy, out))  # its own TORCH_GLOO_LAZY_INIT
            child.start()
            threads = out.get(timeout=300)
            child.join(30)
            procs = as_processes(size, lazy)
            rows.append([size, "lazy" if lazy else "eager", threads, procs, procs / threads])
            print(rows[-1], flush=True)
    print()
    print("one TCPStore, the vote's gloo group made and one tree vote, every rank; seconds from a common start")
    print(table(["ranks", "vote group", "threads of one process s", "one process per rank s", "processes/threads"],
                rows))
