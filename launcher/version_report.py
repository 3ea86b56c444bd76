"""The versions eft runs with, one line each, as ``eft-run --version`` and ``eft doctor`` print
them: eft's, Python's, torch's, megatron-core's (read without importing them) and NVML's driver.
"""

from __future__ import annotations

from elasticft import versions


def version_lines() -> list[str]:
    """eft's, Python's, torch's, megatron-core's and NVML's versions, and where each stands."""
    from elasticft.health.nvml import driver_summary

    rows = [_as_the_mode_judges(row) for row in versions.standing()] + [("NVML", "", driver_summary())]
    width = max(len(what) for what, _, _ in rows)
    return [f"{what:<{width}}  {version}{'  ' if version and where else ''}{where}".rstrip()
            for what, version, where in rows]


def _as_the_mode_judges(row: tuple[str, str, str]) -> tuple[str, str, str]:
    """megatron-core's row in the Megatron-LM mode's own verdict where the range alone cannot give
    it: a minor newer than the tested ones runs untested only if every site eft relies on is there
    (``megatron_seam.version_status``, which then imports Megatron), else the mode refuses it."""
    what, version, _ = row
    if what != "megatron-core" or versions.judge(versions.MEGATRON_CORE, version).support \
            is not versions.Support.UNTESTED:
        return row
    from elasticft import megatron_seam

    support, why = megatron_seam.version_status(version)
    return what, version, f"{support} for the Megatron-LM mode: {why}"
