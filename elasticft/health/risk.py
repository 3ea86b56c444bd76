"""The per-GPU risk score: a pure function of the samples seen so far, no I/O.

Each GPU gets six telemetry factors in [0, 1] (docs/health.md explains each
normalisation), and a seventh, ``straggler``, that comes from outside the samples:
the agent's straggler monitor sets it with ``set_straggler`` (elasticft/stragglers.py)
and it counts only where it raises the score. The score is the weighted mean over the
factors that have data, so a field the GPU does not report (no ECC, no power sensor)
is not held against it. A critical event — a new uncorrected ECC error, a pending row
remap, a critical Xid — sets the score to 1.0 by itself: with telemetry weights that
add up to 1 and a threshold of 0.95, everything else needs several factors at once.

The model keeps, per GPU, a rolling window of plain data (``GpuHistory``); feeding
it the same samples (and straggler factors) always gives the same scores.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from elasticft.config import RiskConfig
from elasticft.health.sample import GpuSample
from elasticft.health.trend import temperature_slope

FACTORS = ("temperature", "memory", "errors", "power", "utilization_drop", "temp_rise", "straggler")

# Xids after which NVIDIA's Xid catalogue says the GPU needs a reset or is gone:
# 48 double-bit ECC, 63/64 row remap or page retirement event/failure, 74 NVLink
# error, 79 fallen off the bus, 94/95 contained/uncontained ECC error.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 94, 95})

# "Recent" signals (power swing, utilisation, rise rate, HW slowdown) look at the
# last few samples so that an oscillation shows up in every sample it spans.
RECENT = 5
MIN_BASELINE = 5  # samples before the recent ones needed for a temperature z-score

# Normalisations: each factor is 0 at START and 1 at START + SPAN (linear, clamped).
TEMP_ABS_SPAN = 15.0  # C: the absolute part starts 15 C below --eft-risk-temp-limit
TEMP_Z_START, TEMP_Z_SPAN = 2.0, 3.0  # robust z-score vs the GPU's own baseline
TEMP_STD_FLOOR = 1.0  # C: sensors report whole degrees; a flat baseline is not 0 wide
MEMORY_START, MEMORY_SPAN = 0.85, 0.13  # fraction of memory in use
ECC_FULL_PER_HOUR = 1000.0  # corrected errors/hour at which the ECC part is 1 (log scale)
POWER_CV_START, POWER_CV_SPAN = 0.05, 0.15  # std of power / limit, above the peers' median
BUSY_PEERS = 60.0  # %: peers' median utilisation that counts as "busy"
UTIL_DROP_START, UTIL_DROP_SPAN = 10.0, 30.0  # percentage points below the busy peers
RISE_START, RISE_SPAN = 0.25, 1.0  # C/minute faster than the peers' median
# After a crossing a GPU re-arms only once its score falls below this fraction of the
# threshold, so that a score hovering around the threshold is one crossing, not many.
REARM_FRACTION = 0.8


def crossing(score: float, threshold: float, armed: bool) -> tuple[bool, bool, bool]:
    """(triggered, crossed, armed afterwards) for one score of one GPU.

    A score at the threshold triggers; it is a crossing only if the GPU was armed, and
    the GPU is armed again once its score falls below REARM_FRACTION of the threshold.
    The model and ``evaluate.crossings`` (a threshold sweep over kept scores) share it.
    """
    if score >= threshold - 1e-9:
        return True, armed, False
    return False, False, armed or score < threshold * REARM_FRACTION


@dataclass
class GpuHistory:
    """What the model remembers about one GPU."""

    window: int
    temps: deque = field(init=False)  # (timestamp, C), the baseline window
    powers: deque = field(init=False)  # (W, limit W or None), recent
    utils: deque = field(init=False)  # %, recent
    hw_slowdown: deque = field(init=False)  # bool, recent
    corrected: deque = field(init=False)  # (timestamp, count), the baseline window
    last_uncorrected: int | None = None
    armed: bool = True  # the next time the score reaches the threshold is a crossing

    def __post_init__(self) -> None:
        self.temps = deque(maxlen=self.window)
        self.powers = deque(maxlen=RECENT)
        self.utils = deque(maxlen=RECENT)
        self.hw_slowdown = deque(maxlen=RECENT)
        self.corrected = deque(maxlen=self.window)

    def add(self, s: GpuSample) -> str | None:
        """Remember ``s``; return the critical event it carries, if any."""
        critical = None
        if s.rows_pending:
            critical = "row remap pending"
        if s.ecc_uncorrected is not None:
            if self.last_uncorrected is not None and s.ecc_uncorrected > self.last_uncorrected:
                critical = f"uncorrected ECC error (+{s.ecc_uncorrected - self.last_uncorrected})"
            self.last_uncorrected = s.ecc_uncorrected
        bad_xids = sorted(set(s.xids) & CRITICAL_XIDS)
        if bad_xids:
            critical = "Xid " + ",".join(str(x) for x in bad_xids)
        if s.temperature_c is not None:
            self.temps.append((s.timestamp, s.temperature_c))
        if s.power_w is not None:
            self.powers.append((s.power_w, s.power_limit_w))
        if s.utilization_pct is not None:
            self.utils.append(s.utilization_pct)
        if s.hw_slowdown is not None:
            self.hw_slowdown.append(s.hw_slowdown)
        if s.ecc_corrected is not None:
            if self.corrected and s.ecc_corrected < self.corrected[-1][1]:
                self.corrected.clear()  # the driver reloaded: volatile counters restarted
            self.corrected.append((s.timestamp, s.ecc_corrected))
        return critical

    # -- recent signals, compared against the peers ------------------------------

    def power_swing(self) -> float | None:
        """Standard deviation of recent power as a fraction of the limit."""
        if len(self.powers) < 3:
            return None
        values = [p for p, _ in self.powers]
        limit = self.powers[-1][1] or statistics.fmean(values)
        return statistics.pstdev(values) / limit if limit > 0 else None

    def recent_utilization(self) -> float | None:
        return statistics.fmean(self.utils) if self.utils else None

    def rise_rate(self) -> float | None:
        """Least-squares slope of the recent temperatures, C per minute; None below three samples."""
        recent = list(self.temps)[-RECENT:]
        return temperature_slope(recent) if len(recent) >= 3 else None


@dataclass(frozen=True)
class RiskScore:
    node: str
    gpu: int
    timestamp: float
    score: float
    factors: dict[str, float | None]  # None: the GPU gives no data for this factor
    dominant: str | None  # the factor that contributes most, None when all are 0
    triggered: bool  # score >= threshold
    crossed: bool  # triggered, and the first time since the score was last well below
    critical: str | None = None  # the critical event that forced the score to 1.0

    def to_dict(self) -> dict:
        return {
            "score": round(self.score, 4),
            "factors": {k: None if v is None else round(v, 4) for k, v in self.factors.items()},
            "dominant": self.dominant,
            "triggered": self.triggered,
            "critical": self.critical,
        }


def ramp(value: float, start: float, span: float) -> float:
    """0 at ``start``, 1 at ``start + span``, linear between, clamped."""
    return min(1.0, max(0.0, (value - start) / span))


def _peer_median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


class RiskModel:
    """Per-GPU risk from a stream of samples; ``update`` is the only entry point."""

    def __init__(self, config: RiskConfig | None = None):
        self.config = config or RiskConfig()
        self.weights = self.config.weights()
        self.history: dict[tuple[str, int], GpuHistory] = {}
        # (node, gpu) -> the straggler factor of the rank on that GPU; a GPU whose rank
        # was never scored has no entry, so the factor is "no data" and dilutes nothing.
        self.stragglers: dict[tuple[str, int], float] = {}

    @property
    def threshold(self) -> float:
        return self.config.risk_threshold

    def set_straggler(self, node: str, gpu: int, factor: float | None) -> None:
        """The straggler factor of ``gpu`` from now on (None: no data again).

        Called from the straggler monitor's thread; one dict assignment, which the
        sampler thread reads whole.
        """
        if factor is None:
            self.stragglers.pop((node, gpu), None)
        else:
            self.stragglers[(node, gpu)] = min(1.0, max(0.0, float(factor)))

    def update(self, samples: list[GpuSample]) -> list[RiskScore]:
        """Score ``samples``; one RiskScore per sample, in the same order.

        The GPUs of one node in one call are each other's peers. A call holding
        several samples of one GPU is scored as consecutive rounds.
        """
        scores: list[RiskScore] = []
        round_: list[GpuSample] = []
        for sample in samples:
            if any(s.key == sample.key for s in round_):
                scores.extend(self._score_round(round_))
                round_ = []
            round_.append(sample)
        if round_:
            scores.extend(self._score_round(round_))
        return scores

    def _score_round(self, samples: list[GpuSample]) -> list[RiskScore]:
        critical = {}
        for s in samples:
            history = self.history.get(s.key)
            if history is None:
                history = self.history[s.key] = GpuHistory(self.config.risk_window)
            critical[s.key] = history.add(s)
        by_node: dict[str, list[GpuSample]] = {}
        for s in samples:
            by_node.setdefault(s.node, []).append(s)
        signals = {
            s.key: (
                self.history[s.key].power_swing(),
                self.history[s.key].recent_utilization(),
                self.history[s.key].rise_rate(),
            )
            for s in samples
        }
        scores = []
        for s in samples:
            peers = [signals[p.key] for p in by_node[s.node] if p.key != s.key]
            factors = self._factors(s, self.history[s.key], signals[s.key], peers)
            scores.append(self._combine(s, factors, critical[s.key]))
        return scores

    def _factors(self, s: GpuSample, h: GpuHistory, own: tuple, peers: list[tuple]) -> dict:
        """Each factor in [0, 1]; None where the GPU reports nothing to compute it from.

        A factor whose inputs are reported but whose history is still too short is
        0, not None, so that a GPU's first samples cannot trigger on one factor.
        """
        swing, util, rise = own
        f: dict[str, float | None] = dict.fromkeys(FACTORS)
        if s.temperature_c is not None:
            limit = self.config.risk_temp_limit
            absolute = ramp(s.temperature_c, limit - TEMP_ABS_SPAN, TEMP_ABS_SPAN)
            baseline = [c for _, c in list(h.temps)[:-RECENT]]
            z_part = 0.0
            if len(baseline) >= MIN_BASELINE:
                # Median and MAD: an evaluation pause in the window (every GPU idle
                # and cool for minutes) must not widen the baseline for an hour.
                centre = statistics.median(baseline)
                mad = statistics.median(abs(c - centre) for c in baseline)
                z = (s.temperature_c - centre) / max(1.4826 * mad, TEMP_STD_FLOOR)
                z_part = ramp(z, TEMP_Z_START, TEMP_Z_SPAN)
            f["temperature"] = max(absolute, z_part)
            peer_rise = _peer_median([p[2] for p in peers]) or 0.0
            f["temp_rise"] = 0.0 if rise is None else ramp(rise - peer_rise, RISE_START, RISE_SPAN)
        if s.memory_used_mib is not None and s.memory_total_mib:
            f["memory"] = ramp(s.memory_used_mib / s.memory_total_mib, MEMORY_START, MEMORY_SPAN)
        f["errors"] = self._errors(s, h)
        if s.power_w is not None:
            peer_swing = _peer_median([p[0] for p in peers]) or 0.0
            f["power"] = 0.0 if swing is None else ramp(swing - peer_swing, POWER_CV_START, POWER_CV_SPAN)
        peer_util = _peer_median([p[1] for p in peers])
        if s.utilization_pct is not None and peer_util is not None:
            drop = 0.0
            if peer_util >= BUSY_PEERS:
                drop = ramp(peer_util - util, UTIL_DROP_START, UTIL_DROP_SPAN)
            f["utilization_drop"] = drop
        f["straggler"] = self.stragglers.get(s.key)
        return f

    @staticmethod
    def _errors(s: GpuSample, h: GpuHistory) -> float | None:
        """Corrected-ECC rate over the window (log scale) or recent HW slowdown."""
        parts = []
        if s.ecc_corrected is not None:
            rate = 0.0
            if len(h.corrected) >= 2:
                (t0, c0), (t1, c1) = h.corrected[0], h.corrected[-1]
                if t1 > t0:
                    rate = (c1 - c0) * 3600.0 / (t1 - t0)
            parts.append(min(1.0, math.log10(1.0 + rate) / math.log10(1.0 + ECC_FULL_PER_HOUR)))
        if s.hw_slowdown is not None:
            parts.append(sum(h.hw_slowdown) / len(h.hw_slowdown))
        return max(parts) if parts else None

    def _mean(self, present: dict[str, float]) -> float:
        """The weighted mean of the factors that have data."""
        total = sum(self.weights[k] for k in present)
        return sum(self.weights[k] * v for k, v in present.items()) / total if total > 0 else 0.0

    def _combine(self, s: GpuSample, factors: dict, critical: str | None) -> RiskScore:
        if critical:
            factors["errors"] = 1.0
        present = {k: v for k, v in factors.items() if v is not None}
        score = self._mean(present)
        if "straggler" in present:
            # The straggler factor only ever raises the score: a rank keeping pace says
            # nothing about the GPU's telemetry, so neither a healthy rank (0) nor a mild
            # straggler on a GPU already in distress may dilute the other factors.
            telemetry = {k: v for k, v in present.items() if k != "straggler"}
            if telemetry and self._mean(telemetry) >= score:
                present, score = telemetry, self._mean(telemetry)
        if critical:
            score = 1.0
        contributions = {k: self.weights[k] * v for k, v in present.items() if v > 0}
        dominant = max(contributions, key=contributions.get) if contributions else None
        if critical:
            dominant = "errors"
        history = self.history[s.key]
        triggered, crossed, history.armed = crossing(score, self.threshold, history.armed)
        return RiskScore(
            node=s.node,
            gpu=s.gpu,
            timestamp=s.timestamp,
            score=min(1.0, max(0.0, score)),
            factors=factors,
            dominant=dominant,
            triggered=triggered,
            crossed=crossed,
            critical=critical,
        )
