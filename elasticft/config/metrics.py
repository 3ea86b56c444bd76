"""``MetricsConfig``: the agent's Prometheus endpoint (docs/metrics.md)."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob

_OFF = -1  # --eft-metrics-port's default: no endpoint


@dataclass
class MetricsConfig:
    """Where each agent serves ``/metrics`` (off unless a port is given: docs/metrics.md says why)."""

    metrics_port: int = knob(
        _OFF, "port each agent serves Prometheus metrics on at /metrics (0: a free port, published in the node's "
        "record for `eft metrics targets`; -1: off)"
    )
    metrics_host: str = knob(
        "", "address the metrics endpoint listens on (empty: every interface; 127.0.0.1 keeps it on the node)"
    )
    metrics_goodput_interval: float = knob(
        60.0, "seconds between two computations of the job's GPU-seconds by cause from the event log, on the node "
        "of global rank 0 (0: not exported)"
    )

    def __post_init__(self) -> None:
        if not _OFF <= self.metrics_port <= 65535:
            raise ConfigError(f"{flag_name('metrics_port')}: expected a port 0-65535 or -1 (off), "
                              f"got {self.metrics_port}")
        if self.metrics_goodput_interval < 0:
            raise ConfigError(f"{flag_name('metrics_goodput_interval')}: expected seconds >= 0, "
                              f"got {self.metrics_goodput_interval}")

    @property
    def enabled(self) -> bool:
        return self.metrics_port != _OFF
