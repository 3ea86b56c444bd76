"""Reading a DCGM exporter's metrics from a Prometheus text dump into ``GpuSample``s.

A dump is Prometheus' text exposition format with a timestamp on every sample, as
``promtool tsdb dump`` or the ``/federate`` endpoint write it::

    DCGM_FI_DEV_GPU_TEMP{gpu="3",UUID="GPU-…",Hostname="node-a"} 71 1714564800000

Samples of one GPU (``Hostname`` and ``gpu`` labels) with one timestamp make one
``GpuSample``; a metric not in ``DCGM_FIELDS`` is ignored, an absent one is missing.
A scrape without timestamps (``curl host:9400/metrics``) cannot be replayed: the times
are what the model measures rates and lead times with, so it is an error.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterable, Iterator

from elasticft.health.sample import GpuSample


class DumpError(ValueError):
    """A malformed dump; the message starts with ``FILE:LINE:`` (trace.py makes it a TraceError)."""

# dcgm-exporter metric -> GpuSample field (units as DCGM gives them: C, W, %, MiB, MHz).
DCGM_FIELDS = {
    "DCGM_FI_DEV_GPU_TEMP": "temperature_c",
    "DCGM_FI_DEV_POWER_USAGE": "power_w",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": "power_limit_w",
    "DCGM_FI_DEV_GPU_UTIL": "utilization_pct",
    "DCGM_FI_DEV_FB_USED": "memory_used_mib",
    "DCGM_FI_DEV_FB_FREE": "memory_free_mib",  # total = used + free
    "DCGM_FI_DEV_SM_CLOCK": "sm_clock_mhz",
    "DCGM_FI_DEV_MEM_CLOCK": "mem_clock_mhz",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "ecc_corrected",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "ecc_uncorrected",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": "throttle_reasons",
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": "throttle_reasons",
    "DCGM_FI_DEV_ROW_REMAP_PENDING": "rows_pending",
    "DCGM_FI_DEV_XID_ERRORS": "xid",  # the last Xid: a new value is a new event
    "DCGM_FI_DEV_SLOWDOWN_TEMP": "temp_slowdown_c",
    "DCGM_FI_DEV_SHUTDOWN_TEMP": "temp_shutdown_c",
}
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+(-?\d+))?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_INT_FIELDS = {"ecc_corrected", "ecc_uncorrected", "throttle_reasons", "xid"}


def looks_like_prometheus(line: str) -> bool:
    """A metric name followed by labels or a value: no CSV header looks like that."""
    return bool(_LINE.match(line.strip())) and "," not in line.split("{")[0]


def _labels(text: str, where: str) -> dict[str, str]:
    labels, pos = {}, 0
    while pos < len(text):
        match = _LABEL.match(text, pos)
        if not match:
            raise DumpError(f"{where}: malformed labels {{{text}}}")
        labels[match.group(1)] = match.group(2)
        pos = match.end()
    return labels


def read_prometheus(path: Path, lines: Iterable[tuple[int, str]], node: str | None) -> Iterator[GpuSample]:
    """GpuSamples from numbered lines of a dump, in time order (rounds of one timestamp)."""
    rows: dict[tuple[int, str, int], dict] = {}
    for number, line in lines:
        where = f"{path}:{number}"
        match = _LINE.match(line.strip())
        if not match:
            raise DumpError(f"{where}: not a Prometheus sample line: {line.strip()[:60]!r}")
        name, label_text, value_text, stamp = match.groups()
        field = DCGM_FIELDS.get(name)
        if field is None:
            continue
        labels = _labels(label_text or "", where)
        try:
            value = float(value_text)
        except ValueError:
            raise DumpError(f"{where}: bad value {value_text!r}") from None
        if stamp is None:
            raise DumpError(f"{where}: sample without a timestamp: replay needs a dump with times "
                             "(promtool tsdb dump, /federate), not a single scrape")
        if "gpu" not in labels or not labels["gpu"].isdigit():
            raise DumpError(f"{where}: {name} without a numeric 'gpu' label")
        key = (int(stamp), node or labels.get("Hostname") or path.stem, int(labels["gpu"]))
        row = rows.setdefault(key, {"uuid": labels.get("UUID")})
        if not math.isfinite(value):
            continue  # DCGM's blank values: missing
        row[field] = int(value) if field in _INT_FIELDS else bool(value) if field == "rows_pending" else value
    last_xid: dict[tuple[str, int], int] = {}
    for (stamp, host, gpu), row in sorted(rows.items()):
        free = row.pop("memory_free_mib", None)
        if free is not None and row.get("memory_used_mib") is not None:
            row["memory_total_mib"] = row["memory_used_mib"] + free
        xid = row.pop("xid", None)
        xids = ()
        if xid and xid != last_xid.get((host, gpu)):
            xids = (xid,)
        if xid is not None:
            last_xid[(host, gpu)] = xid
        yield GpuSample(timestamp=stamp / 1000.0, node=host, gpu=gpu, xids=xids, **row)
