"""The counters and histograms an agent keeps from the events it records.

Every event an agent writes to the run's log passes through ``MetricsBoard.observe`` (an
observer of its ``EventLog``), so counting costs one dictionary update per event and nothing
per iteration: what is counted is what the agent already says. Counters start at zero when
the agent starts (Prometheus' ``rate`` and ``increase`` expect that of a restarted target).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from elasticft.contract.events import EventKind
from elasticft.contract.phases import ORDER, RestartPhase
from elasticft.contract.progress import STALL_BUCKETS, stall_counts
from elasticft.metrics.catalog import Kind, Metric

Labels = tuple[str, ...]  # the values of a family's labels beyond run and node, in its order
Stalls = tuple[float, tuple[int, ...]]  # seconds waited, and the waits per STALL_BUCKETS
STALL_TIERS = ("disk", "memory")


@dataclass
class Histogram:
    """Counts per upper bound (not cumulative here; the exposition adds them up), sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of observations <= le) pairs, +Inf last, as the exposition format wants them."""
        total, pairs = 0, []
        for bound, count in zip((*map(_le, self.bounds), "+Inf"), self.counts):
            total += count
            pairs.append((bound, total))
        return pairs


def _le(bound: float) -> str:
    return str(float(bound))


def _text(value) -> str:
    return "" if value is None else str(value)


class MetricsBoard:
    """What the events said so far: counters, histograms, the running restart.

    ``known``: label values a counter is exported with at 0 before its first event, so that a
    rule or a dashboard's ``increase()`` sees the series from the start (Prometheus' advice for
    labels with known values); counters with no labels of their own always start at 0.
    """

    def __init__(self, known: dict[Metric, list[str]] | None = None) -> None:
        self._lock = threading.Lock()
        self._counters: dict[Metric, dict[Labels, float]] = {
            m: ({(): 0.0} if len(m.spec.labels) == 2 else {}) for m in Metric if m.spec.kind is Kind.COUNTER}
        for metric, values in (known or {}).items():
            self._counters[metric].update({(str(v),): 0.0 for v in values})
        self._histograms: dict[Metric, dict[Labels, Histogram]] = {
            m: {} for m in Metric if m.spec.kind is Kind.HISTOGRAM}
        self._stalls_before: dict[str, Stalls] = {}  # tier -> waits of the generations that stopped
        self.restart_began: float | None = None  # the newest restart event's time, until its first step is seen
        self._stop_ended: float | None = None  # when that restart's workers_stopped was recorded
        # when the newest stopped generation's lowest rank started: its heartbeat, until the next
        # generation replaces it, is counted already
        self.stopped_started: float | None = None

    # -- fed by the event log --------------------------------------------------------

    def observe(self, event: dict) -> None:
        """One event this agent recorded (``EventLog.observers``)."""
        kind, handler = event.get("kind"), None
        try:
            handler = _HANDLERS.get(EventKind(kind))
        except ValueError:
            return
        if handler is not None:
            with self._lock:
                handler(self, event)

    def add(self, metric: Metric, labels: Labels = (), amount: float = 1.0) -> None:
        series = self._counters[metric]
        series[labels] = series.get(labels, 0.0) + amount

    def record(self, metric: Metric, value: float, labels: Labels = ()) -> None:
        series = self._histograms[metric]
        if labels not in series:
            series[labels] = Histogram(metric.spec.buckets)
        series[labels].observe(value)

    def _restart(self, event: dict) -> None:
        self.add(Metric.RESTARTS, (_text(event.get("reason")),))
        if event.get("job_restart") is True:  # this node reported the cycle first: the job's one count
            self.add(Metric.JOB_RESTARTS, (_text(event.get("reason")),))
        self.restart_began = _number(event.get("time"))

    def _saved(self, event: dict) -> None:
        self.add(Metric.CHECKPOINT_SAVES, ("emergency" if event.get("request_id") else "periodic",))
        seconds = _number(event.get("seconds"))
        if seconds is not None:
            self.record(Metric.CHECKPOINT_SAVE_SECONDS, seconds)

    def _stopped(self, event: dict) -> None:
        self.stopped_started = _number(event.get("started"))
        if self.restart_began is not None:
            self._stop_ended = _number(event.get("time"))
        self._stalls_before = _add_stalls(self._stalls_before, event.get("stalls"),
                                          stall_counts(event.get("stall_buckets")))

    # -- read at a scrape --------------------------------------------------------------

    def stalls(self, seconds: dict[str, float], counts: dict[str, tuple[int, ...]]) -> dict[str, Stalls]:
        """The lowest rank's waits for background saves, per tier (disk and memory always): generations
        that stopped, plus the running one's (its heartbeat's ``seconds`` and ``counts``)."""
        with self._lock:
            before = dict(self._stalls_before)
        return _add_stalls(before, seconds, counts)

    def first_step(self, first_step: float, ends: dict[RestartPhase, float]) -> None:
        """The workers of the newest restart took their first step at ``first_step``: its downtime,
        whole and phase by phase (``ends``: when each phase ended), goes to the histograms once."""
        with self._lock:
            began = self.restart_began
            if began is None or first_step < began:  # the stopped generation's heartbeat, still on disk
                return
            self.restart_began = None
            if self._stop_ended is not None:
                ends = {RestartPhase.STOP: self._stop_ended, **ends}
            self._stop_ended = None
            self.record(Metric.RESTART_SECONDS, first_step - began)
            previous = began
            for phase in ORDER:
                end = first_step if phase is RestartPhase.FIRST_STEP else ends.get(phase)
                if end is None or end < previous:
                    continue
                self.record(Metric.RESTART_PHASE_SECONDS, end - previous, (str(phase),))
                previous = end

    def counters(self) -> dict[Metric, dict[Labels, float]]:
        with self._lock:
            return {m: dict(series) for m, series in self._counters.items()}

    def histograms(self) -> dict[Metric, dict[Labels, Histogram]]:
        with self._lock:
            return {m: {k: Histogram(h.bounds, list(h.counts), h.sum, h.count) for k, h in series.items()}
                    for m, series in self._histograms.items()}


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _add_stalls(total: dict[str, Stalls], seconds, counts: dict[str, tuple[int, ...]]) -> dict[str, Stalls]:
    """``total`` plus one generation's waits (``seconds``: {tier: seconds}, as a record holds them)."""
    out = dict(total)
    seconds = seconds if isinstance(seconds, dict) else {}
    for tier in {*STALL_TIERS, *map(str, seconds), *counts}:
        waited, buckets = out.get(tier, (0.0, (0,) * (len(STALL_BUCKETS) + 1)))
        added = counts.get(tier, (0,) * len(buckets))
        out[tier] = (waited + (_number(seconds.get(tier)) or 0.0), tuple(a + b for a, b in zip(buckets, added)))
    return out


def _count(metric: Metric, field_name: str | None = None):
    def handler(board: MetricsBoard, event: dict) -> None:
        board.add(metric, (_text(event.get(field_name)),) if field_name else ())
    return handler


def _nodes_lost(board: MetricsBoard, event: dict) -> None:
    nodes = event.get("nodes")
    board.add(Metric.NODES_LOST, (), float(len(nodes)) if isinstance(nodes, list) else 1.0)


def _etcd_back(board: MetricsBoard, event: dict) -> None:
    board.add(Metric.ETCD_OUTAGE_SECONDS, (), _number(event.get("seconds")) or 0.0)


_HANDLERS = {
    EventKind.RESTART: MetricsBoard._restart,
    EventKind.CKPT_SAVED: MetricsBoard._saved,
    EventKind.WORKERS_STOPPED: MetricsBoard._stopped,
    EventKind.HANG: _count(Metric.HANGS, "section"),
    EventKind.STRAGGLER: _count(Metric.STRAGGLERS),
    EventKind.ROLLBACK: _count(Metric.ROLLBACKS, "fault"),
    EventKind.WATCHDOG: _count(Metric.WATCHDOG_TRIPS, "check"),
    EventKind.NODE_LOST: _nodes_lost,
    EventKind.SPARE_LOST: lambda board, _event: board.add(Metric.SPARES_LOST, (), 1.0),
    EventKind.ETCD_UNAVAILABLE: _etcd_back,
}
