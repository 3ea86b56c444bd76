"""Configuration, one package: every knob of eft, one module per concern.

Each field of a concern's dataclass is a knob (``knobs.py``): a flag ``--eft-<name>``, a
variable ``EFT_<NAME>`` and the default written in the dataclass, with one line of help.
``Settings`` (``settings.py``) lists every concern once: the launcher adds its flags and
builds it, the agent takes it whole; workers read the concerns they need from ``EFT_*``
variables (``from_env``).

The launcher, the agent and the workers import the same way, ``from elasticft.config import
FTConfig, flag_name``; each name is loaded on first use from the module that defines it
(``_EXPORTS``), so that a worker reading one concern pays for that module alone, not for
``Settings`` and every other concern. A new concern: a module here, its names in
``_EXPORTS`` (``tests/test_config_package.py`` checks the list) and one field of ``Settings``.
"""

from __future__ import annotations

import importlib

# name -> the module of this package that defines it
_EXPORTS = {
    "ConfigError": ".knobs", "knob": ".knobs", "flag_name": ".knobs", "env_name": ".knobs",
    "parse_bool": ".knobs", "convert": ".knobs", "add_arguments": ".knobs", "from_args": ".knobs",
    "from_env": ".knobs", "signal_number": ".knobs",
    "MIN_LEASE_TTL": ".ft", "NODE_ID": ".ft", "FTConfig": ".ft",
    "RestartConfig": ".restarts",
    "PlannerConfig": ".planner",
    "CheckpointConfig": ".checkpoints",
    "WatchdogConfig": ".watchdogs",
    "NotifyConfig": ".notify",
    "SINK_KINDS": ".sinks", "Sink": ".sinks", "parse_sinks": ".sinks",
    "DEFAULT_TIMEOUTS": ".hangs", "HangConfig": ".hangs",
    "StragglerConfig": ".stragglers",
    "MemoryConfig": ".memory",
    "MegatronLMConfig": ".megatron_lm",
    "HealthConfig": ".health", "RiskConfig": ".health",
    "HousekeepingConfig": ".housekeeping",
    "SUSPECT_ACTIONS": ".numerics", "NumericsConfig": ".numerics",
    "SlurmConfig": ".slurm",
    "JOIN_AT": ".start", "StartConfig": ".start",
    "ReplicationConfig": ".replication",
    "MetricsConfig": ".metrics",
    "SegmentConfig": ".segments",
    "Settings": ".settings",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # found here from now on
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
