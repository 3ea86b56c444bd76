"""``Settings``: every concern's configuration, listed once.

The launcher adds one flag group per field and builds ``Settings`` from the parsed
flags; the agent takes it whole. A new concern is a module of ``elasticft.config``
(its names in ``_EXPORTS``) and one field here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from elasticft.config.checkpoints import CheckpointConfig
from elasticft.config.ft import FTConfig
from elasticft.config.hangs import HangConfig
from elasticft.config.health import HealthConfig, RiskConfig
from elasticft.config.housekeeping import HousekeepingConfig
from elasticft.config.knobs import add_arguments, from_args
from elasticft.config.megatron_lm import MegatronLMConfig
from elasticft.config.memory import MemoryConfig
from elasticft.config.metrics import MetricsConfig
from elasticft.config.notify import NotifyConfig
from elasticft.config.numerics import NumericsConfig
from elasticft.config.planner import PlannerConfig
from elasticft.config.replication import ReplicationConfig
from elasticft.config.restarts import RestartConfig
from elasticft.config.segments import SegmentConfig
from elasticft.config.slurm import SlurmConfig
from elasticft.config.start import StartConfig
from elasticft.config.stragglers import StragglerConfig
from elasticft.config.watchdogs import WatchdogConfig


def _concern(cls: type, title: str) -> object:
    """A field of ``Settings``: one concern's config and the title of its flag group."""
    return field(default_factory=cls, metadata={"title": title})


@dataclass(frozen=True)
class Settings:
    """Every concern's configuration (the module's docstring says who reads it)."""

    ft: FTConfig = _concern(FTConfig, "eft (each flag also reads an EFT_* variable)")
    health: HealthConfig = _concern(HealthConfig, "eft GPU health sampler")
    risk: RiskConfig = _concern(RiskConfig, "eft risk score")
    planner: PlannerConfig = _concern(PlannerConfig, "eft parallelism planner")
    ckpt: CheckpointConfig = _concern(CheckpointConfig, "eft checkpoints, switches and preemption")
    hang: HangConfig = _concern(HangConfig, "eft hang detection (section timeouts)")
    watchdog: WatchdogConfig = _concern(
        WatchdogConfig, "eft watchdogs (checkpoint storage, host and GPU memory, silence)")
    notify: NotifyConfig = _concern(NotifyConfig, "eft notifications")
    straggler: StragglerConfig = _concern(StragglerConfig, "eft straggler detection")
    memory: MemoryConfig = _concern(MemoryConfig, "eft memory checkpoints (host memory, replicated to peers)")
    replication: ReplicationConfig = _concern(
        ReplicationConfig, "eft memory checkpoint replication (how far it may lag behind the snapshots)")
    numerics: NumericsConfig = _concern(NumericsConfig, "eft numbers check (NaN and loss spikes roll back)")
    restarts: RestartConfig = _concern(RestartConfig, "eft job-wide restart limits (counted in etcd)")
    megatron_lm: MegatronLMConfig = _concern(MegatronLMConfig, "eft inside Megatron-LM's training loop")
    housekeeping: HousekeepingConfig = _concern(
        HousekeepingConfig, "eft etcd housekeeping (history compaction, the events bound)")
    slurm: SlurmConfig = _concern(SlurmConfig, "eft under SLURM (the job's time limit, asked once)")
    start: StartConfig = _concern(StartConfig, "eft worker starts and joins (warm interpreters, when a node joins)")
    segments: SegmentConfig = _concern(SegmentConfig, "eft segments (nodes a spare replaces within their domain)")
    metrics: MetricsConfig = _concern(MetricsConfig, "eft metrics (Prometheus, served by every agent)")

    @classmethod
    def add_arguments(cls, parser) -> None:
        """One flag group per concern; a malformed ``EFT_*`` variable raises ConfigError."""
        for f in dataclasses.fields(cls):
            add_arguments(parser, f.default_factory, f.metadata["title"])

    @classmethod
    def from_args(cls, args) -> "Settings":
        """Build every concern from the parsed flags; a bad value raises ConfigError."""
        return cls(**{f.name: from_args(f.default_factory, args) for f in dataclasses.fields(cls)})
