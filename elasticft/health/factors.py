"""The risk model's factors: each a number in [0, 1] for one GPU at one round, or None
where the GPU does not report what it needs. Pure functions; docs/health.md explains
each one and its normalisation.

Three kinds of evidence (docs/health.md, "The risk model"):

- physics: how close the GPU is to its own limits (slowdown and shutdown
  temperature, memory), and how soon it gets there at the current rate;
- peers: a synchronous job gives every GPU of a node the same work at the same
  moment, so a GPU that differs from the others *in the same round* (hotter than it
  usually is relative to them, slower clocks, idle, swinging power, throttling
  alone) is suspicious even without a history;
- its own past: the corrected-ECC rate, and the GPU's usual offset from its peers,
  so that a GPU that always runs hot is judged against itself.
"""

from __future__ import annotations

import math
import statistics

from elasticft.config import RiskConfig
from elasticft.health.history import TREND_MIN_SPAN_S, TREND_S, GpuHistory, Signals
from elasticft.health.instability import instability_factor
from elasticft.health.sample import GpuSample
from elasticft.health.trend import minutes_to

FACTORS = (
    "temperature", "time_to_limit", "errors", "clocks", "power", "power_instability", "utilization_drop",
    "peer_temp", "memory", "straggler",
)

SHUTDOWN_ABOVE_SLOWDOWN = 5.0  # C: the shutdown threshold where only the slowdown one is known
TEMP_HEADROOM = 10.0  # C below slowdown where the temperature factor starts (up to 0.3)
TEMP_BELOW_SLOWDOWN_SHARE = 0.3  # the share of the temperature factor reached at slowdown
PEER_TRANSIENT_SHARE = 0.3  # of the peers' common rate, tolerated as lag differences
LEAD_MARGIN_S = 300.0  # seconds of warning wanted beyond the checkpoint itself
MIN_BASELINE = 5  # older samples needed before a GPU's usual offset from its peers is known
PEER_TEMP_START, PEER_TEMP_SPAN = 3.0, 5.0  # C hotter than usual relative to the peers
ECC_FULL_PER_HOUR = 300.0  # corrected errors/hour over the trend span at which the ECC part is 1 (log scale)
MEMORY_START, MEMORY_SPAN = 0.98, 0.02  # the last 2 %: a Megatron job sits at 95-97 %
POWER_CV_START, POWER_CV_SPAN = 0.05, 0.15  # std of power / limit, above the peers' median
BUSY_PEERS = 60.0  # %: peers' median utilisation that counts as "busy"
UTIL_DROP_START, UTIL_DROP_SPAN = 10.0, 30.0  # percentage points below the busy peers
CLOCK_DROP_START, CLOCK_DROP_SPAN = 0.05, 0.25  # fraction below the busy peers' SM clock


def ramp(value: float, start: float, span: float) -> float:
    """0 at ``start``, 1 at ``start + span``, linear between, clamped."""
    return min(1.0, max(0.0, (value - start) / span))


def peer_median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def limits(s: GpuSample, config: RiskConfig) -> tuple[float, float]:
    """(slowdown, shutdown) C: the GPU's own where it reports them, else the knob's."""
    slowdown = s.temp_slowdown_c or config.risk_temp_limit
    shutdown = s.temp_shutdown_c or slowdown + SHUTDOWN_ABOVE_SLOWDOWN
    return slowdown, max(shutdown, slowdown + 1.0)


def lead_minutes(config: RiskConfig) -> float:
    """The warning a checkpoint needs: its duration plus a margin, in minutes."""
    return (config.risk_checkpoint_time + LEAD_MARGIN_S) / 60.0


def compute(
    s: GpuSample, h: GpuHistory, own: Signals, peers: list[Signals], config: RiskConfig, straggler: float | None
) -> dict[str, float | None]:
    """Every factor of ``s``; ``peers`` are the other GPUs of its node in this round.

    A factor whose inputs are reported but whose history is still too short is 0, not
    None: a GPU's first samples are judged on what they show, not on nothing.
    """
    f: dict[str, float | None] = dict.fromkeys(FACTORS)
    slowdown, shutdown = limits(s, config)
    busy_peers = (peer_median(p.utilization for p in peers) or 0.0) >= BUSY_PEERS
    if s.temperature_c is not None:
        t = s.temperature_c
        f["temperature"] = TEMP_BELOW_SLOWDOWN_SHARE * ramp(t, slowdown - TEMP_HEADROOM, TEMP_HEADROOM) + (
            1 - TEMP_BELOW_SLOWDOWN_SHARE
        ) * ramp(t, slowdown, shutdown - slowdown)
        f["peer_temp"] = _peer_temp(t, h, peers)
    f["time_to_limit"] = _time_to_limit(s, own, peers, shutdown, config)
    f["errors"] = _errors(s, h, own, peers)
    if own.clock is not None and peers:
        peer_clock = peer_median(p.clock for p in peers)
        f["clocks"] = 0.0
        if peer_clock and busy_peers:
            f["clocks"] = ramp(1.0 - own.clock / peer_clock, CLOCK_DROP_START, CLOCK_DROP_SPAN)
    if s.power_w is not None:
        peer_swing = peer_median(p.swing for p in peers) or 0.0
        f["power"] = 0.0 if own.swing is None else ramp(own.swing - peer_swing, POWER_CV_START, POWER_CV_SPAN)
        if peers:
            f["power_instability"] = instability_factor(own.power_spread, (p.power_spread for p in peers))
    peer_util = peer_median(p.utilization for p in peers)
    if own.utilization is not None and peer_util is not None:
        f["utilization_drop"] = ramp(peer_util - own.utilization, UTIL_DROP_START, UTIL_DROP_SPAN) if busy_peers else 0.0
    if s.memory_used_mib is not None and s.memory_total_mib:
        f["memory"] = ramp(s.memory_used_mib / s.memory_total_mib, MEMORY_START, MEMORY_SPAN)
    f["straggler"] = straggler
    return f


def _peer_temp(t: float, h: GpuHistory, peers: list[Signals]) -> float | None:
    """How much hotter than its peers this GPU is now, beyond how much hotter it usually is
    (``h.offsets``, which the model fills before computing the factors)."""
    peer_t = peer_median(p.temperature for p in peers)
    if peer_t is None:
        return None
    usual = h.usual_offset(MIN_BASELINE)
    return 0.0 if usual is None else ramp(t - peer_t - usual, PEER_TEMP_START, PEER_TEMP_SPAN)


def _excess(rate: float | None, peer_rates) -> float | None:
    """This GPU's rate beyond its peers' median: a job warming up heats every GPU at once.

    While the whole node moves (warming up after a pause: 3 C a minute) GPUs with
    different lags differ by a fraction of that common rate; that fraction is tolerated.
    """
    if rate is None:
        return None
    peer = peer_median(peer_rates) or 0.0
    return rate - peer - PEER_TRANSIENT_SHARE * abs(peer)


def _time_to_limit(s: GpuSample, own: Signals, peers: list[Signals], shutdown: float, config: RiskConfig):
    """1 when, at its current rate beyond its peers', the GPU reaches its shutdown
    temperature or runs out of memory within a checkpoint plus a margin; 0 from three
    times that on."""
    if s.temperature_c is None and (s.memory_used_mib is None or not s.memory_total_mib):
        return None
    etas = []
    if s.temperature_c is not None:
        etas.append(minutes_to(shutdown, s.temperature_c, _excess(own.temp_slope, (p.temp_slope for p in peers))))
    if s.memory_used_mib is not None and s.memory_total_mib:
        etas.append(minutes_to(s.memory_total_mib, s.memory_used_mib, _excess(own.mem_slope, (p.mem_slope for p in peers))))
    etas = [e for e in etas if e is not None]
    if not etas:
        return 0.0
    lead = lead_minutes(config)
    return ramp(3 * lead - min(etas), 0.0, 2 * lead)


def _errors(s: GpuSample, h: GpuHistory, own: Signals, peers: list[Signals]) -> float | None:
    """Corrected-ECC rate over the last TREND_S (log scale), or HW slowdown beyond the peers'.

    The rate is taken over the trend span, not the whole window: a climbing rate is the
    warning, and half an hour's average trails it by many minutes.
    """
    parts = []
    if s.ecc_corrected is not None:
        rate = 0.0
        if len(h.corrected) >= 2:
            t1, c1 = h.corrected[-1]
            t0, c0 = next(p for p in h.corrected if p[0] >= t1 - TREND_S)
            if t1 - t0 >= TREND_MIN_SPAN_S:
                rate = (c1 - c0) * 3600.0 / (t1 - t0)
        parts.append(min(1.0, math.log10(1.0 + rate) / math.log10(1.0 + ECC_FULL_PER_HOUR)))
    if own.hw_fraction is not None:
        # A rack's power brake slows every GPU at once: that is the rack, not this GPU.
        parts.append(max(0.0, own.hw_fraction - (peer_median(p.hw_fraction for p in peers) or 0.0)))
    return max(parts) if parts else None
