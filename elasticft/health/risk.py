"""The per-GPU risk score: a pure function of the samples seen so far, no I/O.

Each GPU gets telemetry factors in [0, 1] (factors.py; docs/health.md explains each)
and a straggler factor that comes from outside the samples: the agent's straggler
monitor sets it with ``set_straggler`` (elasticft/stragglers.py).

The factors combine by a **noisy-OR**: each factor's weight is the probability that
it alone, at full strength, means the GPU is failing, and

    score = 1 - prod(1 - weight * factor)

so one strong symptom can trigger by itself (a GPU at its shutdown temperature, or
minutes from it at its current rate), weak ones add up (two factors at 0.5 give 0.75),
and a factor without data contributes nothing instead of diluting the others. A factor
that compares a GPU with its busy peers (``SUSTAINED_FACTORS``: clocks, power swing, power
instability, utilization drop) and stays strong (``SUSTAINED_LEVEL``) for ``--eft-risk-sustain-seconds``
counts at weight 1 from then on: one GPU of a synchronous job cannot run that differently
from its peers for minutes and be healthy (a failing power delivery swings its power and
stalls it for many minutes before the GPU falls off the bus, and the two weights of 0.5
cap such a pair at 0.75, under the threshold however long it lasts). The power swing
over five samples and over the power window (instability.py) are one symptom: the score
counts the stronger (``ONE_SYMPTOM``). A
critical event — a new uncorrected ECC error, a pending row remap, a critical Xid —
sets the score to 1.0. Each factor's contribution (weight * factor) is kept in the
score, so ``eft top`` and the events can say why a GPU is risky.

The model keeps, per GPU, a ``GpuHistory`` of plain data; feeding it the same samples
(and straggler factors) always gives the same scores.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.config import RiskConfig
from elasticft.health import factors as factor_rules
from elasticft.health.factors import FACTORS, peer_median
from elasticft.health.history import CRITICAL_XIDS, GpuHistory
from elasticft.health.instability import power_deviations
from elasticft.health.sample import GpuSample

__all__ = ["CRITICAL_XIDS", "FACTORS", "REARM_FRACTION", "RiskModel", "RiskScore", "crossing"]

# Peer-relative factors whose strength, held for --eft-risk-sustain-seconds, counts at weight 1.
SUSTAINED_FACTORS = ("clocks", "power", "power_instability", "utilization_drop")
SUSTAINED_LEVEL = 0.75
# Factors that see one symptom over different spans: the power swing over the last five samples
# and over the power window. The score counts the stronger of them once, so that one swing does
# not add up with itself as if it were two symptoms.
ONE_SYMPTOM = (("power", "power_instability"),)

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
    contributions: dict[str, float] | None = None  # weight * factor, for the factors above 0

    def to_dict(self) -> dict:
        return {
            "score": round(self.score, 4),
            "factors": {k: None if v is None else round(v, 4) for k, v in self.factors.items()},
            "contributions": {k: round(v, 4) for k, v in (self.contributions or {}).items()},
            "dominant": self.dominant,
            "triggered": self.triggered,
            "critical": self.critical,
        }


def symptoms(contributions: dict[str, float]) -> list[float]:
    """The contributions the score combines: each group of ONE_SYMPTOM as its strongest member."""
    merged = dict(contributions)
    for group in ONE_SYMPTOM:
        present = [merged.pop(name) for name in group if name in merged]
        if present:
            merged[group[0]] = max(present)
    return list(merged.values())


def noisy_or(contributions) -> float:
    """1 - prod(1 - p): the chance that at least one of independent symptoms is real."""
    healthy = 1.0
    for p in contributions:
        healthy *= 1.0 - p
    return 1.0 - healthy


class RiskModel:
    """Per-GPU risk from a stream of samples; ``update`` is the only entry point."""

    def __init__(self, config: RiskConfig | None = None):
        self.config = config or RiskConfig()
        self.weights = self.config.weights()
        self.history: dict[tuple[str, int], GpuHistory] = {}
        # (node, gpu) -> the straggler factor of the rank on that GPU; a GPU whose rank
        # was never scored has no entry, so the factor is "no data" and adds nothing.
        self.stragglers: dict[tuple[str, int], float] = {}
        self.suspects: dict[str, str] = {}  # node -> why its GPUs are critical (numeric faults)

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

    def set_suspect(self, node: str, why: str) -> None:
        """Every GPU of ``node`` is critical from now on (risk 1.0): it computed bad numbers
        (``node_suspect``). One dict assignment, read whole by the sampler thread."""
        self.suspects = {**self.suspects, node: why}

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
                history = self.history[s.key] = GpuHistory(self.config.risk_window, self.config.risk_power_window)
            critical[s.key] = history.add(s)
        by_node: dict[str, list[GpuSample]] = {}
        for s in samples:
            by_node.setdefault(s.node, []).append(s)
        for node_round in by_node.values():
            deviations = power_deviations(node_round)
            for s in node_round:
                if s.key in deviations:
                    self.history[s.key].power_deviations.add(s.timestamp, deviations[s.key])
        signals = {s.key: self.history[s.key].signals(s) for s in samples}
        scores = []
        for s in samples:
            peers = [signals[p.key] for p in by_node[s.node] if p.key != s.key]
            history = self.history[s.key]
            peer_t = peer_median(p.temperature for p in peers)
            if s.temperature_c is not None and peer_t is not None:
                history.offsets.append(s.temperature_c - peer_t)
            factors = factor_rules.compute(s, history, signals[s.key], peers, self.config, self.stragglers.get(s.key))
            scores.append(self._combine(s, factors, critical[s.key] or self.suspects.get(s.node)))
        return scores

    def _sustained(self, s: GpuSample, factors: dict) -> set[str]:
        """The peer-relative factors of ``s``'s GPU that have stayed strong long enough to count
        at weight 1 (a factor that weakens, or has no data, starts over)."""
        since = self.history[s.key].strong_since
        held = self.config.risk_sustain_seconds
        for name in SUSTAINED_FACTORS:
            value = factors.get(name)
            if value is not None and value >= SUSTAINED_LEVEL:
                since.setdefault(name, s.timestamp)
            else:
                since.pop(name, None)
        return {name for name, t in since.items() if held > 0 and s.timestamp - t >= held}

    def _combine(self, s: GpuSample, factors: dict, critical: str | None) -> RiskScore:
        if critical:
            factors["errors"] = 1.0
        sustained = self._sustained(s, factors)
        contributions = {
            k: (1.0 if k in sustained else self.weights[k]) * v
            for k, v in factors.items() if v is not None and v > 0 and self.weights[k] > 0
        }
        score = 1.0 if critical else noisy_or(symptoms(contributions))
        dominant = "errors" if critical else (max(contributions, key=contributions.get) if contributions else None)
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
            contributions=contributions,
        )
