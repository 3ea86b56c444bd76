"""How bench/mem_ckpt.py measures: the slowest rank's seconds, medians, peak RSS, tmpfs bytes,
a cold page cache, and a stand-in for an iteration's forward and backward."""

from __future__ import annotations

import ctypes
import os
import statistics
import threading
import time
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

MAX, SUM = dist.ReduceOp.MAX, dist.ReduceOp.SUM


def rss_growth(fn) -> int:
    """Peak growth of this process's RSS while ``fn`` runs: psutil sampled every millisecond
    and the kernel's high-water mark (VmHWM, reset first where it can be)."""
    proc, done = psutil.Process(), threading.Event()
    ctypes.CDLL(None).malloc_trim(0)  # freed heap memory back to the OS: RSS is what is in use
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM
        reset = True
    except OSError:
        reset = False
    base = peak = proc.memory_info().rss

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.001):
            peak = max(peak, proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    fn()
    done.set()
    sampler.join()
    hwm = [int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
           if reset and line.startswith("VmHWM:")]
    return max([peak, *hwm]) - base


def reduce(op, value: float) -> float:
    """``value`` reduced over the ranks: the slowest rank's seconds (MAX), the node's bytes (SUM)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def medians(repeat: int, once) -> list:
    """The medians of the values ``once(i)`` returns over ``repeat`` runs after a warm-up (i = 0)."""
    runs = [once(i) for i in range(repeat + 1)][1:]
    return [statistics.median(values) for values in zip(*runs)]


def timed(fn, before=None, after=None) -> float:
    """The slowest rank's seconds in ``fn``; ``before`` and ``after`` are not timed."""
    if before:
        before()
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    seconds = reduce(MAX, time.perf_counter() - start)
    if after:
        after(result)
    return seconds


def tmpfs_bytes(path: Path) -> int:  # allocated blocks, not apparent sizes
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file())


def drop_page_cache() -> str | None:
    """None once the page cache is dropped, else why not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


class StandIn:
    """The next iteration's forward and backward: float32 matmuls on ``device``, as many as
    take ``seconds`` alone on this machine (measured once). On a CPU they share the cores and
    the memory bandwidth with an overlapped copy; on a GPU, the device with its copy engine."""

    SIZE = 512

    def __init__(self, seconds: float, device: str = "cpu"):
        self._cuda = device == "cuda"
        self._a = torch.randn(self.SIZE, self.SIZE, device=device)
        self._b = torch.randn(self.SIZE, self.SIZE, device=device)
        self.matmuls = 8
        while (took := self()) < min(seconds, 0.5) / 4:
            self.matmuls *= 2
        self.matmuls = max(1, int(self.matmuls * seconds / took))

    def __call__(self) -> float:
        """Run it; its seconds."""
        began = time.perf_counter()
        for _ in range(self.matmuls):
            self._a @ self._b
        if self._cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - began
