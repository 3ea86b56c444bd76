"""The agent's Prometheus endpoint: what it already holds, read at each scrape (docs/metrics.md).

Started before the node joins (its address goes into the node's record, where ``eft metrics
targets`` finds it), connected once the agent's services run. Nothing reaches the workers:
counts come from the events the agent records (``metrics/board.py``), values from the
sampler, the heartbeat files, the memory tier and three small etcd records it watches
(``layout``, ``ckpt/latest``, ``restarts``: they change at restarts and saves, not per
iteration). The job's GPU-seconds by cause are computed from the event log by the node of
global rank 0 alone, every ``--eft-metrics-goodput-interval``, off the scrape's path.

A restart's downtime goes to its histograms when the agent sees its workers' first step (a
look every second while a restart waits for one, and at the next restart), not at a scrape:
a histogram must count every restart, scraped or not, however close two restarts come.
"""

from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

from elasticft.agent.context import AgentContext
from elasticft.agent.decide import RestartReason
from elasticft.agent.goodput_now import GoodputNow
from elasticft.agent.segments import StopRecorder
from elasticft.agent.services import AgentServices
from elasticft.agent.watchdogs import WATCHDOG_CHECKS
from elasticft.config import MetricsConfig, flag_name
from elasticft.contract.phases import stamps_from_json
from elasticft.contract.events import EventKind
from elasticft.contract.numerics import NumericKind
from elasticft.contract.progress import SECTIONS, read_progress
from elasticft.contract.records import NodeState
from elasticft.contract.restarts import RestartRecord
from elasticft.memckpt import MemoryTier
from elasticft.metrics.board import MetricsBoard
from elasticft.metrics.catalog import Metric
from elasticft.metrics.readings import CheckpointReading, GpuReading, RankReading, Readings
from elasticft.periodic import Periodic
from elasticft.store import StoreError
from elasticft.store.keyset import KeySet

log = logging.getLogger(__name__)

# Counters exported at 0 with these labels before their first event (metrics/board.py).
KNOWN_LABELS = {
    Metric.RESTARTS: list(RestartReason),
    Metric.JOB_RESTARTS: list(RestartReason),
    Metric.HANGS: list(SECTIONS),
    Metric.ROLLBACKS: list(NumericKind),
    Metric.CHECKPOINT_SAVES: ["periodic", "emergency"],
    Metric.WATCHDOG_TRIPS: list(WATCHDOG_CHECKS),
}
FIRST_STEP_LOOK = 1.0  # seconds between two looks for a restart's first step (only while one is awaited)


@dataclass(frozen=True)
class AgentParts:
    """What the endpoint reads from the agent (callables: the agent replaces some at restarts)."""

    ctx: AgentContext
    services: AgentServices
    memory_tier: MemoryTier | None
    stops: Callable[[], StopRecorder]
    world_size: Callable[[], int | None]
    local_workers: Callable[[], int]
    holds_rank0: Callable[[], bool]


class MetricsService:
    def __init__(self, config: MetricsConfig, host: str):
        self.config = config
        self.board = MetricsBoard(KNOWN_LABELS)
        self._parts: AgentParts | None = None
        self._watched: list[KeySet] = []
        self._memory_seen: CheckpointReading | None = None
        self._goodput: GoodputNow | None = None
        self._first_step_look = Periodic("eft-metrics-first-step", self._first_step, FIRST_STEP_LOOK)
        self._lock = threading.Lock()
        self.server = None
        if config.enabled:  # prometheus_client is imported only where metrics are on
            from elasticft.metrics.exposition import ReadingsCollector
            from elasticft.metrics.server import MetricsServer

            self.server = MetricsServer.start(ReadingsCollector(self.read, self.board), config.metrics_host,
                                              config.metrics_port, flag_name("metrics_port"))
        shown = config.metrics_host if config.metrics_host not in ("", "0.0.0.0", "::") else host
        self.address = f"{shown}:{self.server.port}" if self.server is not None else ""
        if self.address:
            log.info("metrics at http://%s/metrics", self.address)

    def connect(self, parts: AgentParts) -> MetricsService:
        """Start reading the agent (after its services started). Nothing happens without an endpoint."""
        if self.server is None:
            return self
        self._parts = parts
        ctx = parts.ctx
        ctx.events.observers.append(self._observe)
        self._first_step_look.start()
        try:
            self._watched = [KeySet(ctx.client, key, lambda: None, exact=True)
                             for key in (ctx.keys.layout, ctx.keys.ckpt_latest, ctx.keys.restarts)]
        except StoreError as exc:  # etcd away at the start: the rest is served, the job's records are not
            log.warning("metrics: cannot watch the job's records (%s); /metrics serves this node's own", exc)
        if self.config.metrics_goodput_interval > 0:
            self._goodput = GoodputNow(ctx, parts.holds_rank0, parts.stops,
                                       self.config.metrics_goodput_interval).start()
        return self

    def _observe(self, event: dict) -> None:
        """An event the agent records; before a restart is counted, the previous one's first step
        is looked for (it may have come since the last look: two restarts are two observations)."""
        if event.get("kind") == EventKind.RESTART:
            self._first_step()
        self.board.observe(event)

    def _first_step(self, beats: dict | None = None) -> None:
        """If a restart waits for its first step and the lowest rank's heartbeat has one, time it
        (once: the board forgets the restart). ``beats``: the heartbeats, when already read."""
        parts = self._parts
        if parts is None or self.board.restart_began is None:
            return
        stops = parts.stops()
        lowest = (read_progress(stops.run_dir) if beats is None else beats).get(0)
        if lowest is not None and lowest.first_step is not None:
            with self._lock:  # the look, a restart and a scrape at once must not observe one restart twice
                self.board.first_step(lowest.first_step, {**stops.phases, **stamps_from_json(lowest.phases)})

    def _raw(self, key: str) -> bytes | None:
        return next((watched.get(key) for watched in self._watched if key in watched), None)

    def _record(self, key: str) -> dict | None:
        try:
            value = json.loads(self._raw(key) or b"null")
        except ValueError:
            return None
        return value if isinstance(value, dict) else None

    def read(self) -> Readings:
        """The agent's state now (called by the server, on its thread, at every scrape)."""
        parts = self._parts
        if parts is None:  # joined, services not yet running: say so much
            return Readings(run="", node="", now=time.time())
        ctx, now = parts.ctx, time.time()
        readings = Readings(run=ctx.keys.run_id, node=ctx.node_id, now=now, local_workers=parts.local_workers(),
                            world_size=parts.world_size() or 0, etcd_up=ctx.client.outage.since is None,
                            spare=ctx.node.record.state is NodeState.SPARE, segment=ctx.node.record.segment)
        self._health(readings, parts.services)
        self._heartbeats(readings, parts.stops())
        self._job_records(readings, ctx)
        self._memory(readings, parts.memory_tier, now)
        if self._goodput is not None:
            readings.gpu_seconds, readings.goodput = self._goodput.latest()
        return readings

    @staticmethod
    def _health(readings: Readings, services: AgentServices) -> None:
        sampler = services.sampler
        if sampler is None:
            return
        readings.risk_trigger = sampler.model.threshold
        for (_, gpu), (sample, score) in sorted(sampler.latest.items()):
            readings.gpus.append(GpuReading(gpu, sample.uuid or "", score.score, dict(score.factors),
                                            dict(score.contributions or {}), score.timestamp))

    def _heartbeats(self, readings: Readings, stops: StopRecorder) -> None:
        beats = read_progress(stops.run_dir)
        for local_rank, beat in sorted(beats.items()):
            readings.ranks.append(RankReading(local_rank, beat.iteration, beat.time))
        lowest = beats.get(0)
        if lowest is not None and lowest.started == self.board.stopped_started:
            lowest = None  # the stopped generation's heartbeat: its workers_stopped counted it
        if lowest is None:
            readings.stalls = self.board.stalls({}, {})
            return
        readings.stalls = self.board.stalls(dict(lowest.stalls), dict(lowest.stall_buckets))
        if lowest.step_times:
            readings.iterations_per_second = 1.0 / max(statistics.median(lowest.step_times), 1e-9)
        self._first_step(beats)  # the scrape shows a first step it read, even between two looks

    def _job_records(self, readings: Readings, ctx: AgentContext) -> None:
        layout = self._record(ctx.keys.layout) or {}
        readings.round = layout.get("round") if isinstance(layout.get("round"), int) else None
        readings.layout = {dim: layout[dim] for dim in ("tp", "pp", "dp") if isinstance(layout.get(dim), int)}
        latest = self._record(ctx.keys.ckpt_latest)
        if latest and isinstance(latest.get("iteration"), int) and isinstance(latest.get("time"), (int, float)):
            readings.checkpoints["disk"] = CheckpointReading(latest["iteration"], float(latest["time"]))
        restarts = self._raw(ctx.keys.restarts)
        if restarts is not None:
            try:
                record = RestartRecord.from_json(restarts)
            except (ValueError, TypeError, KeyError):
                return
            if record.job_restarts_limit is not None:
                readings.restart_budget_remaining = max(0, record.job_restarts_limit - record.charged)

    def _memory(self, readings: Readings, tier: MemoryTier | None, now: float) -> None:
        if tier is None:
            return
        newest = tier.restorable_seen
        if newest is not None:
            if self._memory_seen is None or self._memory_seen.iteration != newest:
                self._memory_seen = CheckpointReading(newest, now)
            readings.checkpoints["memory"] = self._memory_seen
        readings.memory_lag = tier.replication_lag()
        readings.memory_lag_limit = tier.max_lag
        readings.memory_replicated = tier.replicated()
        readings.memory_served = tier.served()

    def close(self) -> None:
        self._first_step_look.stop()
        if self._goodput is not None:
            self._goodput.stop()
        for watched in self._watched:
            watched.close()
        if self.server is not None:
            self.server.close()
