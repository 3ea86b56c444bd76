"""The NVLink domain a node's GPUs belong to, from NVML's GPU fabric information.

On NVSwitch systems that span several nodes (GB200 NVL72 and its kin) the driver and the
fabric manager give each GPU the UUID of its NVLink cluster and the clique (partition) it is
in: GPUs with the same pair talk over NVLink, others over the network. eft names a node's
segment by that pair (``segment.py``), so that spares replace nodes inside the same domain.

Where the driver gives no fabric information (no NVSwitch domain, an older driver, no GPU),
the node has no domain: ``None``, never an error.
"""

from __future__ import annotations

import ctypes
import logging
import os
import uuid
from typing import Any

from elasticft.health.nvml import _text, visible_gpus

log = logging.getLogger(__name__)


def nvlink_domain(nvml: Any = None, visible_devices: str | None = None) -> str | None:
    """``<cluster uuid>/<clique id>`` shared by the workers' GPUs (CUDA_VISIBLE_DEVICES unless
    ``visible_devices``); None when NVML or the fabric information is unavailable, a GPU's
    fabric registration has not completed, or the GPUs disagree (logged: a node split across
    two domains cannot be placed in one)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return None
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        if visible_devices is None:
            visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        domains = {_domain(nvml, handles[i]) for i in visible_gpus(visible_devices, uuids)}
    except nvml.NVMLError as exc:
        log.info("no NVLink domain: NVML cannot list the GPUs (%s)", exc)
        return None
    finally:
        nvml.nvmlShutdown()
    if len(domains) != 1 or None in domains:
        if len(domains) > 1:
            log.warning("this node's GPUs report %d NVLink domains (%s): it is in none", len(domains),
                        ", ".join(sorted(str(d) for d in domains)))
        return None
    return domains.pop()


def _domain(nvml: Any, handle: Any) -> str | None:
    info = nvml.c_nvmlGpuFabricInfo_t()
    try:
        nvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    except (nvml.NVMLError, AttributeError):  # NotSupported, or a driver without the call
        return None
    if info.state != nvml.NVML_GPU_FABRIC_STATE_COMPLETED or info.status != nvml.NVML_SUCCESS:
        return None
    cluster = bytes(info.clusterUuid)
    if not any(cluster):  # registered, but in no cluster
        return None
    return f"{uuid.UUID(bytes=cluster)}/{info.cliqueId}"
