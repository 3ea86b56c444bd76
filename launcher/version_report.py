"""The versions eft runs with, one line each, as ``eft-run --version`` and ``eft doctor`` print
them: eft's, Python's, torch's, megatron-core's (read without importing them) and NVML's driver.
"""

from __future__ import annotations

from elasticft import versions


def version_lines() -> list[str]:
    """eft's, Python's, torch's, megatron-core's and NVML's versions, and where each stands."""
    from elasticft.health.nvml import driver_summary

    rows = [*versions.standing(), ("NVML", "", driver_summary())]
    width = max(len(what) for what, _, _ in rows)
    return [f"{what:<{width}}  {version}{'  ' if version and where else ''}{where}".rstrip()
            for what, version, where in rows]
