"""``StragglerConfig``: straggler detection from the ranks' step times."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class StragglerConfig:
    """Straggler detection from the ranks' step times (docs/stragglers.md)."""

    straggler_interval: float = knob(300.0, "seconds between two straggler checks across all ranks (0: off)")
    straggler_relative: float = knob(
        0.7, "a rank is a straggler below this relative score (the job's median step time / its own)"
    )
    straggler_individual: float = knob(
        0.7, "a rank is a straggler below this individual score (its own best step time / its current)"
    )
    straggler_action: str = knob(
        "report", "report: an event and the GPU's straggler risk factor; exclude: also leave the node out "
        "at the next restart"
    )

    def __post_init__(self) -> None:
        if self.straggler_interval < 0:
            raise ConfigError(f"{flag_name('straggler_interval')}: expected seconds >= 0, got {self.straggler_interval}")
        for name in ("straggler_relative", "straggler_individual"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{flag_name(name)}: expected a score in (0, 1], got {getattr(self, name)}")
        if self.straggler_action not in ("report", "exclude"):
            raise ConfigError(
                f"{flag_name('straggler_action')}: expected report or exclude, got {self.straggler_action!r}"
            )
