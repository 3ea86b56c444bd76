"""``NotifyConfig``: notifications of the run's notable events (where they go: ``sinks``)."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob
from elasticft.config.sinks import Sink, parse_sinks


@dataclass
class NotifyConfig:
    """Notifications of the run's notable events (see elasticft/notify.py)."""

    notify: str = knob(
        "", "where to send notifications: KIND:TARGET or a JSON list of them; kinds webhook:URL, "
        "command:SHELL COMMAND (event JSON on stdin), file:PATH (JSON lines)"
    )
    notify_rate_limit: int = knob(5, "at most this many notifications of one event kind per window (0: no limit)")
    notify_window: float = knob(300.0, "seconds of the notification rate limit's window")

    def __post_init__(self) -> None:
        if self.notify_rate_limit < 0:
            raise ConfigError(f"{flag_name('notify_rate_limit')}: expected >= 0, got {self.notify_rate_limit}")
        if not self.notify_window > 0:
            raise ConfigError(f"{flag_name('notify_window')}: expected seconds > 0, got {self.notify_window}")
        self.sinks()  # validates the spec

    def sinks(self) -> list[Sink]:
        return parse_sinks(self.notify)
