"""Knobs of how workers start and nodes join: warm interpreters, the moment a node joins."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob

JOIN_AT = ("now", "save")


@dataclass
class StartConfig:
    """What a restart costs beyond detection, the round and the load."""

    warm_workers: bool = knob(
        False, "keep one worker interpreter per local rank started ahead of need, its heavy imports done, and "
        "hand it the next generation's environment and command at a restart (any doubt: a cold start)"
    )
    preload: str = knob(
        "auto", "modules a warm interpreter imports ahead of need, comma-separated; 'auto' stands for the "
        "script's opening imports of installed packages and the modules it declares in __eft_preload__"
    )
    join_at: str = knob(
        "save", "when a node that comes back or a spare joins a running job: 'save' at the next checkpoint "
        "of either tier (then the restart loses no work), 'now' at once"
    )
    join_wait: float = knob(
        600.0, "with --eft-join-at save, the most seconds a joining node waits for the next checkpoint "
        "before it joins anyway"
    )

    def __post_init__(self) -> None:
        if self.join_at not in JOIN_AT:
            raise ConfigError(f"{flag_name('join_at')}: expected one of {', '.join(JOIN_AT)}, got {self.join_at!r}")
        if self.join_wait < 0:
            raise ConfigError(f"{flag_name('join_wait')}: expected >= 0, got {self.join_wait}")
        names = [m.strip() for m in self.preload.split(",")]
        bad = [m for m in names if m != "auto" and not all(p.isidentifier() for p in m.split("."))]
        if bad or not any(names):
            raise ConfigError(f"{flag_name('preload')}: expected module names and 'auto', comma-separated, "
                              f"got {self.preload!r}")

    def preload_modules(self) -> tuple[list[str], bool]:
        """(the modules named, whether 'auto' is among them)."""
        names = [m.strip() for m in self.preload.split(",") if m.strip()]
        return [m for m in names if m != "auto"], "auto" in names
