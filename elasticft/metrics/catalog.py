"""Every metric an agent exports: its name, type, labels and meaning, listed once.

The exporter (``exposition.py``) builds each family from its ``Metric`` member and nothing
else, ``eft metrics docs`` writes docs/metrics.md from the same members, and
``tests/test_metrics.py`` checks that the two agree with what ``/metrics`` answers. Names
follow Prometheus' conventions: the unit in the name (``_seconds``, ``_bytes``), ``_total``
for counters (the name here is the family's, without it), labels ``run`` and ``node`` on
every series, ``gpu``/``uuid`` on a GPU's, ``local_rank`` on a rank's (the global rank changes at
every re-plan, and each change would start a new series). A name never changes once released
(dashboards and rules refer to it): a new meaning is a new member.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from elasticft.contract.progress import STALL_BUCKETS


class Kind(enum.StrEnum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


# Histogram buckets (seconds): a restart's phases and a save run from a fraction of a second
# (a warm start, a memory snapshot) to many minutes (a cold start of thousands of ranks).
SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


@dataclass(frozen=True)
class Spec:
    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()

    @property
    def exposed(self) -> list[str]:
        """The sample names a scrape shows for this family."""
        if self.kind is Kind.COUNTER:
            return [self.name + "_total"]
        if self.kind is Kind.HISTOGRAM:
            return [self.name + suffix for suffix in ("_bucket", "_sum", "_count")]
        return [self.name]


NODE = ("run", "node")
GPU = (*NODE, "gpu", "uuid")


def _spec(name: str, kind: Kind, labels: tuple[str, ...], help: str, buckets: tuple[float, ...] = ()) -> Spec:
    return Spec("eft_" + name, kind, labels, help, buckets)


class Metric(enum.Enum):
    """One member per family (grouped as docs/metrics.md shows them)."""

    # -- health: the sampler's readings, as the risk model scores them
    GPU_RISK = _spec("gpu_risk", Kind.GAUGE, GPU, "the GPU's risk score (0-1; the noisy-OR of its factors)")
    GPU_RISK_FACTOR = _spec("gpu_risk_factor", Kind.GAUGE, (*GPU, "factor"),
                            "one factor behind the risk (0-1; absent where the GPU gives no data for it)")
    GPU_RISK_CONTRIBUTION = _spec("gpu_risk_contribution", Kind.GAUGE, (*GPU, "factor"),
                                  "a factor's weight times its value: what it adds to the risk")
    GPU_RISK_TRIGGER = _spec("gpu_risk_trigger", Kind.GAUGE, NODE,
                             "the risk at which the job saves at once (--eft-risk-threshold)")
    HEALTH_SAMPLE_AGE = _spec("health_sample_age_seconds", Kind.GAUGE, NODE,
                              "seconds since the health sampler's newest sample of this node's GPUs")
    # -- the round: who trains, in which layout
    ROUND = _spec("round", Kind.GAUGE, NODE, "the rendezvous round the node's workers run in (a restart adds one)")
    WORLD_SIZE = _spec("world_size", Kind.GAUGE, NODE, "ranks training in the current round (0: between rounds)")
    PARALLEL_SIZE = _spec("parallel_size", Kind.GAUGE, (*NODE, "dim"),
                          "the round's layout: dim tp, pp or dp (the planner's TPxPPxDP)")
    LOCAL_WORKERS = _spec("local_workers", Kind.GAUGE, NODE, "worker processes running on the node")
    SPARE = _spec("spare", Kind.GAUGE, (*NODE, "segment"),
                  "1 while the node waits as a spare; segment: its domain with --eft-segment, else empty "
                  "(sum by (run, segment): the job's spares per domain)")
    # -- progress, from the heartbeats the agent reads anyway
    ITERATION = _spec("iteration", Kind.GAUGE, (*NODE, "local_rank"),
                      "the newest iteration the node's rank has stepped (by local rank: stable across re-plans)")
    ITERATIONS_PER_SECOND = _spec("iterations_per_second", Kind.GAUGE, NODE,
                                  "iterations per second over the node's lowest rank's recent steps")
    HEARTBEAT_AGE = _spec("heartbeat_age_seconds", Kind.GAUGE, (*NODE, "local_rank"),
                          "seconds since the rank's newest heartbeat")
    # -- restarts
    RESTARTS = _spec("restarts", Kind.COUNTER, (*NODE, "reason"),
                     "restarts of the node's workers, by reason (membership, failure, hang, ...); every node "
                     "counts a job-wide restart: the job's restarts are eft_job_restarts_total")
    JOB_RESTARTS = _spec("job_restarts", Kind.COUNTER, (*NODE, "reason"),
                         "restarts of the job, by reason, each counted once: by the node whose agent reported "
                         "it first (sum over nodes)")
    RESTART_BUDGET_REMAINING = _spec("restart_budget_remaining", Kind.GAUGE, NODE,
                                     "charged restarts the job may still take (--eft-max-job-restarts)")
    RESTART_SECONDS = _spec("restart_seconds", Kind.HISTOGRAM, NODE,
                            "a restart's downtime on the node: its restart event to the new workers' first step",
                            SECONDS_BUCKETS)
    RESTART_PHASE_SECONDS = _spec("restart_phase_seconds", Kind.HISTOGRAM, (*NODE, "phase"),
                                  "a restart's phases (rendezvous, replan, spawn, imports, process_group, load, "
                                  "first_step)", SECONDS_BUCKETS)
    # -- checkpoints
    CHECKPOINT_ITERATION = _spec("checkpoint_iteration", Kind.GAUGE, (*NODE, "tier"),
                                 "the newest complete checkpoint's iteration, tier disk or memory (restorable)")
    CHECKPOINT_TIMESTAMP = _spec("checkpoint_timestamp_seconds", Kind.GAUGE, (*NODE, "tier"),
                                 "unix time the node learnt of the newest complete checkpoint of the tier")
    CHECKPOINT_AGE = _spec("checkpoint_age_seconds", Kind.GAUGE, (*NODE, "tier"),
                           "seconds since the newest complete checkpoint of the tier")
    CHECKPOINT_SAVES = _spec("checkpoint_saves", Kind.COUNTER, (*NODE, "kind"),
                             "complete disk checkpoints the node's agent recorded (the node of global rank 0): "
                             "kind periodic or emergency (an answered request)")
    CHECKPOINT_SAVE_SECONDS = _spec("checkpoint_save_seconds", Kind.HISTOGRAM, NODE,
                                    "a complete disk checkpoint's save time, as its ranks reported it",
                                    SECONDS_BUCKETS)
    SAVE_STALL_SECONDS = _spec("save_stall_seconds", Kind.HISTOGRAM, (*NODE, "tier"),
                               "a step's wait for a background save of the tier (disk, memory), on the node's "
                               "lowest rank", STALL_BUCKETS)
    # -- the memory tier
    MEMORY_REPLICATION_LAG = _spec("memory_replication_lag_snapshots", Kind.GAUGE, NODE,
                                   "snapshots the node took since the newest iteration with every replica in place")
    MEMORY_REPLICATION_LAG_LIMIT = _spec("memory_replication_lag_limit_snapshots", Kind.GAUGE, NODE,
                                         "the lag at which snapshots pause (--eft-mem-ckpt-max-lag)")
    MEMORY_REPLICATED_BYTES = _spec("memory_replicated_bytes", Kind.COUNTER, (*NODE, "peer"),
                                    "bytes of the node's memory snapshots pushed to replica holders, by holder")
    MEMORY_SERVED_BYTES = _spec("memory_served_bytes", Kind.COUNTER, (*NODE, "peer"),
                                "bytes the node's shard server sent to restoring ranks, by their node")
    # -- detections
    HANGS = _spec("hangs", Kind.COUNTER, (*NODE, "section"), "ranks on the node that overran a section's timeout")
    STRAGGLERS = _spec("stragglers", Kind.COUNTER, NODE, "straggler findings the node's agent recorded")
    ROLLBACKS = _spec("rollbacks", Kind.COUNTER, (*NODE, "fault"),
                      "re-runs of a bad iteration (nan, spike) the node's agent recorded")
    WATCHDOG_TRIPS = _spec("watchdog_trips", Kind.COUNTER, (*NODE, "check"), "watchdogs that tripped on the node")
    NODES_LOST = _spec("nodes_lost", Kind.COUNTER, NODE, "peers whose lease expired, as the node saw them")
    SPARES_LOST = _spec("spares_lost", Kind.COUNTER, NODE,
                        "spares whose lease expired while they waited (one member counts each for the job)")
    # -- etcd
    ETCD_UP = _spec("etcd_up", Kind.GAUGE, NODE, "1 while etcd answers the node's agent, 0 in an outage")
    ETCD_OUTAGE_SECONDS = _spec("etcd_outage_seconds", Kind.COUNTER, NODE,
                                "seconds of ended etcd outages, as the node's agent saw them")
    # -- goodput: the job's paid GPU time by eft report's categories (from the node of rank 0)
    GPU_SECONDS = _spec("gpu_seconds", Kind.GAUGE, ("run", "cause"),
                        "the job's GPU-seconds so far by eft report's cause (productive, rework, save_disk, ...); "
                        "a gauge: a failure moves time from productive to rework")
    GOODPUT_RATIO = _spec("goodput_ratio", Kind.GAUGE, ("run",), "productive GPU-seconds over paid ones so far")

    @property
    def spec(self) -> Spec:
        return self.value


def exposed_names() -> set[str]:
    """Every sample name a scrape can show."""
    return {name for metric in Metric for name in metric.spec.exposed}
