"""What the risk model remembers about one GPU: plain data, fed one sample at a time.

``GpuHistory.add`` records a sample and reports the critical event it carries;
``signals`` condenses the recent past into the numbers that are compared with the
GPU's peers in the same round (risk.py) and turned into factors (factors.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from elasticft.health.instability import PowerWindow
from elasticft.health.sample import GpuSample
from elasticft.health.trend import slope_per_minute

# Xids after which NVIDIA's Xid catalogue says the GPU needs a reset or is gone:
# 48 double-bit ECC, 63/64 row remap or page retirement event/failure, 74 NVLink
# error, 79 fallen off the bus, 94/95 contained/uncontained ECC error.
CRITICAL_XIDS = frozenset({48, 63, 64, 74, 79, 94, 95})

# "Recent" signals (power swing, utilisation, clocks, HW slowdown) look at the last few
# samples so that an oscillation shows up in every sample it spans.
RECENT = 5
# Trends (temperature, memory) are fitted over the last TREND_S seconds: long enough
# that whole-degree sensor steps and allocator noise average out at a 10 s interval,
# short enough to follow a GPU that started heating a few minutes ago.
TREND_S = 600.0
TREND_MIN_SPAN_S = 120.0  # a trend over less than two minutes is noise
# ... and so is one through fewer points: at one sample a minute, three points two minutes apart
# made a healthy GPU warming up at a job's start look minutes from its shutdown temperature
TREND_MIN_POINTS = 5


@dataclass(frozen=True, slots=True)
class Signals:
    """One GPU's condensed recent past at one round (None: not reported / too short)."""

    temperature: float | None
    temp_slope: float | None  # C/minute over TREND_S
    mem_slope: float | None  # MiB/minute over TREND_S
    swing: float | None  # std of recent power / limit
    power_spread: float | None  # trimmed std of the power deviations from the peers, over the window (instability.py)
    utilization: float | None  # mean recent %
    clock: float | None  # mean recent SM MHz
    hw_fraction: float | None  # fraction of recent samples in HW slowdown


@dataclass
class GpuHistory:
    window: int
    power_window_s: float = 300.0  # seconds of power deviations kept (instability.py)
    temps: deque = field(init=False)  # (timestamp, C), the baseline window
    mems: deque = field(init=False)  # (timestamp, MiB used), the baseline window
    offsets: deque = field(init=False)  # C above the peers' median: how hot this GPU usually runs
    powers: deque = field(init=False)  # (W, limit W or None), recent
    utils: deque = field(init=False)  # %, recent
    clocks: deque = field(init=False)  # SM MHz, recent
    hw_slowdown: deque = field(init=False)  # bool, recent
    corrected: deque = field(init=False)  # (timestamp, count), the baseline window
    power_deviations: PowerWindow = field(init=False)  # fed by the model, which knows the peers
    last_uncorrected: int | None = None
    armed: bool = True  # the next time the score reaches the threshold is a crossing
    strong_since: dict = field(default_factory=dict)  # factor -> timestamp it last rose to a sustained level

    def __post_init__(self) -> None:
        self.temps = deque(maxlen=self.window)
        self.mems = deque(maxlen=self.window)
        self.offsets = deque(maxlen=self.window)
        self.powers = deque(maxlen=RECENT)
        self.utils = deque(maxlen=RECENT)
        self.clocks = deque(maxlen=RECENT)
        self.hw_slowdown = deque(maxlen=RECENT)
        self.corrected = deque(maxlen=self.window)
        self.power_deviations = PowerWindow(self.power_window_s)

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
        if s.memory_used_mib is not None:
            self.mems.append((s.timestamp, s.memory_used_mib))
        if s.power_w is not None:
            self.powers.append((s.power_w, s.power_limit_w))
        if s.utilization_pct is not None:
            self.utils.append(s.utilization_pct)
        if s.sm_clock_mhz is not None:
            self.clocks.append(s.sm_clock_mhz)
        if s.hw_slowdown is not None:
            self.hw_slowdown.append(s.hw_slowdown)
        if s.ecc_corrected is not None:
            if self.corrected and s.ecc_corrected < self.corrected[-1][1]:
                self.corrected.clear()  # the driver reloaded: volatile counters restarted
            self.corrected.append((s.timestamp, s.ecc_corrected))
        return critical

    def signals(self, s: GpuSample) -> Signals:
        return Signals(
            temperature=s.temperature_c,
            temp_slope=_trend(self.temps) if s.temperature_c is not None else None,
            mem_slope=_trend(self.mems) if s.memory_used_mib is not None else None,
            swing=self._power_swing() if s.power_w is not None else None,
            power_spread=self.power_deviations.spread() if s.power_w is not None else None,
            utilization=statistics.fmean(self.utils) if self.utils and s.utilization_pct is not None else None,
            clock=statistics.fmean(self.clocks) if self.clocks and s.sm_clock_mhz is not None else None,
            # Over RECENT samples even before there are that many: one sample in HW
            # slowdown is 0.2, not 1 (a GPU's first sample must not trigger on it alone).
            hw_fraction=sum(self.hw_slowdown) / RECENT if s.hw_slowdown is not None else None,
        )

    def _power_swing(self) -> float | None:
        """Standard deviation of recent power as a fraction of the limit."""
        if len(self.powers) < 3:
            return None
        values = [p for p, _ in self.powers]
        mean = sum(values) / len(values)
        limit = self.powers[-1][1] or mean
        # Plain floats: statistics.pstdev works in exact fractions, the model's largest cost.
        return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) / limit if limit > 0 else None

    def usual_offset(self, min_baseline: int) -> float | None:
        """Median of this GPU's offsets above its peers, leaving out the recent ones (None: too few)."""
        if len(self.offsets) < RECENT + min_baseline:
            return None
        older = list(self.offsets)[:-RECENT]
        return statistics.median(older)


def _trend(points: deque) -> float | None:
    """Slope per minute of the points in the last TREND_S seconds; None over a short span."""
    if len(points) < TREND_MIN_POINTS:
        return None
    end = points[-1][0]
    recent = [p for p in points if p[0] >= end - TREND_S]
    if len(recent) < TREND_MIN_POINTS or end - recent[0][0] < TREND_MIN_SPAN_S:
        return None
    return slope_per_minute(recent)
