"""A fake NVML at the pynvml call level: the only test double in the health tests.

``FakeNvml`` has pynvml's function names, takes and returns what they do (handles,
structs with .used/.total/.gpu, milliwatts, event data with .device/.eventType/
.eventData), and raises pynvml's own NVMLError subclasses, so everything above the
pynvml calls runs for real. ``install(monkeypatch)`` puts its functions into the
real pynvml module; ``bench/sampler.py`` passes the object itself as the module. It
lives in bench/ for that bench, which must run without tests/ on the path.
"""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

DEVICE_FUNCTIONS = (
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetIndex",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureThreshold",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceRegisterEvents",
    "nvmlDeviceGetGpuFabricInfo",
)
FUNCTIONS = DEVICE_FUNCTIONS + (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlEventSetCreate",
    "nvmlEventSetWait",
    "nvmlEventSetWait_v2",
    "nvmlEventSetFree",
)


@dataclass
class FakeGpu:
    index: int
    uuid: str
    temperature: int = 65
    slowdown_c: int = 87  # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    shutdown_c: int = 92  # NVML_TEMPERATURE_THRESHOLD_SHUTDOWN
    memory_used: int = 78_000 * 2**20  # bytes
    memory_total: int = 81_559 * 2**20
    power_mw: int = 612_000
    limit_mw: int = 700_000
    util: int = 97
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped: tuple = (0, 0, 0, 0)  # corrected, uncorrected, pending, failure
    reasons: int = 0x4
    sm_mhz: int = 1980
    mem_mhz: int = 2619
    unsupported: set = field(default_factory=set)  # function names that raise NotSupported
    lost: bool = False  # every call raises GpuIsLost
    # NVLink fabric: (cluster UUID, clique id) of a registered GPU; None: NotSupported (no NVSwitch domain)
    fabric: tuple[str, int] | None = None
    fabric_state: int = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)  # pynvml maps the code to its NVMLError_* subclass


class FakeNvml:
    """Stands in for the pynvml module for ``gpus``; constants and errors are pynvml's."""

    def __init__(self, gpus: list[FakeGpu] | None = None, count: int = 8, init_error: int | None = None):
        self.gpus = gpus if gpus is not None else [
            FakeGpu(i, f"GPU-{i:08x}-1111-2222-3333-{i:012x}") for i in range(count)
        ]
        self.init_error = init_error
        self.initialised = False
        self.calls: Counter = Counter()  # (function name, GPU index) -> calls
        self.registered: set[int] = set()
        self.pending_events: list[tuple[int, int]] = []  # (gpu index, xid)
        self.event_sets_freed = 0

    def __getattr__(self, name: str):
        # NVML_* constants, NVMLError* classes and nvmlEventType* masks come from pynvml.
        if name.startswith(("NVML", "nvmlEventType", "nvmlClocks")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def install(self, monkeypatch) -> "FakeNvml":
        for name in FUNCTIONS:
            monkeypatch.setattr(pynvml, name, getattr(self, name))
        return self

    def inject_xid(self, index: int, xid: int) -> None:
        self.pending_events.append((index, xid))

    # -- library ------------------------------------------------------------------

    def nvmlInit(self):
        if self.init_error is not None:
            raise _error(self.init_error)
        self.initialised = True

    def nvmlShutdown(self):
        self.initialised = False

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        if not 0 <= index < len(self.gpus):
            raise _error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    # -- devices ------------------------------------------------------------------

    def _check(self, gpu: FakeGpu, name: str) -> FakeGpu:
        self.calls[name, gpu.index] += 1
        if not self.initialised:
            raise _error(pynvml.NVML_ERROR_UNINITIALIZED)
        if gpu.lost:
            raise _error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if name in gpu.unsupported:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def nvmlDeviceGetUUID(self, h):
        return self._check(h, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetIndex(self, h):
        return self._check(h, "nvmlDeviceGetIndex").index

    def nvmlDeviceGetTemperature(self, h, sensor):
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._check(h, "nvmlDeviceGetTemperature").temperature

    def nvmlDeviceGetTemperatureThreshold(self, h, threshold):
        g = self._check(h, "nvmlDeviceGetTemperatureThreshold")
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return g.slowdown_c
        if threshold == pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
            return g.shutdown_c
        raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        g = self._check(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=g.memory_total, used=g.memory_used, free=g.memory_total - g.memory_used)

    def nvmlDeviceGetPowerUsage(self, h):
        return self._check(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return self._check(h, "nvmlDeviceGetEnforcedPowerLimit").limit_mw

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=self._check(h, "nvmlDeviceGetUtilizationRates").util, memory=40)

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        g = self._check(h, "nvmlDeviceGetTotalEccErrors")
        assert counter_type == pynvml.NVML_VOLATILE_ECC
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return g.ecc_corrected
        return g.ecc_uncorrected

    def nvmlDeviceGetRemappedRows(self, h):
        return self._check(h, "nvmlDeviceGetRemappedRows").remapped

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        self._check(h, "nvmlDeviceGetRetiredPagesPendingStatus")
        return pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._check(h, "nvmlDeviceGetCurrentClocksEventReasons").reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return self._check(h, "nvmlDeviceGetCurrentClocksThrottleReasons").reasons

    def nvmlDeviceGetClockInfo(self, h, clock):
        g = self._check(h, "nvmlDeviceGetClockInfo")
        return g.sm_mhz if clock == pynvml.NVML_CLOCK_SM else g.mem_mhz

    def nvmlDeviceGetGpuFabricInfo(self, h, info_ref):
        g = self._check(h, "nvmlDeviceGetGpuFabricInfo")
        if g.fabric is None:
            raise _error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        info = info_ref._obj  # pynvml's caller passes ctypes.byref(c_nvmlGpuFabricInfo_t())
        cluster, clique = g.fabric
        info.clusterUuid[:] = list(uuid.UUID(cluster).bytes)
        info.cliqueId, info.state, info.status = clique, g.fabric_state, pynvml.NVML_SUCCESS
        return pynvml.NVML_SUCCESS

    # -- events -------------------------------------------------------------------

    def nvmlEventSetCreate(self):
        return SimpleNamespace(kind="event set")

    def nvmlDeviceRegisterEvents(self, h, event_types, event_set):
        g = self._check(h, "nvmlDeviceRegisterEvents")
        assert event_types & pynvml.nvmlEventTypeXidCriticalError
        self.registered.add(g.index)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        while self.pending_events:
            index, xid = self.pending_events.pop(0)
            if index in self.registered:
                return SimpleNamespace(
                    device=self.gpus[index],
                    eventType=pynvml.nvmlEventTypeXidCriticalError,
                    eventData=xid,
                    gpuInstanceId=0,
                    computeInstanceId=0,
                )
        raise _error(pynvml.NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, event_set, timeout_ms):
        return self.nvmlEventSetWait_v2(event_set, timeout_ms)

    def nvmlEventSetFree(self, event_set):
        self.event_sets_freed += 1
