"""Straggler detection: which ranks are slower than the job, or than they used to be.

Every ``--eft-straggler-interval`` seconds each agent

1. reads its ranks' heartbeats (``worker/progress.py``): each carries the work time
   (time inside ``hook.compute()``) of the rank's last steps;
2. publishes its ranks' *current step time*, the median of those recent steps, at
   ``/eft/<run>/steps/<node>`` under the node's lease (a dead node's figures vanish);
3. reads every node's record and scores its own ranks:

   * relative score = the job's median current step time / the rank's (at most 1):
     how far behind the job the rank is;
   * individual score = the rank's best current step time so far / its current one
     (at most 1): how far behind its own past the rank is, which catches a job-wide
     slowdown that leaves the relative score at 1 (every rank on a throttled rack);

4. reports a rank whose score falls below ``--eft-straggler-relative`` or
   ``--eft-straggler-individual`` as a ``straggler`` event (once, until it recovers)
   and feeds the GPU's straggler risk factor.

Medians rather than means: one step that waited on a checkpoint write or a page fault
must not make a rank a straggler. Everything above the ``StragglerMonitor`` class is
pure and takes plain numbers. docs/stragglers.md is the user's side of this.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

from elasticft.agent.context import AgentContext
from elasticft.config import StragglerConfig
from elasticft.contract.events import EventKind
from elasticft.contract.progress import ProgressRecord, read_progress
from elasticft.periodic import PeriodicTask

log = logging.getLogger(__name__)

MIN_STEPS = 3  # fewer recent step times than this: too early to judge the rank
# A node's record older than this many intervals is ignored: its agent is stuck or gone
# (a dead node's record also vanishes with its lease, within the lease TTL).
STALE_INTERVALS = 2.5


# -- pure scoring --------------------------------------------------------------------------


def current_step_time(step_times: tuple[float, ...] | list[float]) -> float | None:
    """The rank's step time now: the median of its recent steps; None with too few."""
    if len(step_times) < MIN_STEPS:
        return None
    return statistics.median(step_times)


def ratio_score(reference: float, step_time: float) -> float:
    """``reference / step_time`` capped at 1: 1 is as fast as the reference, 0.5 twice as slow."""
    if step_time <= 0:
        return 1.0  # a rank that did no measurable work is not behind anyone
    return min(1.0, reference / step_time)


@dataclass(frozen=True)
class RankStep:
    """One rank's current step time, as a node publishes it."""

    node: str
    rank: int
    local_rank: int
    gpu: int
    step_time: float  # seconds: median work time of the recent steps
    iteration: int | None = None

    @property
    def key(self) -> tuple[str, int]:
        """Ranks change at restarts, the (node, GPU slot) does not: bests are kept per slot."""
        return (self.node, self.local_rank)


@dataclass(frozen=True)
class StragglerScore:
    """One rank's scores in one check."""

    rank: int
    node: str
    local_rank: int
    gpu: int
    step_time: float  # the rank's current step time, seconds
    job_median: float  # the job's median current step time, seconds
    best: float  # the rank's best current step time so far, seconds
    relative: float  # job_median / step_time, at most 1
    individual: float  # best / step_time, at most 1
    straggler: bool

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.local_rank)


def score_ranks(
    own: list[RankStep],
    everyone: list[RankStep],
    best: dict[tuple[str, int], float],
    relative_threshold: float,
    individual_threshold: float,
    world_size: int | None = None,
) -> list[StragglerScore]:
    """Score the ranks of ``own`` against the job (``everyone``, which includes ``own``).

    ``best``: the best (smallest) current step time seen so far per (node, local
    rank); a rank's current time counts as seen, so its first score is 1. A rank is a
    straggler when either score is below its threshold. With ``world_size``, nobody is
    scored until every rank of the job has a current step time: early on, a node that
    sees only its own ranks would take their median for the job's.
    """
    if world_size is not None and len({r.rank for r in everyone}) < world_size:
        return []
    times = [r.step_time for r in everyone] or [r.step_time for r in own]
    if not times:
        return []
    job_median = statistics.median(times)
    scores = []
    for r in own:
        best_time = min(best.get(r.key, math.inf), r.step_time)
        relative = ratio_score(job_median, r.step_time)
        individual = ratio_score(best_time, r.step_time)
        scores.append(StragglerScore(
            rank=r.rank, node=r.node, local_rank=r.local_rank, gpu=r.gpu, step_time=r.step_time,
            job_median=job_median, best=best_time, relative=relative, individual=individual,
            straggler=relative < relative_threshold or individual < individual_threshold,
        ))
    return scores


def straggler_factor(score: StragglerScore, relative_threshold: float, individual_threshold: float) -> float:
    """The GPU's straggler risk factor: 0 at or above both thresholds, 1 at a score of 0.

    Each score's shortfall below its threshold, as a fraction of the threshold; the
    larger one counts. With thresholds 0.7: a rank 1.43x slower than the job's median
    is 0, 2x slower (score 0.5) 0.29, 3x slower 0.52, 10x slower 0.86.
    """
    shortfalls = (
        (relative_threshold - score.relative) / relative_threshold,
        (individual_threshold - score.individual) / individual_threshold,
    )
    return min(1.0, max(0.0, *shortfalls))


class StragglerLatch:
    """Report a straggler once; again only after a check found it recovered."""

    def __init__(self) -> None:
        self.active: dict[tuple[str, int], StragglerScore] = {}

    def update(self, scores: list[StragglerScore]) -> tuple[list[StragglerScore], list[StragglerScore]]:
        """(new stragglers, recovered ones); a rank not scored this time keeps its state.

        ``active`` is replaced, not changed in place: the agent reads it from another thread.
        """
        active = dict(self.active)
        new, recovered = [], []
        for s in scores:
            if s.straggler and s.key not in active:
                new.append(s)
            elif not s.straggler and s.key in active:
                recovered.append(active.pop(s.key))
            if s.straggler:
                active[s.key] = s
        self.active = active
        return new, recovered


def may_leave(other_running_nodes: int, min_nodes: int) -> bool:
    """Whether a node may leave the job: the others must still make ``--nnodes``' minimum."""
    return other_running_nodes >= min_nodes


# -- records (what goes to etcd) ----------------------------------------------------------


def steps_record(node: str, ranks: list[RankStep], now: float) -> str:
    return json.dumps({"node": node, "time": now, "ranks": [asdict(r) for r in ranks]})


def parse_steps_record(value: bytes | str, now: float, max_age: float) -> list[RankStep]:
    """The ranks of one node's record; [] when it is older than ``max_age`` or malformed."""
    try:
        record = json.loads(value)
        if now - float(record["time"]) > max_age:
            return []
        return [RankStep(**r) for r in record["ranks"]]
    except (ValueError, TypeError, KeyError) as exc:
        log.debug("ignoring a malformed steps record: %s", exc)
        return []


def rank_steps(node: str, heartbeats: dict[int, ProgressRecord], gpu_of: Callable[[int], int]) -> list[RankStep]:
    """This node's ranks with enough step times to be judged."""
    ranks = []
    for local_rank, beat in sorted(heartbeats.items()):
        step_time = current_step_time(beat.step_times)
        if step_time is not None:
            ranks.append(RankStep(node, beat.rank, local_rank, gpu_of(local_rank), step_time, beat.iteration))
    return ranks


def pid_alive(pid: int) -> bool:
    """A heartbeat file outlives its worker (a restart with fewer workers): skip the dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- the agent's thread (I/O) --------------------------------------------------------------


class StragglerMonitor(PeriodicTask):
    """The agent's straggler thread; ``check_once`` is one round (tests call it directly).

    ``ctx`` is the node's handle on the run (its steps record goes there, under its
    lease; events go to its log); ``set_risk(node, gpu, factor)`` feeds the GPU's
    straggler factor to the risk model; ``gpu_of(local_rank)`` names the GPU a local rank runs on; ``world_size()`` is the
    number of ranks in the current round (None: unknown, score what is there).
    """

    name = "eft-stragglers"
    run_first = False  # one interval after the start: before that no rank has steps to judge

    def __init__(
        self,
        config: StragglerConfig,
        ctx: AgentContext,
        *,
        set_risk: Callable[[str, int, float], None] | None = None,
        gpu_of: Callable[[int], int] = lambda local_rank: local_rank,
        world_size: Callable[[], int | None] = lambda: None,
        alive: Callable[[int], bool] = pid_alive,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self._ctx = ctx
        self.node_id = ctx.node_id
        self._set_risk = set_risk
        self._gpu_of = gpu_of
        self._world_size = world_size
        self._alive = alive
        self._clock = clock
        self._latch = StragglerLatch()
        self.best: dict[tuple[str, int], float] = {}  # survives worker restarts
        self.interval = config.straggler_interval

    @property
    def enabled(self) -> bool:
        return self.config.straggler_interval > 0

    @property
    def stragglers(self) -> list[StragglerScore]:
        """This node's ranks that are stragglers as of the last check."""
        return list(self._latch.active.values())

    def wants_exclusion(self) -> bool:
        """``--eft-straggler-action exclude`` and a rank of this node is a straggler now."""
        return self.config.straggler_action == "exclude" and bool(self._latch.active)

    def check_once(self) -> list[StragglerScore]:
        """Publish, read and score once; returns this node's scores (stragglers flagged)."""
        ctx, now = self._ctx, self._clock()
        beats = {lr: b for lr, b in read_progress(ctx.run_dir).items() if self._alive(b.pid)}
        own = rank_steps(self.node_id, beats, self._gpu_of)
        ctx.client.put(ctx.keys.steps(self.node_id), steps_record(self.node_id, own, now), lease=ctx.lease)
        items, _ = ctx.client.get_prefix(ctx.keys.all_steps)
        max_age = STALE_INTERVALS * self.config.straggler_interval
        everyone = [r for item in items for r in parse_steps_record(item.value, now, max_age)]
        # Our own figures are fresh by construction; a skewed clock must not hide them.
        everyone = [r for r in everyone if r.node != self.node_id] + own
        scores = score_ranks(own, everyone, self.best, self.config.straggler_relative,
                             self.config.straggler_individual, self._world_size())
        for s in scores:
            self.best[s.key] = s.best
            if self._set_risk is not None:
                self._set_risk(self.node_id, s.gpu, straggler_factor(
                    s, self.config.straggler_relative, self.config.straggler_individual))
        new, recovered = self._latch.update(scores)
        for s in new:
            self._report(s)
        for s in recovered:
            log.info("rank %d (%s, GPU %d) is no longer a straggler", s.rank, s.node, s.gpu)
        return scores

    def _report(self, s: StragglerScore) -> None:
        log.warning(
            "rank %d (%s, GPU %d) is a straggler: step %.3f s vs the job's median %.3f s and its best "
            "%.3f s (relative %.2f, individual %.2f; thresholds %.2f, %.2f)%s",
            s.rank, s.node, s.gpu, s.step_time, s.job_median, s.best, s.relative, s.individual,
            self.config.straggler_relative, self.config.straggler_individual,
            "; its node leaves the job at the next restart" if self.config.straggler_action == "exclude" else "",
        )
        self._ctx.record(
            EventKind.STRAGGLER, rank=s.rank, node=s.node, local_rank=s.local_rank, gpu=s.gpu,
            step_time=round(s.step_time, 6), job_median=round(s.job_median, 6), best=round(s.best, 6),
            relative=round(s.relative, 4), individual=round(s.individual, 4),
            relative_threshold=self.config.straggler_relative,
            individual_threshold=self.config.straggler_individual,
            action=self.config.straggler_action,
        )

