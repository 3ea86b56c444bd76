"""``HangConfig``: section timeouts (set or learned) and how a hung rank's stacks are dumped."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob, signal_number
from elasticft.contract.progress import SECTIONS

DEFAULT_TIMEOUTS = {"setup": 600.0, "step": 180.0, "checkpointing": 420.0, "other": 300.0}


@dataclass
class HangConfig:
    """Section timeouts: a rank that stays too long in one section is hung (docs/hangs.md)."""

    timeouts: str = knob(
        ",".join(f"{name}={seconds:g}" for name, seconds in DEFAULT_TIMEOUTS.items()),
        "seconds a rank may stay in one section before it counts as hung, SECTION=SECONDS,... "
        "(sections setup, step, checkpointing, other; 0: no limit)",
    )
    auto_timeouts: bool = knob(
        False,
        "learn the section timeouts from observed durations (longest seen x --eft-timeout-factor) "
        "and keep them in etcd and the checkpoint directory for the next run",
    )
    timeout_factor: float = knob(5.0, "safety factor on the longest observed section for --eft-auto-timeouts")
    stack_dumper: str = knob(
        "auto", "how a hung rank's Python stacks get into the log: auto (py-spy when installed, else "
        "faulthandler), py-spy, faulthandler, off"
    )
    stack_signal: str = knob(
        "SIGUSR2", "signal that makes a worker print its Python stacks (faulthandler) when py-spy is not used"
    )

    def __post_init__(self) -> None:
        if self.stack_dumper not in ("auto", "py-spy", "faulthandler", "off"):
            raise ConfigError(
                f"{flag_name('stack_dumper')}: expected auto, py-spy, faulthandler or off, got {self.stack_dumper!r}"
            )
        if not self.timeout_factor >= 1:
            raise ConfigError(f"{flag_name('timeout_factor')}: expected a factor >= 1, got {self.timeout_factor}")
        self.section_timeouts()  # validates the spec
        self.stack_signum()

    def section_timeouts(self) -> dict[str, float]:
        """``--eft-timeouts`` as section -> seconds; sections it does not name keep their default."""
        out = dict(DEFAULT_TIMEOUTS)
        for item in filter(None, (part.strip() for part in self.timeouts.split(","))):
            name, eq, value = item.partition("=")
            name = name.strip()
            try:
                seconds = float(value) if eq else -1.0
            except ValueError:
                seconds = -1.0
            if name not in SECTIONS or not seconds >= 0:
                raise ConfigError(
                    f"{flag_name('timeouts')}: expected SECTION=SECONDS with SECTION one of "
                    f"{', '.join(SECTIONS)} and SECONDS >= 0, got {item!r}"
                )
            out[name] = seconds
        return out

    def stack_signum(self) -> int:
        return signal_number(self.stack_signal, "stack_signal")
