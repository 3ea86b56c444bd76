"""Scoring a whole trace offline: per GPU, the highest risk and the first crossing.

``eft health replay`` prints this; tests use it to check that a failure was
foreseen before it happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from elasticft.health.risk import RiskModel, RiskScore
from elasticft.health.sample import GpuSample, iso_time
from elasticft.health.trace import batches


@dataclass
class GpuSummary:
    node: str
    gpu: int
    samples: int = 0
    peak: RiskScore | None = None  # the highest score (the first one, on ties)
    first_trigger: RiskScore | None = None

    @property
    def max_risk(self) -> float:
        return self.peak.score if self.peak else 0.0

    @property
    def headline(self) -> RiskScore | None:
        """The score that explains this GPU: its first trigger, else its peak."""
        return self.first_trigger or self.peak

    def to_dict(self) -> dict:
        trigger, headline = self.first_trigger, self.headline
        return {
            "node": self.node,
            "gpu": self.gpu,
            "max_risk": round(self.max_risk, 4),
            "first_trigger": iso_time(trigger.timestamp) if trigger else None,
            "factors_at_trigger": trigger.to_dict()["factors"] if trigger else None,
            "dominant_factor": headline.dominant if headline else None,
            "critical": trigger.critical if trigger else None,
            "samples": self.samples,
        }


def summarize(samples: Iterable[GpuSample], model: RiskModel) -> list[GpuSummary]:
    """Feed ``samples`` round by round through ``model``; summaries sorted by node, GPU."""
    summaries: dict[tuple[str, int], GpuSummary] = {}
    for round_ in batches(samples):
        for score in model.update(round_):
            summary = summaries.setdefault((score.node, score.gpu), GpuSummary(score.node, score.gpu))
            summary.samples += 1
            if summary.peak is None or score.score > summary.peak.score:
                summary.peak = score
            if score.triggered and summary.first_trigger is None:
                summary.first_trigger = score
    return [summaries[k] for k in sorted(summaries)]
