"""``Readings`` and the board's counters as Prometheus metric families, built at each scrape.

A custom collector (prometheus_client's documented ``Collector`` interface) rather than
long-lived Gauge objects: every value is read at the scrape from what the agent holds, so a
GPU that left or a rank that is gone stops being exported instead of keeping its last value.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric as Family
from prometheus_client.registry import Collector

from elasticft.metrics.board import Histogram, MetricsBoard
from elasticft.metrics.catalog import Kind, Metric
from elasticft.metrics.readings import Readings

_FAMILY = {Kind.GAUGE: GaugeMetricFamily, Kind.COUNTER: CounterMetricFamily}


class _Families:
    """One family per ``Metric``, made on first use; ``add`` takes the labels beyond run and node."""

    def __init__(self, run: str, node: str):
        self._node = (run, node)
        self.made: dict[Metric, Family] = {}

    def _family(self, metric: Metric) -> Family:
        if metric not in self.made:
            spec = metric.spec
            make = _FAMILY.get(spec.kind, HistogramMetricFamily)
            self.made[metric] = make(spec.name, spec.help, labels=list(spec.labels))
        return self.made[metric]

    def _labels(self, metric: Metric, extra: tuple) -> list[str]:
        node_labels = self._node if metric.spec.labels[:2] == ("run", "node") else self._node[:1]
        return [*node_labels, *map(str, extra)]

    def add(self, metric: Metric, value: float | None, *extra) -> None:
        if value is not None:
            self._family(metric).add_metric(self._labels(metric, extra), float(value))

    def histogram(self, metric: Metric, extra: tuple, buckets: list[tuple[str, int]], total: float) -> None:
        self._family(metric).add_metric(self._labels(metric, extra), buckets, total)


def families(readings: Readings, board: MetricsBoard) -> list[Family]:
    """Every family with at least one series, in the catalog's order (none before the agent joined a run)."""
    if not readings.run:
        return []
    out = _Families(readings.run, readings.node)
    _health(out, readings)
    _round(out, readings)
    _checkpoints(out, readings)
    for metric, series in board.counters().items():
        for labels, value in series.items():
            out.add(metric, value, *labels)
    for tier, (seconds, counts) in readings.stalls.items():
        stalls = Histogram(Metric.SAVE_STALL_SECONDS.spec.buckets, list(counts), seconds, sum(counts))
        out.histogram(Metric.SAVE_STALL_SECONDS, (tier,), stalls.cumulative(), seconds)
    for peer, sent in readings.memory_replicated.items():
        out.add(Metric.MEMORY_REPLICATED_BYTES, sent, peer)
    for peer, sent in readings.memory_served.items():
        out.add(Metric.MEMORY_SERVED_BYTES, sent, peer)
    for metric, series in board.histograms().items():
        for labels, histogram in series.items():
            out.histogram(metric, labels, histogram.cumulative(), histogram.sum)
    out.add(Metric.ETCD_UP, 1 if readings.etcd_up else 0)
    for cause, seconds in readings.gpu_seconds.items():
        out.add(Metric.GPU_SECONDS, seconds, cause)
    out.add(Metric.GOODPUT_RATIO, readings.goodput)
    return [out.made[m] for m in Metric if m in out.made]


def _health(out: _Families, r: Readings) -> None:
    for g in r.gpus:
        out.add(Metric.GPU_RISK, g.risk, g.gpu, g.uuid)
        for factor, value in sorted(g.factors.items()):
            out.add(Metric.GPU_RISK_FACTOR, value, g.gpu, g.uuid, factor)
        for factor, value in sorted(g.contributions.items()):
            out.add(Metric.GPU_RISK_CONTRIBUTION, value, g.gpu, g.uuid, factor)
    if r.gpus:
        out.add(Metric.HEALTH_SAMPLE_AGE, max(0.0, r.now - max(g.timestamp for g in r.gpus)))
        out.add(Metric.GPU_RISK_TRIGGER, r.risk_trigger)


def _round(out: _Families, r: Readings) -> None:
    out.add(Metric.ROUND, r.round)
    out.add(Metric.WORLD_SIZE, r.world_size)
    for dim, size in r.layout.items():
        out.add(Metric.PARALLEL_SIZE, size, dim)
    out.add(Metric.LOCAL_WORKERS, r.local_workers)
    out.add(Metric.SPARE, int(r.spare), r.segment)
    for rank in r.ranks:
        out.add(Metric.ITERATION, rank.iteration, rank.local_rank)
        out.add(Metric.HEARTBEAT_AGE, max(0.0, r.now - rank.beat), rank.local_rank)
    out.add(Metric.ITERATIONS_PER_SECOND, r.iterations_per_second)
    out.add(Metric.RESTART_BUDGET_REMAINING, r.restart_budget_remaining)


def _checkpoints(out: _Families, r: Readings) -> None:
    for tier, newest in r.checkpoints.items():
        out.add(Metric.CHECKPOINT_ITERATION, newest.iteration, tier)
        out.add(Metric.CHECKPOINT_TIMESTAMP, newest.time, tier)
        out.add(Metric.CHECKPOINT_AGE, max(0.0, r.now - newest.time), tier)
    out.add(Metric.MEMORY_REPLICATION_LAG, r.memory_lag)
    out.add(Metric.MEMORY_REPLICATION_LAG_LIMIT, r.memory_lag_limit)


class ReadingsCollector(Collector):
    """What ``/metrics`` answers: ``read()`` (the agent's readings now) and the board's counts."""

    def __init__(self, read: Callable[[], Readings], board: MetricsBoard):
        self._read = read
        self._board = board

    def collect(self) -> Iterator[Family]:
        yield from families(self._read(), self._board)
