"""The GPU health sampler's and risk model's knobs (re-exported by ``elasticft.config``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class HealthConfig:
    """The GPU health sampler that runs inside every node agent."""

    health_interval: float = knob(10.0, "seconds between two GPU health samples (at least 0.5)")
    health_source: str = knob(
        "",
        "where GPU telemetry comes from: nvml, replay:PATH (a CSV trace), none; "
        "empty means nvml when NVML loads, else none",
    )

    def __post_init__(self) -> None:
        if not self.health_interval >= 0.5:
            raise ConfigError(
                f"{flag_name('health_interval')}: expected seconds >= 0.5, got {self.health_interval}"
            )


@dataclass
class RiskConfig:
    """The per-GPU risk score (see docs/health.md for what each factor measures)."""

    risk_window: int = knob(60, "samples in each GPU's rolling baseline")
    risk_threshold: float = knob(0.8, "risk score at or above which a GPU asks for an emergency checkpoint")
    risk_temp_limit: float = knob(
        85.0, "slowdown temperature (C) for a GPU that does not report its own (shutdown: 5 C above)"
    )
    risk_checkpoint_time: float = knob(
        120.0, "seconds an emergency checkpoint takes: a GPU due at a limit within this plus 5 minutes triggers"
    )
    risk_sustain_seconds: float = knob(
        300.0, "a factor that compares a GPU with its busy peers (clocks, power, power instability, utilization "
        "drop) and stays at 0.75 or more this long counts at weight 1: that strong, that long, is not noise (0: never)"
    )
    risk_power_window: float = knob(
        300.0, "seconds of each GPU's power, against its peers', over which its power instability is measured "
        "(at least 20 samples, at most 600)"
    )
    # Each weight is the probability the factor alone gives at full strength (noisy-OR).
    risk_weight_temperature: float = knob(1.0, "weight of the temperature factor (distance to slowdown/shutdown)")
    risk_weight_time_to_limit: float = knob(
        1.0, "weight of the time-to-limit factor (shutdown temperature or full memory at the current rate)"
    )
    risk_weight_errors: float = knob(0.9, "weight of the errors factor (ECC rate, HW slowdown beyond the peers)")
    risk_weight_clocks: float = knob(0.6, "weight of the clocks-below-busy-peers factor")
    risk_weight_power: float = knob(0.5, "weight of the power-fluctuation factor")
    risk_weight_power_instability: float = knob(
        0.5, "weight of the power-instability factor (power spread wider than the peers' over the power window)"
    )
    risk_weight_utilization_drop: float = knob(0.5, "weight of the utilization-drop-while-peers-are-busy factor")
    risk_weight_peer_temp: float = knob(0.5, "weight of the hotter-than-usual-against-its-peers factor")
    risk_weight_memory: float = knob(0.3, "weight of the memory-headroom factor (the last 2 percent)")
    risk_weight_straggler: float = knob(
        0.5, "weight of the straggler factor (the GPU's rank is slower than the job or than itself)"
    )

    def __post_init__(self) -> None:
        if not self.risk_window >= 10:
            raise ConfigError(f"{flag_name('risk_window')}: expected samples >= 10, got {self.risk_window}")
        if not 0 < self.risk_threshold <= 1:
            raise ConfigError(
                f"{flag_name('risk_threshold')}: expected a number in (0, 1], got {self.risk_threshold}"
            )
        if not self.risk_sustain_seconds >= 0:
            raise ConfigError(f"{flag_name('risk_sustain_seconds')}: expected seconds >= 0, got {self.risk_sustain_seconds}")
        if not 30 <= self.risk_power_window <= 3600:
            raise ConfigError(f"{flag_name('risk_power_window')}: expected seconds in [30, 3600], got {self.risk_power_window}")
        if not self.risk_checkpoint_time >= 0:
            raise ConfigError(f"{flag_name('risk_checkpoint_time')}: expected seconds >= 0, got {self.risk_checkpoint_time}")
        weights = self.weights()
        for name, weight in weights.items():
            if not 0 <= weight <= 1:
                raise ConfigError(
                    f"{flag_name('risk_weight_' + name)}: expected a weight in [0, 1], got {weight}"
                )
        if sum(weights.values()) <= 0:
            raise ConfigError("--eft-risk-weight-*: at least one weight must be positive")

    def weights(self) -> dict[str, float]:
        """Factor name -> weight, in the order the factors are documented."""
        prefix = "risk_weight_"
        return {
            f.name[len(prefix):]: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name.startswith(prefix)
        }
