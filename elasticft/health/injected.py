"""A synthetic GPU health source for ``--eft-inject gpu_degrade`` (demos, tests, no NVML)."""

from __future__ import annotations

import time
from pathlib import Path

from elasticft.contract.run_dir import DEGRADE_MARKER
from elasticft.health.sample import GpuSample


class InjectedGpuSource:
    """The agent side of ``gpu_degrade``: a synthetic health source for machines without
    NVML, healthy until a worker marks a local GPU degraded in the run directory.

    Healthy readings are steady (a loaded GPU at 60 °C); the degraded GPU then reports
    a new uncorrectable ECC error, a pending row remap and Xid 79 (fallen off the bus)
    at every read: the critical events that make its risk 1.0.
    """

    def __init__(self, node: str, gpus: int, run_dir: Path):
        self._node = node
        self._gpus = gpus
        self._marker = Path(run_dir) / DEGRADE_MARKER
        self._uncorrected = 0

    def degraded_gpu(self) -> int | None:
        try:
            return int(self._marker.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def read(self) -> list[GpuSample]:
        now = time.time()
        bad = self.degraded_gpu()
        samples = []
        for gpu in range(self._gpus):
            failing = gpu == bad
            if failing:
                self._uncorrected += 1
            samples.append(GpuSample(
                timestamp=now, node=self._node, gpu=gpu, uuid=f"GPU-injected-{self._node}-{gpu}",
                temperature_c=60.0, memory_used_mib=40000.0, memory_total_mib=81920.0,
                power_w=300.0, power_limit_w=700.0, utilization_pct=95.0,
                ecc_corrected=0, ecc_uncorrected=self._uncorrected if failing else 0,
                rows_pending=failing, throttle_reasons=0, xids=(79,) if failing else (),
            ))
        return samples

    def close(self) -> None:
        pass
