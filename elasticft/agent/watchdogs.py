"""Watchdogs in the agent: checkpoint storage, CPU memory, GPU memory, silent workers.

* **Checkpoint storage**: every ``--eft-watch-dirs`` directory must have room for the
  next ``--eft-watch-keep`` checkpoints, in bytes and in inodes, where a checkpoint's
  size is learned from the newest ``iter_*`` directory under it (the newest complete one
  when ``elasticft.worker.CheckpointDir``'s ``.complete`` markers are there). A trip is
  an event and a notification: saving more would only make the shortage worse.
* **CPU memory**: host memory use at or above ``--eft-mem-threshold`` percent asks the
  whole job to save and exit (reason ``watchdog``) once, before the OOM killer kills a
  rank mid-step and the work since the last checkpoint is lost.
* **GPU memory**: a GPU whose free memory (as NVML reports it, the caching allocator's
  reserve counted as used) is below ``--eft-gpu-mem-headroom`` percent of its total asks
  the job to save (not exit): an out-of-memory error would kill the step and lose the
  work since the last checkpoint, while the job may well go on after the save. The
  readings are the health sampler's latest samples: no second NVML handle.
* **Silence**: with ``--eft-silence-limit`` > 0, no heartbeat
  (``elasticft.worker.progress``) and no line in a redirected worker log from any local
  worker for that long is an event and a notification. No checkpoint: a job that cannot
  write a heartbeat cannot save either.

The decisions (``check_disk``, ``check_memory``, ``check_gpu_memory``, ``check_silence``,
``Latch``) are pure: the readings come in as numbers. ``Watchdogs`` is the agent's thread
that takes the readings.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from elasticft.config import WatchdogConfig
from elasticft.contract.checkpoints import COMPLETE_MARKER, iteration_of
from elasticft.contract.events import EventKind
from elasticft.contract.progress import progress_dir, read_progress
from elasticft.health.sample import GpuSample
from elasticft.periodic import PeriodicTask

log = logging.getLogger(__name__)

WATCHDOG_CHECKS = ("disk_space", "disk_inodes", "cpu_memory", "gpu_memory", "silence")  # Trip.check's values


@dataclass(frozen=True)
class Trip:
    """One watchdog finding: ``reading`` is on the wrong side of ``limit``."""

    check: str  # one of WATCHDOG_CHECKS
    target: str  # the directory, "host", "gpu<N>" or "workers"
    reading: float
    limit: float
    save_and_exit: bool = False
    message: str = ""
    save: bool = False  # ask the job to save and go on (save_and_exit: save and stop)

    @property
    def key(self) -> tuple[str, str]:
        return self.check, self.target

    def requester(self, node_id: str) -> str:
        """Who asks for the checkpoint: ``node/cpu_memory``, ``node/gpu_memory/gpu3``."""
        return f"{node_id}/{self.check}" + ("" if self.target == "host" else f"/{self.target}")


@dataclass(frozen=True)
class CheckpointUsage:
    """What one checkpoint takes on storage: bytes and inodes (files and directories)."""

    name: str
    bytes: int
    inodes: int


def _size(n: float) -> str:
    """Bytes for people: GiB, or MiB below one GiB (a small disk says "0.00 GiB" otherwise)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_disk(
    target: str,
    free_bytes: int,
    free_inodes: int | None,
    usage: CheckpointUsage | None,
    keep: int,
) -> list[Trip]:
    """Trips for a checkpoint directory without room for ``keep`` more checkpoints.

    No checkpoint yet (``usage`` None): nothing to learn a size from, no trip.
    ``free_inodes`` None: the filesystem does not count inodes (btrfs, some NFS).
    """
    if usage is None:
        return []
    trips = []
    need_bytes = keep * usage.bytes
    if free_bytes < need_bytes:
        trips.append(Trip(
            "disk_space", target, free_bytes, need_bytes,
            message=f"{_size(free_bytes)} free, {keep} checkpoints like {usage.name} need {_size(need_bytes)}",
        ))
    need_inodes = keep * usage.inodes
    if free_inodes is not None and free_inodes < need_inodes:
        trips.append(Trip(
            "disk_inodes", target, free_inodes, need_inodes,
            message=f"{free_inodes} inodes free, {keep} checkpoints like {usage.name} need {need_inodes}",
        ))
    return trips


def check_memory(percent: float, threshold: float) -> Trip | None:
    """Host memory use at or above ``threshold`` percent (0: off) asks to save and exit."""
    if threshold <= 0 or percent < threshold:
        return None
    return Trip("cpu_memory", "host", percent, threshold, save_and_exit=True,
                message=f"host memory {percent:.1f}% used (limit {threshold:g}%): save and exit")


def gpu_free_percent(sample: GpuSample) -> float | None:
    """Free memory in percent of the total; None when the sample lacks either reading."""
    if sample.memory_used_mib is None or not sample.memory_total_mib:
        return None
    return 100.0 * (sample.memory_total_mib - sample.memory_used_mib) / sample.memory_total_mib


def check_gpu_memory(samples: Iterable[GpuSample], headroom: float) -> list[Trip]:
    """A save for each GPU with less than ``headroom`` percent of its memory free (0: off)."""
    if headroom <= 0:
        return []
    trips = []
    for sample in samples:
        free = gpu_free_percent(sample)
        if free is None or free >= headroom:
            continue
        free_mib = sample.memory_total_mib - sample.memory_used_mib
        trips.append(Trip(
            "gpu_memory", f"gpu{sample.gpu}", round(free, 3), headroom, save=True,
            message=f"GPU {sample.gpu} has {free_mib:.0f} MiB ({free:.1f}%) of {sample.memory_total_mib:.0f} MiB "
                    f"free (limit {headroom:g}%): save before an out-of-memory error kills the step",
        ))
    return trips


def check_silence(last_activity: float | None, now: float, limit: float) -> Trip | None:
    """No sign of life from any local worker for ``limit`` seconds (0: off).

    ``last_activity`` None: no running worker has written a heartbeat yet (starting up,
    or no workers on this node): nothing to judge.
    """
    if limit <= 0 or last_activity is None:
        return None
    silent = now - last_activity
    if silent <= limit:
        return None
    return Trip("silence", "workers", silent, limit,
                message=f"no heartbeat or log line from any local worker for {silent:.1f} s (limit {limit:g} s)")


class Latch:
    """Report a trip once; report it again only after a check found it cleared."""

    def __init__(self) -> None:
        self.active: set[tuple[str, str]] = set()

    def update(self, trips: list[Trip], checked: set[tuple[str, str]]) -> list[Trip]:
        """The trips that are new; ``checked``: every (check, target) this round looked at."""
        now = {t.key for t in trips}
        self.active -= checked - now  # cleared: may trip again
        new = [t for t in trips if t.key not in self.active]
        self.active |= now
        return new


# -- readings (I/O) ----------------------------------------------------------------------


def newest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete ``iter_*`` directory (or the newest, when none has a marker)."""
    try:
        entries = [(i, p) for p in Path(root).iterdir()
                   if (i := iteration_of(p.name)) is not None and p.is_dir()]
    except OSError:
        return None
    entries.sort(reverse=True)
    complete = [p for _, p in entries if (p / COMPLETE_MARKER).exists()]
    if complete:
        return complete[0]
    return entries[0][1] if entries else None


def _stored_bytes(path: str) -> int:
    """What ``path`` takes on storage: its allocated blocks, or its size when that is more.

    Allocated, because a filesystem hands out whole blocks (a 1 KiB file takes 4 KiB on
    tmpfs or ext4): checkpoints of many small files would otherwise look smaller than
    they are. The size when that is more: a compressed or sparse file's blocks say
    little about what the next save, written densely, will need.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return max(st.st_size, st.st_blocks * 512)


def checkpoint_usage(path: Path) -> CheckpointUsage:
    """Bytes stored (see ``_stored_bytes``) and count of inodes under ``path``."""
    total, inodes = _stored_bytes(str(path)), 1
    for dirpath, dirnames, filenames in os.walk(path):
        inodes += len(dirnames) + len(filenames)
        for name in dirnames + filenames:
            total += _stored_bytes(os.path.join(dirpath, name))
    return CheckpointUsage(path.name, total, inodes)


def disk_free(path: str | Path) -> tuple[int, int | None]:
    """(free bytes, free inodes or None) for the unprivileged user."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, (st.f_favail if st.f_files > 0 else None)


def memory_percent() -> float:
    import psutil

    return float(psutil.virtual_memory().percent)


def _mtime(path: str | os.PathLike) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


def _running(pids: Iterable[int]) -> set[int]:
    """Those of ``pids`` still running, with every process they started that still runs.

    The processes they started: a worker launched through a wrapper (``--no-python``, a
    shell script that runs python) writes its heartbeat from a pid torch never saw. An
    exited child not yet reaped is a zombie, not running.
    """
    import psutil

    running = set()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            family = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in family:
            try:
                if proc.status() != psutil.STATUS_ZOMBIE:
                    running.add(proc.pid)
            except psutil.Error:
                pass
    return running


def worker_activity(run_dir: str | os.PathLike | None, pcontext: Any) -> float | None:
    """When the local workers last showed life, or None while there is nothing to judge.

    ``pcontext`` is torch's process context of the running workers (``pids()``, and
    ``stdouts``/``stderrs``: local rank -> log file, "" when not redirected by
    ``--redirects``/``--tee``). Only heartbeats written by a worker of this context (or a
    process it started) that is still running count: an earlier generation's files stay
    in the run directory after a restart, and a worker that has exited has nothing more
    to say. None until one of them has written a heartbeat, so a slow start (imports,
    rendezvous) is not silence.
    The newest of those heartbeats (their ``time`` and their file's mtime) and of the
    workers' log files is the answer.
    """
    if run_dir is None or pcontext is None:
        return None
    try:
        pids = {pid for pid in pcontext.pids().values() if pid}
    except Exception:  # noqa: BLE001 - a context being started or torn down: next round
        return None
    running = _running(pids)
    times = []
    for record in read_progress(run_dir).values():
        if record.pid in running:
            mtime = _mtime(progress_dir(run_dir) / f"{record.local_rank}.json")
            times.append(max(record.time, mtime or 0.0))
    if not times:
        return None
    for logs in (getattr(pcontext, "stdouts", None), getattr(pcontext, "stderrs", None)):
        for path in (logs or {}).values():
            if path and path != os.devnull and (mtime := _mtime(path)) is not None:
                times.append(mtime)
    return max(times)


class Watchdogs(PeriodicTask):
    """The agent's watchdog thread; ``check_once`` is one round (tests call it directly).

    ``record(kind, **fields)`` writes an event (EventLog.record, which also notifies);
    ``request_checkpoint(trip)`` asks the job to save, and to exit when
    ``trip.save_and_exit``. ``read_gpus`` gives the latest GPU samples and
    ``read_activity`` when the local workers last showed life (``worker_activity``);
    without them (no health sampler, no workers to watch) those checks are off.
    """

    name = "eft-watchdogs"

    def __init__(
        self,
        config: WatchdogConfig,
        record: Callable[..., None],
        request_checkpoint: Callable[[Trip], None],
        *,
        read_disk: Callable[[str], tuple[int, int | None]] = disk_free,
        read_memory: Callable[[], float] = memory_percent,
        read_gpus: Callable[[], Iterable[GpuSample]] | None = None,
        read_activity: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self._record = record
        self._request_checkpoint = request_checkpoint
        self._read_disk = read_disk
        self._read_memory = read_memory
        self._read_gpus = read_gpus
        self._read_activity = read_activity
        self._clock = clock
        self._latch = Latch()
        self._usage: dict[str, CheckpointUsage] = {}  # by directory: the last size learned
        self._exit_requested = False
        self.interval = config.watch_interval
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return (
            bool(self.config.dirs())
            or self.config.mem_threshold > 0
            or (self.config.gpu_mem_headroom > 0 and self._read_gpus is not None)
            or (self.config.silence_limit > 0 and self._read_activity is not None)
        )

    def _learn_usage(self, root: str) -> CheckpointUsage | None:
        newest = newest_checkpoint(root)
        if newest is None:
            return self._usage.get(root)
        known = self._usage.get(root)
        if known is None or known.name != newest.name:
            self._usage[root] = checkpoint_usage(newest)
        return self._usage[root]

    def check_once(self) -> list[Trip]:
        """One round of checks; returns the new trips (each recorded, memory acted on)."""
        trips: list[Trip] = []
        checked: set[tuple[str, str]] = set()
        for root in self.config.dirs():
            try:
                free_bytes, free_inodes = self._read_disk(root)
                usage = self._learn_usage(root)
            except OSError as exc:
                if root not in self._warned:
                    self._warned.add(root)
                    log.warning("watchdog cannot read checkpoint directory %s: %s", root, exc)
                continue
            checked |= {("disk_space", root), ("disk_inodes", root)}
            trips += check_disk(root, free_bytes, free_inodes, usage, self.config.watch_keep)
        if self.config.mem_threshold > 0:
            checked.add(("cpu_memory", "host"))
            memory = check_memory(self._read_memory(), self.config.mem_threshold)
            if memory is not None:
                trips.append(memory)
        if self.config.gpu_mem_headroom > 0 and self._read_gpus is not None:
            samples = list(self._read_gpus())
            checked |= {("gpu_memory", f"gpu{s.gpu}") for s in samples if gpu_free_percent(s) is not None}
            trips += check_gpu_memory(samples, self.config.gpu_mem_headroom)
        if self.config.silence_limit > 0 and self._read_activity is not None:
            last = self._read_activity()
            if last is not None:  # no running worker with a heartbeat: neither tripped nor cleared
                checked.add(("silence", "workers"))
                silence = check_silence(last, self._clock(), self.config.silence_limit)
                if silence is not None:
                    trips.append(silence)
        new = self._latch.update(trips, checked)
        for trip in new:
            log.warning("watchdog %s on %s: %s", trip.check, trip.target, trip.message)
            self._record(EventKind.WATCHDOG, **asdict(trip))
            if self._exit_requested:
                continue  # the job is saving and stopping already: nothing more to ask
            if trip.save_and_exit:
                self._exit_requested = True
                self._request_checkpoint(trip)
            elif trip.save:
                self._request_checkpoint(trip)
        return new

