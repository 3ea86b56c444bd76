"""Power instability: how much wider a GPU's power swings than its peers', over minutes.

A failing power delivery (a VRM or PSU going) can make one GPU's draw swing hundreds of
watts around the steady draw of its peers for half an hour before the GPU falls off the
bus. Sampled every few seconds, such a swing is high in one sample and low in the next,
so any factor judged sample by sample (the ``power`` factor: the last five samples) rises
and falls with it, and a rule that asks a factor to *stay* strong (the sustain rule,
risk.py) never sees it held. Instability is a property of a window, not of a level, so it
is measured on one:

- each round, each GPU's **deviation** is its power minus the median power of its peers in
  that round, as a fraction of its power limit. Work the whole job does together (a
  checkpoint pause, a rack's power brake, the steps themselves) moves every GPU at once and
  cancels sample by sample; what is left is the GPU's own.
- its **spread** is the standard deviation of its deviations over the last
  ``--eft-risk-power-window`` seconds (at least ``MIN_WINDOW_SAMPLES`` samples), once the
  tenth farthest from their median is left out (``TRIM``), so that a stray reading or a phase
  edge caught one sample apart holds no weight: a square wave of +-A gives about A, a sine
  0.65 A, a sawtooth or uniform random levels 0.52 A, a healthy GPU's noise 0.8 sigma.
- the **factor** is that spread beyond ``PEER_SPREAD_TOLERANCE`` times the median spread of
  its peers (the noise every GPU of this node shows), on a ramp (``SPREAD_START``,
  ``SPREAD_SPAN``); a window's spread holds through the ups and downs of a swing, so the
  sustain rule can count it.

Rounds in which the peers idle (an evaluation or checkpoint pause) add nothing to the
window: idle, a GPU has nothing to swing with, and those samples would wash a swing out of
the window while the job pauses. Pure, no I/O; the window is bounded (``MAX_WINDOW_SAMPLES``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from elasticft.health.sample import GpuSample

MIN_WINDOW_SAMPLES = 20  # the spread of fewer samples is noise; at 60 s sampling the window is 20 minutes
MAX_WINDOW_SAMPLES = 600  # the bound on what a GPU keeps: 300 s at the sampler's fastest interval (0.5 s)
BUSY_PEERS = 60.0  # %: peers' median utilisation that counts as "the job is computing" (as factors.py)
TRIM = 0.1  # the share of a window's deviations, farthest from its median, that the spread leaves out
PEER_SPREAD_TOLERANCE = 1.25  # a GPU may spread this many times its peers' median before it counts
SPREAD_START, SPREAD_SPAN = 0.015, 0.015  # spread / limit beyond the tolerated: 0 -> 1


class PowerWindow:
    """One GPU's power deviations from its peers (timestamp, fraction of its limit), over
    the last ``seconds`` but never fewer than MIN_WINDOW_SAMPLES nor more than MAX_WINDOW_SAMPLES."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.points: deque[tuple[float, float]] = deque(maxlen=MAX_WINDOW_SAMPLES)

    def add(self, timestamp: float, deviation: float) -> None:
        self.points.append((timestamp, deviation))
        while len(self.points) > MIN_WINDOW_SAMPLES and self.points[0][0] < timestamp - self.seconds:
            self.points.popleft()

    def spread(self) -> float | None:
        """Standard deviation of the deviations once the tenth farthest from their median (at
        least one) is left out; None until MIN_WINDOW_SAMPLES are in."""
        if len(self.points) < MIN_WINDOW_SAMPLES:
            return None
        values = sorted(d for _, d in self.points)
        middle = values[len(values) // 2]
        kept = sorted(values, key=lambda d: abs(d - middle))[: len(values) - max(1, int(len(values) * TRIM))]
        mean = sum(kept) / len(kept)
        # Plain floats: statistics.pstdev works in exact fractions, which the sampler pays for.
        return math.sqrt(sum((d - mean) ** 2 for d in kept) / len(kept))


def power_deviations(node_round: list[GpuSample]) -> dict[tuple[str, int], float]:
    """(node, gpu) -> power minus its peers' median power, over its limit, for the GPUs of
    one node in one round; a GPU without power, without peers reporting power, or whose
    peers idle gets none. Without a limit the peers' median draw is the scale."""
    deviations = {}
    for s in node_round:
        if s.power_w is None:
            continue
        peers = [p for p in node_round if p.key != s.key]
        peer_power = [p.power_w for p in peers if p.power_w is not None]
        peer_util = [p.utilization_pct for p in peers if p.utilization_pct is not None]
        if not peer_power or (peer_util and statistics.median(peer_util) < BUSY_PEERS):
            continue
        middle = statistics.median(peer_power)
        scale = s.power_limit_w or middle
        if scale > 0:
            deviations[s.key] = (s.power_w - middle) / scale
    return deviations


def instability_factor(own_spread: float | None, peer_spreads) -> float:
    """The GPU's spread beyond its peers' median spread, on the ramp; 0 until both are known
    (a GPU's first minutes are judged on the other factors)."""
    peers = [p for p in peer_spreads if p is not None]
    if own_spread is None or not peers:
        return 0.0
    excess = own_spread - PEER_SPREAD_TOLERANCE * statistics.median(peers)
    return min(1.0, max(0.0, (excess - SPREAD_START) / SPREAD_SPAN))
