"""Knobs of eft-run under SLURM beyond ``--eft-slurm`` (which ``elasticft.config.FTConfig`` holds)."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class SlurmConfig:
    """How the agents of one SLURM job share what only the controller knows."""

    slurm_end_time_wait: float = knob(
        60.0, "where SLURM_JOB_END_TIME is unset, seconds an agent waits for the one agent of the job that asks "
        "squeue for the time limit (shared through etcd) before it goes on without one (0: every agent asks squeue)"
    )

    def __post_init__(self) -> None:
        if self.slurm_end_time_wait < 0:
            raise ConfigError(f"{flag_name('slurm_end_time_wait')}: expected >= 0, got {self.slurm_end_time_wait}")
