"""The costs of one job that decide its goodput: measured by ``eft report``, replayed by ``eft simulate``.

Every field is seconds of wall time (or a count); a cost is what the *whole job* loses
while it is paid, since a synchronous job stops on every GPU at once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class JobCosts:
    """What one job pays for training, saving and recovering."""

    iteration_seconds: float
    """Wall time of one training iteration (a save's stall excluded)."""
    save_seconds: float
    """Training stall of one persistent (disk) checkpoint."""
    save_interval_seconds: float
    """Time between persistent checkpoints, in training time (stalls excluded)."""
    detection_seconds: float
    """From a failure to the job knowing of it (a lost lease, a dead worker's exit)."""
    restart_seconds: float
    """From detection to the new workers starting (stop, rendezvous, re-plan)."""
    load_seconds: float
    """From the new workers starting to their first step (process start, load of the newest state)."""
    memory_save_seconds: float = 0.0
    """Training stall of one memory checkpoint; 0 when the job has no memory tier."""
    memory_interval_seconds: float = 0.0
    """Time between memory checkpoints, in training time; 0: no memory tier."""
    memory_load_seconds: float = 0.0
    """Load time when resuming from memory instead of disk; 0: same as ``load_seconds``."""
    reshard_seconds: float = 0.0
    """Extra load time when the job resumes on a different number of GPUs (re-plan on the
    survivors or grow back): the checkpoint is resharded to the new layout."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")
        if self.iteration_seconds <= 0:
            raise ValueError(f"iteration_seconds must be > 0, got {self.iteration_seconds!r}")

    @property
    def has_memory_tier(self) -> bool:
        return self.memory_interval_seconds > 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> "JobCosts":
        """Raises ValueError on a missing, unknown or bad field."""
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object of costs, got {type(record).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(record) - names)
        if unknown:
            raise ValueError(f"unknown cost field(s): {', '.join(unknown)}")
        return cls(**record)


def young_daly_interval(mtbf_seconds: float, save_seconds: float) -> float:
    """The save interval that minimises expected waste, sqrt(2 * MTBF * save cost) (Young 1974,
    Daly 2006's first-order form); the job's MTBF, not one GPU's."""
    if mtbf_seconds <= 0 or save_seconds < 0:
        raise ValueError("MTBF must be > 0 and the save cost >= 0")
    return math.sqrt(2.0 * mtbf_seconds * save_seconds)


def young_daly_waste(interval_seconds: float, mtbf_seconds: float, save_seconds: float,
                     recovery_seconds: float = 0.0) -> float:
    """First-order expected fraction of wall time wasted with periodic saves every
    ``interval_seconds`` of training: save / interval + (interval / 2 + recovery) / MTBF."""
    if interval_seconds <= 0 or mtbf_seconds <= 0:
        raise ValueError("interval and MTBF must be > 0")
    return save_seconds / interval_seconds + (interval_seconds / 2.0 + recovery_seconds) / mtbf_seconds
