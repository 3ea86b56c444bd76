"""The records every health source yields: one ``GpuSample`` per GPU per sample.

A field is ``None`` when the source could not read it (the GPU or driver does not
support it, nvidia-smi printed ``[N/A]``, the column is absent): missing is not zero,
and the risk model treats the two differently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime, timezone

# Throttle-reason bits (nvmlClocksEventReason*) that mean the GPU is protecting
# itself: HW slowdown, HW thermal slowdown, HW power brake. The software ones
# (power cap, SW thermal) happen on healthy GPUs under load and are left out.
HW_SLOWDOWN_MASK = 0x8 | 0x40 | 0x80


@dataclass(frozen=True, slots=True)
class GpuSample:
    timestamp: float  # seconds since the epoch (UTC)
    node: str
    gpu: int  # NVML / nvidia-smi index
    uuid: str | None = None
    temperature_c: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    utilization_pct: float | None = None
    ecc_corrected: int | None = None  # volatile count since the driver loaded
    ecc_uncorrected: int | None = None  # volatile count since the driver loaded
    rows_pending: bool | None = None  # a row remap or page retirement waits for a reset
    throttle_reasons: int | None = None  # bit mask of nvmlClocksEventReason*
    xids: tuple[int, ...] = ()  # Xid events since the previous sample
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    # The GPU's own limits (NVML's slowdown and shutdown temperature thresholds); the
    # risk model falls back to --eft-risk-temp-limit where a source cannot give them.
    temp_slowdown_c: float | None = None
    temp_shutdown_c: float | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.gpu)

    @property
    def hw_slowdown(self) -> bool | None:
        if self.throttle_reasons is None:
            return None
        return bool(self.throttle_reasons & HW_SLOWDOWN_MASK)

    def to_dict(self) -> dict:
        """Plain JSON-ready data (the timestamp also as ISO 8601 for people)."""
        data = dataclasses.asdict(self)
        data["xids"] = list(self.xids)
        data["time"] = iso_time(self.timestamp)
        return data


@dataclass(frozen=True, slots=True)
class DiskSpace:
    path: str
    free_bytes: int
    free_inodes: int | None  # None on file systems without inode accounting


@dataclass(frozen=True, slots=True)
class HostSample:
    timestamp: float
    node: str
    memory_total_mib: float | None
    memory_available_mib: float | None
    disks: tuple[DiskSpace, ...] = ()


def iso_time(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat()
