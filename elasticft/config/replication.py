"""Knobs of the memory tier's replication: how far it may lag before the snapshots back off."""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class ReplicationConfig:
    """docs/memory-checkpoints.md, "When replication is slower than the snapshots"."""

    mem_ckpt_max_lag: int = knob(
        2, "memory snapshots a node may take after the newest one with every replica in place; past it "
        "the workers take none until replication catches up, and a mem_ckpt_lag event says so"
    )

    def __post_init__(self) -> None:
        if self.mem_ckpt_max_lag < 1:
            raise ConfigError(f"{flag_name('mem_ckpt_max_lag')}: expected >= 1, got {self.mem_ckpt_max_lag}")
