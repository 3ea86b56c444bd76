"""The knobs of the numbers check (``elasticft.worker.numerics``): NaN, loss spikes, re-runs.

The agent passes them to its workers as ``EFT_*`` variables (``worker_environment``); the
defaults and why they are what they are: docs/numerics.md.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from elasticft.config.knobs import ConfigError, env_name, flag_name, knob

SUSPECT_ACTIONS = ("report", "exclude")


@dataclass
class NumericsConfig:
    """Rollback on bad numbers: what counts as bad, and what a repeat offender's node gets."""

    numerics_check: bool = knob(
        True, "roll back and re-run an iteration whose loss or gradient norm is NaN/Inf or whose loss spikes "
        "(needs hook.step(iteration, loss=...))"
    )
    spike_window: int = knob(20, "good iterations whose losses make the robust level a spike is judged against")
    spike_min_history: int = knob(10, "losses the window must hold before spikes are judged (NaN always is)")
    spike_mads: float = knob(
        8.0, "a spike is a loss more than this many scaled MADs above the window's median ..."
    )
    spike_min_rise: float = knob(0.3, "... and more than this fraction above the median (0.3: 1.3 times it)")
    rerun_tolerance: float = knob(
        1e-6, "relative difference below which a re-run's loss and gradient norm count as the same (bad data)"
    )
    suspect_after: int = knob(2, "faults a node is implicated in before it is node_suspect (its GPUs' risk 1.0)")
    suspect_action: str = knob(
        "report", "report: an event and risk 1.0 for a suspect node; exclude: also leave the node out at the "
        "next restart"
    )

    def __post_init__(self) -> None:
        if self.spike_window < 2:
            raise ConfigError(f"{flag_name('spike_window')}: expected >= 2, got {self.spike_window}")
        if not 2 <= self.spike_min_history <= self.spike_window:
            raise ConfigError(f"{flag_name('spike_min_history')}: expected 2 to --eft-spike-window "
                              f"({self.spike_window}), got {self.spike_min_history}")
        for name in ("spike_mads", "spike_min_rise", "rerun_tolerance"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"{flag_name(name)}: expected >= 0, got {getattr(self, name)}")
        if self.suspect_after < 1:
            raise ConfigError(f"{flag_name('suspect_after')}: expected >= 1, got {self.suspect_after}")
        if self.suspect_action not in SUSPECT_ACTIONS:
            raise ConfigError(f"{flag_name('suspect_action')}: expected report or exclude, got {self.suspect_action!r}")

    def worker_environment(self) -> dict[str, str]:
        """The variables the workers read these knobs from (``from_env``)."""
        return {env_name(f.name): str(getattr(self, f.name)) for f in fields(self)}
