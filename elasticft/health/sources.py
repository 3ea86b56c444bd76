"""Where health samples come from. Every GPU source has ``read() -> list[GpuSample]``
(one round: at most one sample per GPU, possibly several rounds in order) and
``close()``.

- ``NvmlSource`` (in nvml.py): the local GPUs through NVML.
- ``ReplaySource``: a CSV trace (eft's format or nvidia-smi's), in real time or as
  fast as possible, to rehearse failures and to test without GPUs.
- ``HostSource``: host memory and free space where checkpoints are written; it
  yields ``HostSample`` records, since none of that belongs to a GPU.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Protocol

from elasticft.health.nvml import NvmlSource, NvmlUnavailable
from elasticft.health.sample import DiskSpace, GpuSample, HostSample
from elasticft.health.trace import TraceError, batches, read_trace


class Source(Protocol):
    def read(self) -> list[GpuSample]: ...

    def close(self) -> None: ...


class ReplaySource:
    """Replays a trace file.

    ``speed=None`` plays as fast as possible: each ``read()`` returns the next round
    and samples keep the trace's timestamps. ``speed=s`` plays ``s`` times faster
    than real time: each ``read()`` returns every round that is due, re-timed so
    that the trace starts at the first ``read()``. ``finished`` is set once the
    last round has been returned. A malformed header raises ``TraceError`` here; a
    malformed row raises it from the ``read()`` that reaches it.
    """

    def __init__(
        self,
        path: str | Path,
        node: str | None = None,
        speed: float | None = None,
        clock: Callable[[], float] = time.time,
    ):
        if speed is not None and not speed > 0:
            raise ValueError(f"replay speed must be positive, got {speed}")
        self.path = Path(path)
        self.speed = speed
        self._clock = clock
        self._rounds = batches(read_trace(self.path, node))
        self._next: list[GpuSample] | None = None
        self._origin: tuple[float, float] | None = None  # (wall clock, trace time) at start
        self._error: TraceError | None = None  # met while looking ahead; raised by read()
        self.finished = threading.Event()
        self._peek()  # read the header now so that a bad file fails at construction

    def _peek(self) -> list[GpuSample] | None:
        if self._next is None and not self.finished.is_set():
            try:
                self._next = next(self._rounds)
            except StopIteration:
                self._next = None
            except TraceError:
                self.finished.set()
                raise
        return self._next

    def _take(self) -> list[GpuSample]:
        taken, self._next = self._next or [], None
        try:
            if self._peek() is None:
                self.finished.set()
        except TraceError as exc:  # give out the good round first
            self._error = exc
        return taken

    def read(self) -> list[GpuSample]:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._peek() is None:
            self.finished.set()
            return []
        if self.speed is None:
            return self._take()
        now = self._clock()
        if self._origin is None:
            self._origin = (now, self._next[0].timestamp)
        wall0, trace0 = self._origin
        due = trace0 + (now - wall0) * self.speed
        out: list[GpuSample] = []
        while self._peek() is not None and self._next[0].timestamp <= due:
            out.extend(
                replace(s, timestamp=wall0 + (s.timestamp - trace0) / self.speed) for s in self._take()
            )
        return out

    def close(self) -> None:
        self._rounds.close()
        self._next = None
        self.finished.set()


def _meminfo() -> tuple[float | None, float | None]:
    """(total, available) host memory in MiB."""
    values = {}
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and name in ("MemTotal", "MemAvailable"):
                    values[name] = int(parts[0]) / 1024.0  # kB
    except OSError:
        pass
    total = values.get("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
        except (ValueError, OSError):
            total = None
    return total, values.get("MemAvailable")


def disk_space(path: str) -> DiskSpace | None:
    """Free space for ``path``, measured at its nearest existing ancestor: a
    checkpoint directory may not exist before the first save."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    inodes = st.f_favail if st.f_files > 0 else None
    return DiskSpace(str(path), st.f_bavail * st.f_frsize, inodes)


class HostSource:
    """Host memory and, for each checkpoint directory, free bytes and inodes."""

    def __init__(self, node_id: str, checkpoint_dirs: Iterable[str] = (), clock: Callable[[], float] = time.time):
        self.node_id = node_id
        self.checkpoint_dirs = [str(d) for d in checkpoint_dirs]
        self._clock = clock

    def read(self) -> HostSample:
        total, available = _meminfo()
        disks = tuple(d for d in (disk_space(p) for p in self.checkpoint_dirs) if d is not None)
        return HostSample(self._clock(), self.node_id, total, available, disks)

    def close(self) -> None:
        pass


__all__ = [
    "HostSource",
    "NvmlSource",
    "NvmlUnavailable",
    "ReplaySource",
    "Source",
    "TraceError",
    "disk_space",
]
