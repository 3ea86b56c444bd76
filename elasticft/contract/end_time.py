"""A SLURM job's time limit as one agent found it, shared with the others through etcd.

Where SLURM does not set ``SLURM_JOB_END_TIME`` (before 23.02), the end comes from
``squeue``, which asks slurmctld: one question per agent at start is a burst of 2,048 on
the controller at 2,048 nodes. So one agent of the attempt (whoever creates
``slurm/<attempt>/end-time-asker`` first) asks, and puts what it found in
``slurm/<attempt>/end-time``; the others wait for that key (launcher/slurm_end_time.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from elasticft.contract.json_object import json_object


@dataclass(frozen=True)
class SharedEndTime:
    """The value of ``slurm/<attempt>/end-time``: unix seconds, None for "no limit, or squeue
    did not answer" (the asker logged which); ``asker``: ``host:pid`` of the agent that asked."""

    end_time: float | None
    asker: str = ""

    def to_json(self) -> str:
        return json.dumps({"end_time": self.end_time, "asker": self.asker})

    @classmethod
    def from_json(cls, raw: bytes | str) -> "SharedEndTime":
        """Raises ValueError, TypeError or KeyError on a malformed record."""
        data = json_object(raw)
        end = data["end_time"]
        return cls(None if end is None else float(end), str(data.get("asker", "")))
