"""GPU telemetry from NVML (nvidia-ml-py), one ``GpuSample`` per local GPU per read.

A field the GPU or driver does not support becomes ``None``, never zero and never an
exception; once NVML says NotSupported the field is not asked for again. Xid events
come from an NVML event set where the driver offers one. The GPUs sampled are the
workers' GPUs: those named by CUDA_VISIBLE_DEVICES (indices or GPU-uuid prefixes).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from elasticft.health.sample import GpuSample

log = logging.getLogger(__name__)

MAX_EVENTS_PER_READ = 256  # a flood of Xids must not keep read() busy forever
_FROM_ENV = object()


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or initialised (no driver, no GPU)."""


def visible_gpus(spec: str | None, uuids: list[str]) -> list[int]:
    """NVML indices of the GPUs that CUDA_VISIBLE_DEVICES=``spec`` exposes, in CUDA order.

    As CUDA does: unset means all; entries are indices or (unique prefixes of) GPU
    uuids; an invalid entry hides itself and everything after it. Indices are
    matched in NVML (PCI bus) order, which is CUDA's order with
    CUDA_DEVICE_ORDER=PCI_BUS_ID and on nodes of identical GPUs.
    """
    if spec is None:
        return list(range(len(uuids)))
    chosen: list[int] = []
    for token in (t.strip() for t in spec.split(",")):
        index = None
        if token.isdigit() and int(token) < len(uuids):
            index = int(token)
        elif token.upper().startswith("GPU-"):
            matches = [i for i, u in enumerate(uuids) if u.upper().startswith(token.upper())]
            index = matches[0] if len(matches) == 1 else None
        if index is None:
            if token:
                log.warning("CUDA_VISIBLE_DEVICES entry %r names no GPU here; it and later ones are ignored", token)
            break
        if index not in chosen:
            chosen.append(index)
    return chosen


class NvmlSource:
    """Reads the local GPUs through ``nvml`` (the pynvml module unless one is given)."""

    def __init__(
        self,
        node_id: str,
        visible_devices: Any = _FROM_ENV,
        nvml: Any = None,
        clock: Callable[[], float] = time.time,
    ):
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:
                raise NvmlUnavailable(f"nvidia-ml-py is not installed: {exc}") from None
        self._nvml = nvml
        self.node_id = node_id
        self._clock = clock
        if visible_devices is _FROM_ENV:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML did not initialise: {exc}") from None
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        except nvml.NVMLError as exc:
            nvml.nvmlShutdown()
            raise NvmlUnavailable(f"NVML cannot list the GPUs: {exc}") from None
        self.gpus = [(i, handles[i], uuids[i]) for i in visible_gpus(visible_devices, uuids)]
        self._unsupported: set[tuple[int, str]] = set()
        self._failing: set[tuple[int, str]] = set()
        self._events = self._register_xid_events()
        # The thermal limits are fixed per board: read once here, not at every sample.
        self.limits = {index: self._limits(index, handle) for index, handle, _ in self.gpus}

    # -- Xid events ----------------------------------------------------------------

    def _register_xid_events(self):
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except (nvml.NVMLError, AttributeError) as exc:
            log.info("no Xid events: NVML event sets are not available (%s)", exc)
            return None
        registered = 0
        for index, handle, _ in self.gpus:
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
                registered += 1
            except nvml.NVMLError as exc:
                log.info("no Xid events for GPU %d: %s", index, exc)
        if not registered:
            nvml.nvmlEventSetFree(event_set)
            return None
        return event_set

    def _drain_xids(self) -> dict[int, list[int]]:
        """Xids that arrived since the last call, by GPU index (never blocks)."""
        nvml, found = self._nvml, {}
        if self._events is None:
            return found
        wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        ours = {index for index, _, _ in self.gpus}
        for _ in range(MAX_EVENTS_PER_READ):
            try:
                data = wait(self._events, 0)
            except nvml.NVMLError_Timeout:
                break
            except nvml.NVMLError as exc:
                log.warning("reading NVML events failed: %s", exc)
                break
            if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                index = nvml.nvmlDeviceGetIndex(data.device)
            except nvml.NVMLError:
                continue
            if index in ours:
                found.setdefault(index, []).append(int(data.eventData))
        return found

    # -- fields ----------------------------------------------------------------------

    def _get(self, index: int, name: str, read: Callable[[], Any]) -> Any:
        """``read()``, or None when this GPU cannot give ``name`` (logged once)."""
        nvml = self._nvml
        if (index, name) in self._unsupported:
            return None
        try:
            value = read()
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound, AttributeError):
            self._unsupported.add((index, name))
            log.debug("GPU %d does not report %s", index, name)
            return None
        except nvml.NVMLError as exc:
            if (index, name) not in self._failing:
                self._failing.add((index, name))
                log.warning("GPU %d: reading %s failed: %s", index, name, exc)
            return None
        self._failing.discard((index, name))
        return value

    def _limits(self, index: int, handle: Any) -> tuple[float | None, float | None]:
        """(slowdown, shutdown) temperature thresholds in C; None where NVML does not say."""
        nvml = self._nvml
        return tuple(
            _num(self._get(index, f"threshold_{name}", lambda k=kind: nvml.nvmlDeviceGetTemperatureThreshold(handle, k)))
            for name, kind in (("slowdown", nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                               ("shutdown", nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN))
        )

    def _sample(self, index: int, handle: Any, uuid: str, now: float, xids: list[int]) -> GpuSample:
        nvml, get = self._nvml, self._get
        memory = get(index, "memory", lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        power = get(index, "power", lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        limit = get(index, "power_limit", lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
        util = get(index, "utilization", lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        ecc = {
            kind: get(index, f"ecc_{kind}", lambda k=kind: nvml.nvmlDeviceGetTotalEccErrors(
                handle, getattr(nvml, f"NVML_MEMORY_ERROR_TYPE_{k.upper()}"), nvml.NVML_VOLATILE_ECC))
            for kind in ("corrected", "uncorrected")
        }
        rows_pending = None
        remapped = get(index, "remapped_rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
        if remapped is not None:
            rows_pending = bool(remapped[2] or remapped[3])  # pending, or remapping failed
        else:  # GPUs before Ampere retire pages instead of remapping rows
            retired = get(index, "retired_pending", lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
            rows_pending = None if retired is None else bool(retired)
        reasons = get(index, "clock_events", lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
        if reasons is None:  # the name before driver 535
            reasons = get(index, "throttle", lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))
        return GpuSample(
            timestamp=now,
            node=self.node_id,
            gpu=index,
            uuid=uuid,
            temperature_c=_num(get(index, "temperature", lambda: nvml.nvmlDeviceGetTemperature(
                handle, nvml.NVML_TEMPERATURE_GPU))),
            memory_used_mib=None if memory is None else memory.used / 2**20,
            memory_total_mib=None if memory is None else memory.total / 2**20,
            power_w=None if power is None else power / 1000.0,
            power_limit_w=None if limit is None else limit / 1000.0,
            utilization_pct=None if util is None else float(util.gpu),
            ecc_corrected=ecc["corrected"],
            ecc_uncorrected=ecc["uncorrected"],
            rows_pending=rows_pending,
            throttle_reasons=reasons,
            xids=tuple(xids),
            sm_clock_mhz=_num(get(index, "sm_clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM))),
            mem_clock_mhz=_num(get(index, "mem_clock", lambda: nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM))),
            temp_slowdown_c=self.limits[index][0],
            temp_shutdown_c=self.limits[index][1],
        )

    def read(self) -> list[GpuSample]:
        xids = self._drain_xids()
        now = self._clock()
        return [self._sample(i, h, u, now, xids.get(i, [])) for i, h, u in self.gpus]

    def close(self) -> None:
        nvml = self._nvml
        try:
            if self._events is not None:
                nvml.nvmlEventSetFree(self._events)
                self._events = None
            nvml.nvmlShutdown()
        except nvml.NVMLError as exc:
            log.debug("NVML shutdown: %s", exc)


def _num(value: Any) -> float | None:
    return None if value is None else float(value)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_summary(nvml: Any = None) -> str:
    """NVML's driver and GPUs in one line (``eft doctor``, ``eft-run --version``), or why there
    is no NVML here: the sampler's risk scores need it, and a CPU machine has none."""
    try:
        if nvml is None:
            import pynvml as nvml
    except ImportError as exc:
        return f"not available: nvidia-ml-py is not installed ({exc})"
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return f"not available: {exc}"
    try:
        count = nvml.nvmlDeviceGetCount()
        names = sorted({_text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i))) for i in range(count)})
        return f"driver {_text(nvml.nvmlSystemGetDriverVersion())}, {count} GPU(s): {', '.join(names) or '-'}"
    except nvml.NVMLError as exc:
        return f"initialised, but cannot list the GPUs: {exc}"
    finally:
        nvml.nvmlShutdown()
