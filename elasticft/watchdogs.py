"""Host watchdogs in the agent: checkpoint storage and CPU memory.

* **Checkpoint storage**: every ``--eft-watch-dirs`` directory must have room for the
  next ``--eft-watch-keep`` checkpoints, in bytes and in inodes, where a checkpoint's
  size is learned from the newest ``iter_*`` directory under it (the newest complete one
  when ``elasticft.worker.CheckpointDir``'s ``.complete`` markers are there). A trip is
  an event and a notification: saving more would only make the shortage worse.
* **CPU memory**: host memory use at or above ``--eft-mem-threshold`` percent asks the
  whole job to save and exit (reason ``watchdog``) once, before the OOM killer kills a
  rank mid-step and the work since the last checkpoint is lost.

The decisions (``check_disk``, ``check_memory``, ``Latch``) are pure: the readings come
in as numbers. ``Watchdogs`` is the agent's thread that takes the readings.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .config import WatchdogConfig

log = logging.getLogger(__name__)

_ITER_DIR = re.compile(r"^iter_(\d+)$")
COMPLETE_MARKER = ".complete"


@dataclass(frozen=True)
class Trip:
    """One watchdog finding: ``reading`` is on the wrong side of ``limit``."""

    check: str  # disk_space, disk_inodes, cpu_memory
    target: str  # the directory, or "host"
    reading: float
    limit: float
    save_and_exit: bool = False
    message: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.check, self.target


@dataclass(frozen=True)
class CheckpointUsage:
    """What one checkpoint takes on storage: bytes and inodes (files and directories)."""

    name: str
    bytes: int
    inodes: int


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


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
            message=f"{_gib(free_bytes)} free, {keep} checkpoints like {usage.name} need {_gib(need_bytes)}",
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
        entries = [(int(m.group(1)), p) for p in Path(root).iterdir()
                   if (m := _ITER_DIR.match(p.name)) and p.is_dir()]
    except OSError:
        return None
    entries.sort(reverse=True)
    complete = [p for _, p in entries if (p / COMPLETE_MARKER).exists()]
    if complete:
        return complete[0]
    return entries[0][1] if entries else None


def checkpoint_usage(path: Path) -> CheckpointUsage:
    """Sum of file sizes and count of inodes under ``path``."""
    total, inodes = 0, 1
    for dirpath, dirnames, filenames in os.walk(path):
        inodes += len(dirnames) + len(filenames)
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return CheckpointUsage(path.name, total, inodes)


def disk_free(path: str | Path) -> tuple[int, int | None]:
    """(free bytes, free inodes or None) for the unprivileged user."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, (st.f_favail if st.f_files > 0 else None)


def memory_percent() -> float:
    import psutil

    return float(psutil.virtual_memory().percent)


class Watchdogs:
    """The agent's watchdog thread; ``check_once`` is one round (tests call it directly).

    ``record(kind, **fields)`` writes an event (EventLog.record, which also notifies);
    ``request_exit(reason_text)`` asks the job to save and exit.
    """

    def __init__(
        self,
        config: WatchdogConfig,
        record: Callable[..., None],
        request_exit: Callable[[Trip], None],
        *,
        read_disk: Callable[[str], tuple[int, int | None]] = disk_free,
        read_memory: Callable[[], float] = memory_percent,
    ):
        self.config = config
        self._record = record
        self._request_exit = request_exit
        self._read_disk = read_disk
        self._read_memory = read_memory
        self._latch = Latch()
        self._usage: dict[str, CheckpointUsage] = {}  # by directory: the last size learned
        self._exit_requested = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[str] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.config.dirs()) or self.config.mem_threshold > 0

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
        new = self._latch.update(trips, checked)
        for trip in new:
            log.warning("watchdog %s on %s: %s", trip.check, trip.target, trip.message)
            self._record("watchdog", **asdict(trip))
            if trip.save_and_exit and not self._exit_requested:
                self._exit_requested = True
                self._request_exit(trip)
        return new

    def start(self) -> "Watchdogs":
        self._thread = threading.Thread(target=self._loop, name="eft-watchdogs", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - a watchdog must not take the agent down
                log.exception("watchdog check failed")
            self._stop.wait(self.config.watch_interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
