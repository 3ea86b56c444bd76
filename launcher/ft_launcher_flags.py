"""NVRx ft_launcher's fault-tolerance flags, read as eft's knobs.

Megatron-LM's and Megatron-Bridge's docs launch with NVRx's ``ft_launcher``, a torchrun
with ``--ft-*`` flags for its rank monitors. eft-run accepts them, so such a command line
changes only the launcher's name: the section timeouts become eft's (``--eft-timeouts``),
and the flags whose work eft does another way are accepted with one line saying how.

Each parameter has ft_launcher's three spellings: ``--ft-<name-with-dashes>``,
``--ft-<name_with_underscores>`` and Megatron-LM's ``--ft-param-<name_with_underscores>``.
A value given to one of them wins over ``--eft-timeouts`` for the sections it names.
"""

from __future__ import annotations

import dataclasses
import logging

from elasticft.config import ConfigError, Settings

log = logging.getLogger("elasticft.launcher")

SECTION_TIMEOUTS = "rank_section_timeouts"  # "setup:600,step:180,checkpointing:420"
OUT_OF_SECTION = "rank_out_of_section_timeout"  # seconds outside any section: eft's "other"
# ft_launcher parameters eft covers in its own way: what a user reads when one is given.
ELSEWHERE = {
    "cfg_path": "eft takes no YAML: give these flags, or eft's own",
    "initial_rank_heartbeat_timeout": "eft times the setup section instead (--eft-timeouts setup=)",
    "rank_heartbeat_timeout": "eft times each section instead (--eft-timeouts)",
    "workload_check_interval": "eft reads the heartbeats every 0.5 s",
    "rank_termination_signal": "eft stops a hung rank with SIGKILL after its stacks are taken",
    "log_level": "eft's own is --eft-log-level",
    "restart_policy": "eft restarts every worker when one fails, as ft_launcher's only policy does",
    "enable_nic_monitor": "eft's health sampler watches the GPUs (--eft-health-source)",
    "node_health_check_endpoint": "eft's health sampler and node leases judge a node",
    "gpu_memory_reclaim_timeout": "eft ends the stopped workers' helpers before a restart",
    "max_no_progress_restarts": "eft's is --eft-max-no-progress-restarts",
}


def _spellings(name: str) -> list[str]:
    return [f"--ft-{name.replace('_', '-')}", f"--ft-{name}", f"--ft-param-{name}"]


def add_arguments(parser) -> None:
    group = parser.add_argument_group("NVRx ft_launcher's flags (read as eft's knobs; docs/megatron-lm.md)")
    group.add_argument(*_spellings(SECTION_TIMEOUTS), dest="ft_" + SECTION_TIMEOUTS, metavar="SECTION:SECONDS,...",
                       help="section timeouts, as --eft-timeouts")
    group.add_argument(*_spellings(OUT_OF_SECTION), dest="ft_" + OUT_OF_SECTION, metavar="SECONDS",
                       help="the timeout outside any section: --eft-timeouts other=")
    for name in ELSEWHERE:
        group.add_argument(*_spellings(name), dest="ft_" + name, metavar="VALUE", help="accepted; " + ELSEWHERE[name])


def apply(args, settings: Settings) -> Settings:
    """``settings`` with the ft_launcher flags of ``args`` in force; one line for each accepted one
    that eft covers another way. A malformed value raises ConfigError naming the flag."""
    for name, how in ELSEWHERE.items():
        if getattr(args, "ft_" + name, None) is not None:
            log.warning("--ft-%s: accepted from ft_launcher's command line; %s", name.replace("_", "-"), how)
    given = {}
    sections = getattr(args, "ft_" + SECTION_TIMEOUTS, None)
    if sections is not None:
        for item in filter(None, (i.strip() for i in sections.split(","))):
            section, sep, seconds = item.partition(":")
            if not sep:
                raise ConfigError(f"--ft-rank-section-timeouts: expected SECTION:SECONDS,..., got {item!r}")
            given[section.strip()] = seconds.strip()
    other = getattr(args, "ft_" + OUT_OF_SECTION, None)
    if other is not None:
        given["other"] = other.strip()
    if not given:
        return settings
    current = {section: f"{seconds:g}" for section, seconds in settings.hang.section_timeouts().items()}
    merged = ",".join(f"{k}={v}" for k, v in {**current, **given}.items())
    try:
        hang = dataclasses.replace(settings.hang, timeouts=merged)
    except ConfigError as exc:
        raise ConfigError(f"--ft-rank-section-timeouts/--ft-rank-out-of-section-timeout: {exc}") from None
    log.info("ft_launcher's section timeouts in force: %s", hang.timeouts)
    return dataclasses.replace(settings, hang=hang)
