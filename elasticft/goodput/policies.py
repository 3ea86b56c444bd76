"""What ``eft simulate`` compares: the policies, the job they run, and what each yields.

A policy is a set of recovery features; the job (``Cluster``) is what every policy shares:
its GPUs, spare nodes, repair time and torchrun's costs for the torchrun-style policy.
``Result`` is the accounting of one policy over one failure trace, in GPU-seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Where the paid GPU-time that did not advance training went.
LOSSES = ("rework", "saves", "detection", "restart", "waiting", "reduced_capacity", "idle_spares")
LOSS_HELP = {
    "rework": "training re-done after a failure (since the checkpoint it resumed from)",
    "saves": "training stalled by checkpoints (periodic, proactive, false alarms, memory)",
    "detection": "from a failure to the job knowing of it",
    "restart": "stop, rendezvous, process start, checkpoint load (and reshard)",
    "waiting": "the whole job idle, waiting for a node (no spare, or too few survivors)",
    "reduced_capacity": "GPUs left out while the job runs re-planned on the survivors",
    "idle_spares": "spare nodes paid and idle",
}


@dataclass(frozen=True)
class Policy:
    """How a job saves and recovers."""

    name: str
    torchrun: bool = False
    """Detect and restart like torchrun (``Cluster.torchrun_*``) instead of the job's costs."""
    proactive: bool = False
    """Save to disk on a prediction (or a false alarm) when the lead time exceeds the save cost."""
    memory: bool = False
    """Memory checkpoints (when the costs have a memory tier); resume from a replica."""
    replan: bool = False
    """Continue on the survivors instead of swapping in a spare node."""


PRESETS: dict[str, Policy] = {
    "periodic": Policy("periodic", torchrun=True),
    "proactive": Policy("proactive", proactive=True),
    "memory": Policy("memory", proactive=True, memory=True),
    "replan": Policy("replan", proactive=True, memory=True, replan=True),
}
PRESET_HELP = {
    "periodic": "disk saves at the interval; torchrun's detection and restart; hot spares",
    "proactive": "periodic + eft's detection and restart + a disk save on each prediction",
    "memory": "proactive + memory checkpoints, resuming from a replica when one survives",
    "replan": "memory, without spares: re-plan on the survivors until a node is repaired",
}
# The job's own detection/restart, periodic saves, spares: what a plain eft run does (replay).
EFT = Policy("eft")


@dataclass(frozen=True)
class Cluster:
    """The job every policy runs: its size and what replaces a failed node."""

    gpus: int
    gpus_per_node: int = 8
    spare_nodes: int = 0
    """Hot spares, paid and idle (only for policies without ``replan``)."""
    repair_seconds: float = 0.0
    """How long a failed node is away; 0: replaced at once (a spare or itself)."""
    replica_gpus: int = 0
    """GPUs of one model replica (TP x PP): re-planning runs on whole replicas; 0: one node."""
    torchrun_detection_seconds: float = 600.0
    """torchrun has no failure detector: survivors hang in a collective until NCCL's timeout
    (PyTorch's default process-group timeout, 10 minutes)."""
    torchrun_restart_seconds: float = 77.0
    """torchrun c10d from a node's loss to the survivors' workers running, as measured by
    ``bench/node_loss.py`` (its defaults, 3 nodes); a checkpoint load comes on top."""

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("gpus and gpus_per_node must be >= 1")
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node})")
        if self.spare_nodes < 0 or self.repair_seconds < 0 or self.replica_gpus < 0:
            raise ValueError("spare_nodes, repair_seconds and replica_gpus must be >= 0")
        if self.torchrun_detection_seconds < 0 or self.torchrun_restart_seconds < 0:
            raise ValueError("torchrun's detection and restart seconds must be >= 0")
        replica = self.replica_gpus or self.gpus_per_node
        if self.gpus % replica:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of replica_gpus ({replica})")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def replica(self) -> int:
        return self.replica_gpus or self.gpus_per_node


@dataclass
class Result:
    """One policy over one failure trace. GPU-seconds throughout."""

    policy: str
    gpus: int
    seconds: float
    paid: float
    productive: float = 0.0
    losses: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOSSES, 0.0))
    failures: int = 0
    memory_recoveries: int = 0
    disk_recoveries: int = 0
    proactive_saves: int = 0
    progress: list[tuple[float, float]] | None = None
    """(wall seconds, training done as a share of the whole job's GPUs x wall time): recorded
    when asked, for the picture; drops at each failure's rework."""

    @property
    def goodput(self) -> float:
        return self.productive / self.paid if self.paid else 0.0

    def lost_gpu_hours(self) -> dict[str, float]:
        return {name: value / 3600.0 for name, value in self.losses.items()}

    def to_json(self) -> dict:
        return {
            "policy": self.policy, "goodput": self.goodput, "gpus": self.gpus,
            "days": self.seconds / 86400.0, "paid_gpu_hours": self.paid / 3600.0,
            "productive_gpu_hours": self.productive / 3600.0, "lost_gpu_hours": self.lost_gpu_hours(),
            "failures": self.failures, "memory_recoveries": self.memory_recoveries,
            "disk_recoveries": self.disk_recoveries, "proactive_saves": self.proactive_saves,
        }


def default_spare_nodes(job_mtbf_seconds: float, repair_seconds: float) -> int:
    """Spares for nodes away in repair: their mean count plus three standard deviations
    (Poisson), plus one; 0 when a failed node is back at once."""
    if repair_seconds <= 0:
        return 0
    away = repair_seconds / job_mtbf_seconds
    return math.ceil(away + 3 * math.sqrt(away)) + 1
