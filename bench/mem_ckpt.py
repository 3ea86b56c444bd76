"""Memory checkpoints (issue 14): the training stall of a snapshot, and restores from memory.

A megatron-core sharded state dict (``--tensors`` float32 ShardedTensors and one small
ShardedObject, ``size / ranks`` MB per rank) in a gloo group of ``--ranks`` forked ranks on
this machine, for each of ``--sizes`` MB per node. Baselines measured in the same run:

1. Stall: ``Snapshot.start`` (the memory tier's save: copy to host memory, then plan;
   the torch_dist write runs on a thread) into tmpfs, against a synchronous
   ``dist_checkpointing.save(..., ("torch_dist", 1))`` of the same state to ``--disk-dir``
   (not tmpfs). Also the time until the snapshot is complete (write + finalize).
2. Restore: ``dist_checkpointing.load`` from the tmpfs part, and from a replica (the part
   pushed over HTTP on 127.0.0.1 to a second tmpfs "node", then fetched back to a third
   dir and loaded; or read by each rank's byte ranges during the load, as a restart does),
   against a load from the disk dir with the page cache dropped.
3. Host memory: bytes in tmpfs per snapshot against the state's bytes; peak RSS growth
   of the ranks during a snapshot (and during the disk save, for comparison).

Times: the median of ``--repeat`` runs after a warm-up, the slowest rank's. Each size runs in
fresh processes and deletes as it goes: host memory peaks at ~3× the state.

    python bench/mem_ckpt.py [--sizes 50,500,2000 | --quick] [--repeat 3] [--ranks 1] [--disk-dir DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import ROOT, table  # noqa: E402  (also puts the repo on sys.path)
from mem_replication import Replication  # noqa: E402

if not torch.cuda.is_available():  # megatron-core needs it before its first import
    sys.path.insert(0, str(ROOT / "examples" / "gpt3"))
    import cpu_mode  # noqa: E402

    cpu_mode.enable()

MB = 1_000_000
MAX, SUM = dist.ReduceOp.MAX, dist.ReduceOp.SUM
COLS = 1024  # float32 columns of every tensor: 4 KiB rows

from elasticft.contract.memory import RestoreCandidate  # noqa: E402
from elasticft.worker import snapshot  # noqa: E402
from elasticft.worker.ranged_reads import ranged_reads  # noqa: E402


# -- the state -----------------------------------------------------------------------

def _tensors(rank: int, ranks: int, mb: float, count: int, device: str) -> list[torch.Tensor]:
    rows = max(1, int(mb * MB / ranks / count / (4 * COLS)))
    return [torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rank * count + i)).to(device)
            for i in range(count)]


def _sharded(tensors: list[torch.Tensor], rank: int, ranks: int, iteration: int = 0) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    state = {f"layer{i}.weight": ShardedTensor.from_rank_offsets(f"layer{i}.weight", t, (0, rank, ranks))
             for i, t in enumerate(tensors)}
    state["extra"] = ShardedObject("extra", {"iteration": iteration, "rank": rank, "rng": list(range(64))},
                                   (ranks,), (rank,))
    return state


def _check(loaded: dict, sums: list[float], rank: int) -> None:
    """The loaded tensors are the saved ones (a float64 sum per tensor) and so is the object."""
    for i, expected in enumerate(sums):
        got = loaded[f"layer{i}.weight"].sum(dtype=torch.float64).item()
        assert abs(got - expected) <= 1e-6 * max(1.0, abs(expected)), f"layer{i}: sum {got} != {expected}"
    assert loaded["extra"]["rank"] == rank, loaded["extra"]


# -- measuring -----------------------------------------------------------------------


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


def _reduce(op, value: float) -> float:
    """``value`` reduced over the ranks: the slowest rank's seconds (MAX), the node's bytes (SUM)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def _medians(repeat: int, once) -> list:
    """The medians of the values ``once(i)`` returns over ``repeat`` runs after a warm-up (i = 0)."""
    runs = [once(i) for i in range(repeat + 1)][1:]
    return [statistics.median(values) for values in zip(*runs)]


def _timed(fn, before=None, after=None) -> float:
    """The slowest rank's seconds in ``fn``; ``before`` and ``after`` are not timed."""
    if before:
        before()
    dist.barrier()
    start = time.perf_counter()
    result = fn()
    seconds = _reduce(MAX, time.perf_counter() - start)
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


# -- one size, on every rank -------------------------------------------------------------


def _rank_main(rank: int, ranks: int, mb: float, count: int, repeat: int, shm: str, disk: str,
               device: str = "cpu") -> None:
    from megatron.core import dist_checkpointing

    if device == "cuda":  # the state on the GPU: the snapshot's stall is the device-to-host copy
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", init_method=f"file://{shm}/init",
                            rank=rank, world_size=ranks)
    snapshot.in_process_results_queue()  # the disk saves too: no spawned Manager at the first save
    tensors = _tensors(rank, ranks, mb, count, device)
    sums = [t.sum(dtype=torch.float64).item() for t in tensors]
    lead, root, disk_dir, restore_dir = rank == 0, Path(shm), Path(disk) / "iter_0000001", Path(shm) / "restore"
    out: dict = {"state_bytes": _reduce(SUM, sum(t.numel() * t.element_size() for t in tensors)),
                 "tensor_shape": list(tensors[0].shape)}
    replication = Replication(root, 1) if lead else None
    part = [str(replication.part if replication else root / "node-a" / "iter_0000001")]
    dist.broadcast_object_list(part, src=0)
    part = Path(part[0])

    def state(i: int = 0) -> dict:
        return _sharded(tensors, rank, ranks, i)

    def fresh(path: Path, make: bool = True) -> None:
        if lead:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True) if make else None
        dist.barrier()

    def load(path: Path, before=lambda: None) -> float:
        """A load into the state's own tensors, zeroed first, then checked against the sums."""
        return _timed(lambda: dist_checkpointing.load(state(), str(path)),
                      before=lambda: ([t.zero_() for t in tensors], before()),
                      after=lambda loaded: _check(loaded, sums, rank))

    # 1. Stall: the disk save (baseline), the memory snapshot, and its copy alone.
    def disk_save(i: int) -> tuple[float]:
        fresh(disk_dir)
        return _timed(lambda: dist_checkpointing.save(state(i), str(disk_dir), sharded_strategy=("torch_dist", 1))),

    copier, strategy = snapshot.HostCopier(), snapshot.save_strategy()

    def snap(i: int) -> tuple[float, float]:
        fresh(part, make=False)  # one snapshot at a time: the previous one goes
        s = snapshot.Snapshot.start(i + 1, part, state(i), copier, strategy, validate=i == 0, record_items=True)
        s.wait()
        complete, ok = s.finalize()
        assert ok and not s.failed, "the snapshot failed"
        return _reduce(MAX, s.stall), _reduce(MAX, complete)  # the host copy goes with s

    out["disk_save"], = _medians(repeat, disk_save)
    out["stall"], out["complete"] = _medians(repeat, snap)
    # Peak RSS in runs of their own: freeing the heap first makes the copy fault in fresh pages.
    out["rss_disk_save"], out["rss_snapshot"] = (_reduce(SUM, rss_growth(lambda: f(repeat + 1)))
                                                   for f in (disk_save, snap))
    out["tmpfs_bytes"] = tmpfs_bytes(part)
    out["files"] = sorted(f.name for f in part.iterdir())
    out["copy"], = _medians(repeat, lambda i: (_timed(lambda: copier.copy(state()), after=lambda c: c.clear()),))

    # 2. Restores: from the tmpfs part; from a replica (rank 0 moves the node's files while
    # the others wait); from the disk, the page cache dropped first.
    out["memory_load"], = _medians(repeat, lambda i: (load(part),))
    out["checksum"], = _medians(repeat, lambda i: (_timed(lambda: lead and replication.checksum()),))
    out["push"], = _medians(repeat, lambda i: (_timed(lambda: lead and replication.push(),
                                                      before=lambda: lead and replication.drop_replica()),))
    out["replica_bytes"] = sum(size for size, _ in replication.crcs.values()) if lead else 0
    fresh(part, make=False)  # node A is gone; its replica on B remains

    def from_replica(i: int) -> tuple[float, float]:
        fresh(restore_dir)
        fetch = _timed(lambda: lead and replication.fetch(restore_dir))
        total = fetch + load(restore_dir)
        fresh(restore_dir, make=False)
        return fetch, total

    out["fetch"], out["replica_restore"] = _medians(repeat, from_replica)

    def by_ranges(i: int) -> tuple[float, float]:  # as a restart reads: its ranges, during the load
        fresh(restore_dir)
        before, found = lead and sum(replication.server.served().values()), [None]
        fetch = _timed(lambda: found.__setitem__(0, lead and replication.fetch(restore_dir, ranged=True)))
        dist.broadcast_object_list(found, src=0)
        with ranged_reads(RestoreCandidate.from_dict(json.loads(found[0])), Replication.RUN, f"rank{rank}"):
            total = fetch + load(restore_dir)
        fresh(restore_dir, make=False)
        return total, (lead and sum(replication.server.served().values())) - before

    out["ranged_restore"], out["ranged_bytes"] = _medians(repeat, by_ranges)
    if lead:
        replication.drop_replica()
        replication.server.close()
    fresh(part, make=False)
    why_not: list = [None]
    out["disk_load"], = _medians(repeat, lambda i: (load(disk_dir, before=lambda: why_not.append(
        drop_page_cache() if lead else None)),))
    out["raw_read"], = _medians(repeat, lambda i: (_timed(lambda: lead and [f.read_bytes() for f in disk_dir.iterdir()],
                                                          before=lambda: lead and drop_page_cache()),))
    out["cache_not_dropped"] = why_not[-1]
    fresh(disk_dir, make=False)
    if lead:
        (root / "result.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# -- the report ----------------------------------------------------------------------------


def run_size(mb: float, args) -> dict:
    shm = Path(tempfile.mkdtemp(prefix="eft-bench-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="eft-bench-", dir=args.disk_dir))
    try:
        mp.start_processes(_rank_main, args=(args.ranks, mb, args.tensors, args.repeat, str(shm), str(disk),
                                             args.device),
                           nprocs=args.ranks, join=True, start_method="spawn" if args.device == "cuda" else "fork")
        return json.loads((shm / "result.json").read_text())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def fs_of(path: str) -> str:
    """'fstype device' of the mount holding ``path``."""
    best = ("", "?", "?")
    for line in Path("/proc/mounts").read_text().splitlines():
        device, mount, fstype = line.split()[:3]
        if (os.path.realpath(path) + "/").startswith(mount.rstrip("/") + "/") and len(mount) >= len(best[0]):
            best = (mount, fstype, device)
    return f"{best[1]} {best[2]}"


def report(mb: float, r: dict, ranks: int, count: int) -> list[str]:
    state = r["state_bytes"]
    cold = "cold page cache" if r["cache_not_dropped"] is None else "WARM page cache"

    def row(what: str, seconds: float, base: str, nbytes: int = 0) -> list:
        return [what, seconds, f"{seconds / r[base]:.3f} × {base.replace('_', ' ')}",
                f"{nbytes / MB / seconds:.0f} MB/s" if nbytes else ""]

    def memory(what: str, nbytes: int) -> list:
        return [f"host memory: {what}", "", f"{nbytes / state:.3f} × state", f"{nbytes / MB:.1f} MB"]

    rows = [row("disk save, synchronous torch_dist (baseline)", r["disk_save"], "disk_save", state),
            row("memory snapshot: training stall (copy + plan)", r["stall"], "disk_save"),
            row("  the copy alone (HostCopier.copy)", r["copy"], "disk_save", state),
            row("memory snapshot: complete (+ write + finalize)", r["complete"], "disk_save", state),
            row(f"disk load, {cold} (baseline)", r["disk_load"], "disk_load", state),
            row(f"  a plain read of its files, {cold}", r["raw_read"], "disk_load", state),
            row("memory load (local tmpfs)", r["memory_load"], "disk_load", state)]
    if "push" in r:
        rows += [row("replicate: crc32 of the part", r["checksum"], "disk_load", r["replica_bytes"]),
                 row("replicate: push to a peer over HTTP", r["push"], "disk_load", r["replica_bytes"]),
                 row("restore from replica: fetch over HTTP", r["fetch"], "disk_load", r["replica_bytes"]),
                 row("restore from replica: fetch + load", r["replica_restore"], "disk_load"),
                 row("restore from replica: byte ranges during the load", r["ranged_restore"], "disk_load",
                     r["ranged_bytes"])]
    rows += [memory("tmpfs bytes per snapshot", r["tmpfs_bytes"]),
             memory("peak RSS growth, snapshot", r["rss_snapshot"]),
             memory("peak RSS growth, disk save", r["rss_disk_save"])]
    lines = [(f"{mb:g} MB per node: {state / MB:.1f} MB of float32 in {ranks} rank(s) × {count} tensors of "
              f"{r['tensor_shape']} + 1 ShardedObject; the part's files: {', '.join(r['files'])}"),
             table(["what", "seconds (median)", "vs baseline", "note"], rows)]
    if r["cache_not_dropped"]:
        lines.append(f"the page cache could not be dropped ({r['cache_not_dropped']}): disk loads are warm-cache")
    return lines


def goals(mb: float, r: dict) -> list[str]:
    stall, speedup = r["stall"] / r["disk_save"], r["disk_load"] / r["memory_load"]
    replica = (f"; from a replica, fetch + load {r['replica_restore']:.3f} s: "
               f"{r['disk_load'] / r['replica_restore']:.1f}×") if "push" in r else ""
    return [(f"goal {mb:g} MB: stall ≤ 10 % of a disk save: {'met' if stall <= 0.10 else 'NOT met'} "
             f"(stall {r['stall']:.3f} s = {100 * stall:.1f} % of {r['disk_save']:.3f} s)"),
            (f"goal {mb:g} MB: restore from memory ≥ 3× faster than from disk: "
             f"{'met' if speedup >= 3 else 'NOT met'} (memory {r['memory_load']:.3f} s, "
             f"disk {r['disk_load']:.3f} s: {speedup:.1f}×{replica})")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,500,2000", help="MB of state per node (default 50,500,2000)")
    parser.add_argument("--quick", action="store_true", help="50 MB only")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up (default 3)")
    parser.add_argument("--ranks", type=int, default=1, help="gloo ranks forked, each with size/ranks (default 1)")
    parser.add_argument("--tensors", type=int, default=16, help="ShardedTensors per rank (default 16)")
    parser.add_argument("--disk-dir", help="where the disk baseline writes (default: the temp dir if not tmpfs)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the state lives (default: cuda when there is one)")
    args = parser.parse_args()
    sizes = [50.0] if args.quick else [float(s) for s in args.sizes.split(",")]
    if args.disk_dir is None:
        args.disk_dir = tempfile.gettempdir() if not fs_of(tempfile.gettempdir()).startswith("tmpfs") else "/var/tmp"
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU" + (
        "" if torch.cuda.is_available() else " (cpu_mode)")
    print(f"memory checkpoints: {args.ranks} rank(s), {os.cpu_count()} CPU cores, "
          f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, torch {torch.__version__}, state on {where}; "
          f"median of {args.repeat} after a warm-up")
    print(f"memory part in /dev/shm ({fs_of('/dev/shm')}); disk baseline in {args.disk_dir} ({fs_of(args.disk_dir)})")
    if fs_of(args.disk_dir).startswith("tmpfs"):
        print(f"WARNING: {args.disk_dir} is tmpfs: the disk baseline is memory too")
    summary = []
    for mb in sizes:
        result = run_size(mb, args)
        print("\n" + "\n".join(report(mb, result, args.ranks, args.tensors)))
        summary += goals(mb, result)
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
