"""``RestartConfig``: job-wide restart limits, counted once per restart cycle in etcd."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class RestartConfig:
    """Job-wide restart limits, counted once per restart cycle in etcd (elasticft/agent/restart_budget.py)."""

    max_job_restarts: int = knob(
        -1, "restarts of failed or hung workers the whole job may make, counted once per restart cycle "
        "whatever the number of nodes (-1: the value of --max-restarts); torch's per-agent --max-restarts "
        "still applies"
    )
    max_no_progress_restarts: int = knob(
        3, "end the job with exit code 3 (do not requeue) after this many restart cycles in a row with no "
        "newer complete checkpoint and no iteration past where the previous cycle died (0: off)"
    )

    def __post_init__(self) -> None:
        if self.max_job_restarts < -1:
            raise ConfigError(f"{flag_name('max_job_restarts')}: expected >= 0 (or -1: the value of "
                              f"--max-restarts), got {self.max_job_restarts}")
        if self.max_no_progress_restarts < 0:
            raise ConfigError(f"{flag_name('max_no_progress_restarts')}: expected >= 0 (0: off), "
                              f"got {self.max_no_progress_restarts}")

    def job_restarts(self, max_restarts: int) -> int:
        """The job-wide budget: ``--eft-max-job-restarts``, else torch's ``--max-restarts``."""
        return max_restarts if self.max_job_restarts < 0 else self.max_job_restarts
