"""What an agent holds at the moment of a scrape, as plain values (no eft object reaches the exporter).

The agent's side (``elasticft.agent.metrics``) fills a ``Readings`` from what it already keeps:
the sampler's newest scores, the heartbeats in the run directory, the watched etcd records
(layout, newest checkpoint, restart counts, restorable memory iterations). The exporter turns
it into families; a value that is None is not exported (absent, not zero: a dashboard shows
"no data" rather than a false 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GpuReading:
    gpu: int
    uuid: str
    risk: float
    factors: dict[str, float | None]
    contributions: dict[str, float]
    timestamp: float


@dataclass(frozen=True)
class RankReading:
    local_rank: int  # the series' label: the global rank changes at every re-plan
    iteration: int | None
    beat: float  # unix time of its newest heartbeat


@dataclass(frozen=True)
class CheckpointReading:
    iteration: int
    time: float  # unix time it became complete (as far as this node knows)


@dataclass
class Readings:
    run: str
    node: str
    now: float
    gpus: list[GpuReading] = field(default_factory=list)
    risk_trigger: float | None = None
    round: int | None = None
    world_size: int | None = None
    layout: dict[str, int] = field(default_factory=dict)  # tp, pp, dp
    local_workers: int = 0
    spare: bool = False  # the node waits as a spare (its record says so)
    segment: str = ""  # the domain of the node's segment (--eft-segment; its record says so)
    ranks: list[RankReading] = field(default_factory=list)
    iterations_per_second: float | None = None
    restart_budget_remaining: int | None = None
    checkpoints: dict[str, CheckpointReading] = field(default_factory=dict)  # tier -> newest complete
    # tier -> (seconds, counts per contract.progress.STALL_BUCKETS): the lowest rank's waits, this agent's lifetime
    stalls: dict[str, tuple[float, tuple[int, ...]]] = field(default_factory=dict)
    memory_lag: int | None = None
    memory_lag_limit: int | None = None
    memory_replicated: dict[str, int] = field(default_factory=dict)  # holder -> bytes pushed
    memory_served: dict[str, int] = field(default_factory=dict)  # peer -> bytes sent for restores
    etcd_up: bool = True
    gpu_seconds: dict[str, float] = field(default_factory=dict)  # cause -> GPU-seconds (rank 0's node only)
    goodput: float | None = None
