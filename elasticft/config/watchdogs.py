"""``WatchdogConfig``: the agent's watchdogs (checkpoint storage, host and GPU memory, silence)."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class WatchdogConfig:
    """The agent's watchdogs: checkpoint storage, CPU memory, GPU memory, silent workers (docs/watchdogs.md)."""

    watch_dirs: str = knob(
        "", "checkpoint directories whose free space and inodes are checked, comma-separated (empty: off)"
    )
    watch_keep: int = knob(
        2, "the free space and inodes each watched directory must have, in checkpoints the size of its newest"
    )
    mem_threshold: float = knob(
        95.0, "host memory use (percent) at which the job saves and exits before the OOM killer acts (0: off)"
    )
    watch_interval: float = knob(30.0, "seconds between two watchdog checks")
    gpu_mem_headroom: float = knob(
        2.0, "free GPU memory (percent of total) below which a GPU trips the watchdog and the job saves (0: off)"
    )
    silence_limit: float = knob(
        0.0, "seconds without a heartbeat or a log line from any local worker after which the watchdog trips (0: off)"
    )

    def __post_init__(self) -> None:
        if self.watch_keep < 1:
            raise ConfigError(f"{flag_name('watch_keep')}: expected >= 1, got {self.watch_keep}")
        if not 0 <= self.mem_threshold <= 100:
            raise ConfigError(f"{flag_name('mem_threshold')}: expected a percentage in [0, 100], got {self.mem_threshold}")
        if not 0 <= self.gpu_mem_headroom < 100:
            raise ConfigError(f"{flag_name('gpu_mem_headroom')}: expected a percentage in [0, 100), got {self.gpu_mem_headroom}")
        if self.silence_limit < 0:
            raise ConfigError(f"{flag_name('silence_limit')}: expected seconds >= 0, got {self.silence_limit}")
        if not self.watch_interval >= 0.5:
            raise ConfigError(f"{flag_name('watch_interval')}: expected seconds >= 0.5, got {self.watch_interval}")

    def dirs(self) -> list[str]:
        return [d.strip() for d in self.watch_dirs.split(",") if d.strip()]
