"""etcd housekeeping's knobs (re-exported by ``elasticft.config``): compaction and the events bound."""

from __future__ import annotations

import os
from dataclasses import dataclass

from elasticft.config.knobs import ConfigError, flag_name, knob


@dataclass
class HousekeepingConfig:
    """What one agent of the run does every few minutes so that a long job stays within etcd's quota."""

    compact_interval: float = knob(
        300.0, "seconds between two rounds of etcd housekeeping by one agent of the run: compaction of etcd's "
        "history and the --eft-max-events bound (0: off)"
    )
    compact_retention: float = knob(
        600.0, "seconds of etcd history a compaction keeps (every run's: compaction is cluster-wide); never "
        "older than the revision a live eft run's current rendezvous round formed at"
    )
    max_events: int = knob(
        10000, "events kept in etcd; the oldest beyond it are appended to --eft-events-archive and deleted (0: no bound)"
    )
    events_archive: str = knob(
        "", "JSON-lines file the events beyond --eft-max-events go to, on the node that moves them (default: "
        "<--eft-events-file>.archive, else eft-events-<run id>.archive.jsonl in the launch directory)"
    )

    def __post_init__(self) -> None:
        for name in ("compact_interval", "compact_retention", "max_events"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{flag_name(name)}: expected >= 0, got {getattr(self, name)}")

    def archive_path(self, events_file: str, run_id: str) -> str:
        """Where moved events go: absolute, fixed at the agent's start (its launch directory)."""
        path = self.events_archive or (f"{events_file}.archive" if events_file
                                       else f"eft-events-{run_id}.archive.jsonl")
        return os.path.abspath(path)
