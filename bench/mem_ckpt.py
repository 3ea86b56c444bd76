"""Memory checkpoints (issue 14): the training stall of a snapshot, and restores from memory.

A megatron-core sharded state dict (``--tensors`` float32 ShardedTensors and one small
ShardedObject, ``size / ranks`` MB per rank) in a gloo group of ``--ranks`` forked ranks on
this machine, for each of ``--sizes`` MB per node. Baselines measured in the same run:

1. Stall: ``Snapshot.start`` (the memory tier's save: copy to host memory, then plan;
   the torch_dist write runs on a thread) into tmpfs, against a synchronous
   ``dist_checkpointing.save(..., ("torch_dist", 1))`` of the same state to ``--disk-dir``
   (not tmpfs). Also the time until the snapshot is complete (write + finalize). Then the
   same snapshot with its copy overlapped (``--eft-mem-ckpt-overlap``): the stall is the
   plan plus what the update waits for after a stand-in for the next iteration's forward
   and backward (``--step-seconds`` of float32 matmuls, which on a CPU share the cores and
   the memory bandwidth with the copy and the write: its time after the snapshot is printed
   against its time alone, and so is its time after a snapshot whose copy blocked).
2. Restore: ``dist_checkpointing.load`` from the tmpfs part, and from a replica (the part
   pushed over HTTP on 127.0.0.1 to a second tmpfs "node", then fetched back to a third
   dir and loaded; or read by each rank's byte ranges during the load, as a restart does),
   against a load from the disk dir with the page cache dropped.
3. Host memory: bytes in tmpfs per snapshot against the state's bytes; peak RSS growth
   of the ranks during a snapshot (and during the disk save, for comparison).

Times: the median of ``--repeat`` runs after a warm-up, the slowest rank's. Each size runs in
fresh processes and deletes as it goes: host memory peaks at ~3× the state.

    python bench/mem_ckpt.py [--sizes 50,500,2000 | --quick] [--repeat 3] [--ranks 1] [--disk-dir DIR]
                             [--step-seconds 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from common import ROOT, table  # noqa: E402  (also puts the repo on sys.path)
from mem_replication import Replication  # noqa: E402
from mem_ckpt_measure import (  # noqa: E402
    MAX,
    SUM,
    StandIn,
    drop_page_cache,
    medians,
    reduce,
    rss_growth,
    timed,
    tmpfs_bytes,
)

if not torch.cuda.is_available():  # megatron-core needs it before its first import
    sys.path.insert(0, str(ROOT / "examples" / "gpt3"))
    import cpu_mode  # noqa: E402

    cpu_mode.enable()

MB = 1_000_000
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


def _rank_main(rank: int, ranks: int, mb: float, count: int, repeat: int, shm: str, disk: str,
               device: str = "cpu", step_seconds: float = 1.0) -> None:
    from megatron.core import dist_checkpointing

    if device == "cuda":  # the state on the GPU: the snapshot's stall is the device-to-host copy
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo", init_method=f"file://{shm}/init",
                            rank=rank, world_size=ranks)
    snapshot.in_process_results_queue()  # the disk saves too: no spawned Manager at the first save
    tensors = _tensors(rank, ranks, mb, count, device)
    sums = [t.sum(dtype=torch.float64).item() for t in tensors]
    lead, root, disk_dir, restore_dir = rank == 0, Path(shm), Path(disk) / "iter_0000001", Path(shm) / "restore"
    out: dict = {"state_bytes": reduce(SUM, sum(t.numel() * t.element_size() for t in tensors)),
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
        return timed(lambda: dist_checkpointing.load(state(), str(path)),
                      before=lambda: ([t.zero_() for t in tensors], before()),
                      after=lambda loaded: _check(loaded, sums, rank))

    # 1. Stall: the disk save (baseline), the memory snapshot, and its copy alone.
    def disk_save(i: int) -> tuple[float]:
        fresh(disk_dir)
        return timed(lambda: dist_checkpointing.save(state(i), str(disk_dir), sharded_strategy=("torch_dist", 1))),

    copier, strategy = snapshot.HostCopier(), snapshot.save_strategy()

    def snap(i: int) -> tuple[float, float]:
        fresh(part, make=False)  # one snapshot at a time: the previous one goes
        s = snapshot.Snapshot.start(i + 1, part, state(i), copier, strategy, validate=i == 0, record_items=True)
        s.wait()
        complete, ok = s.finalize()
        assert ok and not s.failed, "the snapshot failed"
        return reduce(MAX, s.stall), reduce(MAX, complete)  # the host copy goes with s

    step = StandIn(step_seconds, device)  # the next iteration's forward and backward, beside an overlapped copy

    def snap_beside(i: int, overlap: bool) -> tuple[float, float, float, float]:
        """A snapshot with the stand-in iteration after it (run alone first, for its baseline)."""
        fresh(part, make=False)
        alone = step()
        began = time.perf_counter()
        s = snapshot.Snapshot.start(i + 1, part, state(i), copier, strategy, validate=i == 0, overlap=overlap,
                                        record_items=True)
        s.stall = time.perf_counter() - began
        beside = step()  # beside the copy (overlapped) and the write
        s.wait_copy()  # the update's wait
        s.wait()
        assert s.finalize()[1] and not s.failed, "the snapshot failed"
        return tuple(reduce(MAX, v) for v in (s.stall, alone, beside, s.copying.seconds))

    out["disk_save"], = medians(repeat, disk_save)
    out["stall"], out["complete"] = medians(repeat, snap)
    out["stall_overlapped"], out["step_alone"], out["step_beside"], out["copy_overlapped"] = medians(
        repeat, lambda i: snap_beside(i, overlap=True))
    _, out["step_alone_blocking"], out["step_after_blocking"], _ = medians(repeat, lambda i: snap_beside(i, False))
    # Peak RSS in runs of their own: freeing the heap first makes the copy fault in fresh pages.
    out["rss_disk_save"], out["rss_snapshot"] = (reduce(SUM, rss_growth(lambda: f(repeat + 1)))
                                                   for f in (disk_save, snap))
    out["tmpfs_bytes"] = tmpfs_bytes(part)
    out["files"] = sorted(f.name for f in part.iterdir())
    out["copy"], = medians(repeat, lambda i: (timed(lambda: copier.copy(state()), after=lambda c: c.clear()),))

    # 2. Restores: from the tmpfs part; from a replica (rank 0 moves the node's files while
    # the others wait); from the disk, the page cache dropped first.
    out["memory_load"], = medians(repeat, lambda i: (load(part),))
    out["checksum"], = medians(repeat, lambda i: (timed(lambda: lead and replication.checksum()),))
    out["push"], = medians(repeat, lambda i: (timed(lambda: lead and replication.push(),
                                                      before=lambda: lead and replication.drop_replica()),))
    out["replica_bytes"] = sum(size for size, _ in replication.crcs.values()) if lead else 0
    fresh(part, make=False)  # node A is gone; its replica on B remains

    def from_replica(i: int) -> tuple[float, float]:
        fresh(restore_dir)
        fetch = timed(lambda: lead and replication.fetch(restore_dir))
        total = fetch + load(restore_dir)
        fresh(restore_dir, make=False)
        return fetch, total

    out["fetch"], out["replica_restore"] = medians(repeat, from_replica)

    def by_ranges(i: int) -> tuple[float, float]:  # as a restart reads: its ranges, during the load
        fresh(restore_dir)
        before, found = lead and sum(replication.server.served().values()), [None]
        fetch = timed(lambda: found.__setitem__(0, lead and replication.fetch(restore_dir, ranged=True)))
        dist.broadcast_object_list(found, src=0)
        with ranged_reads(RestoreCandidate.from_dict(json.loads(found[0])), Replication.RUN, f"rank{rank}"):
            total = fetch + load(restore_dir)
        fresh(restore_dir, make=False)
        return total, (lead and sum(replication.server.served().values())) - before

    out["ranged_restore"], out["ranged_bytes"] = medians(repeat, by_ranges)
    if lead:
        replication.drop_replica()
        replication.server.close()
    fresh(part, make=False)
    why_not: list = [None]
    out["disk_load"], = medians(repeat, lambda i: (load(disk_dir, before=lambda: why_not.append(
        drop_page_cache() if lead else None)),))
    out["raw_read"], = medians(repeat, lambda i: (timed(lambda: lead and [f.read_bytes() for f in disk_dir.iterdir()],
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
                                             args.device, args.step_seconds),
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
            row("memory snapshot, copy overlapped: stall (plan + the update's wait)", r["stall_overlapped"],
                "disk_save"),
            row("  the overlapped copy, start to end", r["copy_overlapped"], "disk_save", state),
            row("  stand-in forward + backward alone (baseline)", r["step_alone"], "step_alone"),
            row("  stand-in forward + backward beside the copy and the write", r["step_beside"], "step_alone"),
            row("  the same after a blocking copy, beside the write", r["step_after_blocking"],
                "step_alone_blocking"),
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
    stall, speedup = r["stall_overlapped"] / r["disk_save"], r["disk_load"] / r["memory_load"]
    replica = (f"; from a replica, fetch + load {r['replica_restore']:.3f} s: "
               f"{r['disk_load'] / r['replica_restore']:.1f}×") if "push" in r else ""
    return [(f"goal {mb:g} MB: stall ≤ 10 % of a disk save: {'met' if stall <= 0.10 else 'NOT met'} "
             f"(copy overlapped: stall {r['stall_overlapped']:.3f} s = {100 * stall:.1f} % of {r['disk_save']:.3f} s; "
             f"blocking copy: {r['stall']:.3f} s = {100 * r['stall'] / r['disk_save']:.1f} %; overlapped / blocking "
             f"{r['stall_overlapped'] / r['stall']:.2f}; the stand-in iteration after it "
             f"{r['step_beside'] / r['step_alone']:.2f}× its time alone, after a blocking copy "
             f"{r['step_after_blocking'] / r['step_alone_blocking']:.2f}×)"),
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
    parser.add_argument("--step-seconds", type=float, default=1.0,
                        help="the stand-in forward + backward an overlapped copy runs beside (default 1.0)")
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
          f"median of {args.repeat} after a warm-up; stand-in iteration {args.step_seconds:g} s")
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
