"""Measuring the risk model on labelled traces: recall, precision, false triggers, lead time.

Pure: samples and labels in, numbers out, no I/O (``labels.py`` reads the sidecars,
``eft health eval`` reads the files). A trace is scored once, exactly as the sampler
scores it (rounds from ``trace.batches`` into one ``RiskModel``); a score does not
depend on the threshold, so each threshold of a sweep only recounts the crossings.

Definitions (docs/health.md, "Measuring the model"):

- a *failure* is a (node, GPU) with a failure time: derived from the trace (the
  GPU's row with every metric missing after which it reports nothing) or given by
  a sidecar; every other GPU is *healthy* for the span of its samples;
- a *trigger* is a crossing as ``RiskScore.crossed`` counts it: the score reaches
  the threshold, and it counts again only after falling below ``REARM_FRACTION`` of it;
- only samples strictly before the failure time count: the failure row itself
  carries Xid 79 and would "foresee" every failure at lead 0.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from elasticft.health.risk import RiskModel, crossing
from elasticft.health.sample import GpuSample
from elasticft.health.trace import batches

Key = tuple[str, int]  # (node, gpu)
DAY_S = 86400.0
# Every GpuSample field that is a measurement; a row with none of them is a GPU that
# no longer answers (what nvidia-smi prints as a row of [N/A]). The thermal limits are
# read once when the source starts, so a lost GPU's rows still carry them.
METRIC_FIELDS = tuple(
    f.name for f in dataclasses.fields(GpuSample)
    if f.name not in ("timestamp", "node", "gpu", "uuid", "xids", "temp_slowdown_c", "temp_shutdown_c")
)


@dataclass(frozen=True)
class Failure:
    node: str | None  # None in a sidecar: the trace's only GPU with this index
    gpu: int
    time: float  # epoch seconds: the moment the GPU was gone
    mode: str | None = None  # None: the labels' mode, else the trace's name


@dataclass(frozen=True)
class Labels:
    """What a sidecar adds to what a trace shows by itself."""

    failures: tuple[Failure, ...] = ()  # replace derived failures of the same GPU
    ignored: tuple[tuple[str | None, int], ...] = ()  # (node or None, gpu): not counted
    mode: str | None = None  # the failure mode of this trace's failures


@dataclass
class TraceScores:
    """One trace replayed: per GPU, its scores and the span it reported for; the labels."""

    name: str
    series: dict[Key, list[tuple[float, float]]] = field(default_factory=dict)  # (t, score)
    spans: dict[Key, tuple[float, float]] = field(default_factory=dict)
    failures: dict[Key, Failure] = field(default_factory=dict)  # with node and mode resolved
    ignored: set[Key] = field(default_factory=set)


class LabelError(ValueError):
    """Labels that do not fit their trace (a GPU it does not have, an ambiguous node)."""


def is_lost(sample: GpuSample) -> bool:
    return all(getattr(sample, name) is None for name in METRIC_FIELDS)


def derive_failures(samples: Iterable[GpuSample]) -> dict[Key, float]:
    """(node, gpu) -> time of the first all-missing row after which the GPU reports nothing."""
    lost_since: dict[Key, float] = {}
    for s in samples:
        if is_lost(s):
            lost_since.setdefault(s.key, s.timestamp)
        else:  # it answered again: the missing rows were a read hiccup, not a failure
            lost_since.pop(s.key, None)
    return lost_since


def _resolve(node: str | None, gpu: int, keys: Iterable[Key], trace: str) -> Key:
    matches = [k for k in keys if k[1] == gpu and (node is None or k[0] == node)]
    if len(matches) != 1:
        what = f"GPU {gpu}" + (f" of node {node!r}" if node else "")
        problem = "has no" if not matches else "has several nodes with"
        raise LabelError(f"{trace}: labels: the trace {problem} {what}")
    return matches[0]


def score_trace(name: str, samples: Iterable[GpuSample], model: RiskModel, labels: Labels | None = None) -> TraceScores:
    """Replay ``samples`` through ``model`` as the sampler would and attach the labels."""
    labels = labels or Labels()
    result = TraceScores(name)
    seen: list[GpuSample] = []
    for round_ in batches(samples):
        seen.extend(round_)
        for score in model.update(round_):
            key = (score.node, score.gpu)
            result.series.setdefault(key, []).append((score.timestamp, score.score))
            first = result.spans.get(key, (score.timestamp, score.timestamp))[0]
            result.spans[key] = (first, score.timestamp)
    default_mode = labels.mode or name
    for key, time in derive_failures(seen).items():
        result.failures[key] = Failure(key[0], key[1], time, default_mode)
    for f in labels.failures:
        key = _resolve(f.node, f.gpu, result.series, name)
        result.failures[key] = Failure(key[0], key[1], f.time, f.mode or default_mode)
    result.ignored = {_resolve(node, gpu, result.series, name) for node, gpu in labels.ignored}
    return result


def crossings(series: Iterable[tuple[float, float]], threshold: float) -> list[float]:
    """Times at which the score crosses ``threshold``, re-arming as ``RiskModel`` does."""
    times, armed = [], True
    for t, score in series:
        _, crossed, armed = crossing(score, threshold, armed)
        if crossed:
            times.append(t)
    return times


@dataclass(frozen=True)
class Outcome:
    """One labelled failure at one threshold."""

    trace: str
    node: str
    gpu: int
    mode: str
    failed_at: float
    first_trigger: float | None  # None: not caught

    @property
    def lead_s(self) -> float | None:
        return None if self.first_trigger is None else self.failed_at - self.first_trigger


@dataclass
class ThresholdResult:
    threshold: float
    outcomes: list[Outcome] = field(default_factory=list)
    true_triggers: int = 0  # crossings on GPUs that failed later in the trace
    false_triggers: int = 0  # crossings on healthy GPUs
    healthy_gpu_days: float = 0.0

    @property
    def recall(self) -> float | None:
        return _fraction(caught(self.outcomes), len(self.outcomes))

    @property
    def precision(self) -> float | None:
        return _fraction(self.true_triggers, self.true_triggers + self.false_triggers)

    @property
    def false_per_gpu_day(self) -> float | None:
        return self.false_triggers / self.healthy_gpu_days if self.healthy_gpu_days > 0 else None

    def by_mode(self) -> dict[str, list[Outcome]]:
        modes: dict[str, list[Outcome]] = {}
        for o in self.outcomes:
            modes.setdefault(o.mode, []).append(o)
        return dict(sorted(modes.items()))


def _fraction(part: int, whole: int) -> float | None:
    return part / whole if whole else None  # None: nothing to measure, not 0 % nor 100 %


def caught(outcomes: Iterable[Outcome]) -> int:
    return sum(o.first_trigger is not None for o in outcomes)


def lead_stats(outcomes: Iterable[Outcome]) -> tuple[float | None, float | None]:
    """(median, worst) lead time in seconds over the caught failures; worst is the shortest."""
    leads = [o.lead_s for o in outcomes if o.lead_s is not None]
    return (statistics.median(leads), min(leads)) if leads else (None, None)


def evaluate(traces: Iterable[TraceScores], thresholds: Iterable[float]) -> list[ThresholdResult]:
    """The metrics of every threshold over all ``traces`` (in the order of ``thresholds``)."""
    traces = list(traces)
    results = []
    for threshold in thresholds:
        result = ThresholdResult(threshold)
        for trace in traces:
            _count(trace, threshold, result)
        results.append(result)
    return results


def _count(trace: TraceScores, threshold: float, result: ThresholdResult) -> None:
    for key in sorted(trace.series):
        if key in trace.ignored:
            continue
        failure = trace.failures.get(key)
        if failure is None:
            result.false_triggers += len(crossings(trace.series[key], threshold))
            first, last = trace.spans[key]
            result.healthy_gpu_days += (last - first) / DAY_S
            continue
        before = [(t, s) for t, s in trace.series[key] if t < failure.time]
        times = crossings(before, threshold)
        result.true_triggers += len(times)
        result.outcomes.append(
            Outcome(trace.name, key[0], key[1], failure.mode or trace.name, failure.time, times[0] if times else None)
        )


def calibration_grid(step: float = 0.01, low: float = 0.3) -> list[float]:
    """The thresholds ``eft health calibrate`` tries: ``low`` to 1 in ``step``s."""
    count = round((1.0 - low) / step)
    return [round(low + i * step, 4) for i in range(count + 1)]


def propose_threshold(results: list[ThresholdResult], per_100_gpu_days: float) -> ThresholdResult | None:
    """The lowest threshold whose false triggers per 100 healthy GPU-days are at most the
    target: the earliest warning the fleet can afford. None when no threshold meets it."""
    for result in sorted(results, key=lambda r: r.threshold):
        rate = result.false_per_gpu_day
        if rate is not None and rate * 100 <= per_100_gpu_days + 1e-12:
            return result
    return None
