"""A restart's control path as a function of the job's size: measured, fitted, extrapolated.

``bench/restart_scale.py`` restarts N simulated nodes whole (a real etcd, eft's agent code,
worker stand-ins on the control plane) and times each of ``eft report``'s restart phases; its
``--write-curve`` writes the medians into ``restart_measured.py`` beside this file. ``eft
simulate`` reads them through ``RestartCurve`` instead of one constant restart cost, so a job of
100,000 GPUs pays what a restart at its size costs.

Within the measured sizes a phase is interpolated linearly in log N (a phase that grows as
log N is then exact; one that grows as N is within the spacing of the sizes). Past the largest,
each phase follows the growth fitted to all its measured points, the better of ``a + b·log2 N``
and ``a + b·N`` by least squares (a constant when neither slope is positive): the figure is
then *modelled*, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GROWTHS = ("constant", "log N", "N")


@dataclass(frozen=True)
class Fit:
    """One phase's growth: ``offset + slope · x(N)``, x = 1, log2 N or N."""

    growth: str
    offset: float
    slope: float

    def at(self, nodes: float) -> float:
        x = {"constant": 0.0, "log N": math.log2(nodes), "N": float(nodes)}[self.growth]
        return max(0.0, self.offset + self.slope * x)


def fit_growth(nodes: tuple[int, ...], seconds: tuple[float, ...]) -> Fit:
    """The better of ``a + b·log2 N`` and ``a + b·N`` over the points (least squares, b > 0);
    a constant (their mean) when neither grows by a tenth of the mean across the measured sizes
    (noise is no growth)."""
    mean = sum(seconds) / len(seconds)
    best = Fit("constant", mean, 0.0)
    best_error = sum((s - mean) ** 2 for s in seconds)
    if len(set(nodes)) < 2:
        return best
    for growth, xs in (("log N", [math.log2(n) for n in nodes]), ("N", [float(n) for n in nodes])):
        mx = sum(xs) / len(xs)
        spread = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (s - mean) for x, s in zip(xs, seconds)) / spread
        if slope <= 0:
            continue
        if slope * (max(xs) - min(xs)) < 0.1 * mean:
            continue
        offset = mean - slope * mx
        error = sum((offset + slope * x - s) ** 2 for x, s in zip(xs, seconds))
        # A strictly better fit only: with equal residuals the slower growth is the honest claim.
        if error < best_error * (1 - 1e-9):
            best, best_error = Fit(growth, offset, slope), error
    return best


@dataclass(frozen=True)
class RestartCurve:
    """Seconds of each restart phase at the measured node counts (ascending)."""

    nodes: tuple[int, ...]
    phases: dict[str, tuple[float, ...]]
    source: str = ""
    """Where the figures come from (the bench, its date, the machine)."""
    fits: dict[str, Fit] = field(init=False, compare=False)

    def __post_init__(self):
        if not self.nodes or list(self.nodes) != sorted(set(self.nodes)) or self.nodes[0] < 1:
            raise ValueError(f"measured node counts must be distinct, ascending and >= 1: {self.nodes}")
        for name, values in self.phases.items():
            if len(values) != len(self.nodes) or any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"phase {name}: expected {len(self.nodes)} finite seconds >= 0, got {values}")
        object.__setattr__(self, "fits", {name: fit_growth(self.nodes, values)
                                          for name, values in self.phases.items()})

    def modelled(self, nodes: int) -> bool:
        """Whether ``nodes`` lies past the largest measured size (a fitted, not a measured, figure)."""
        return nodes > self.nodes[-1]

    def phase(self, name: str, nodes: int) -> float:
        """Seconds of phase ``name`` in a restart of a job of ``nodes`` nodes."""
        values = self.phases[name]
        if nodes <= self.nodes[0]:
            return values[0]
        if self.modelled(nodes):
            # Continue from the largest measured figure at the fitted slope, not from the fit's value
            # there: the measured point is the better anchor.
            fit = self.fits[name]
            return values[-1] + max(0.0, fit.at(nodes) - fit.at(self.nodes[-1]))
        upper = next(i for i, n in enumerate(self.nodes) if n >= nodes)
        n0, n1 = self.nodes[upper - 1], self.nodes[upper]
        share = (math.log2(nodes) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
        return values[upper - 1] + share * (values[upper] - values[upper - 1])

    def seconds(self, nodes: int) -> float:
        """A whole restart's control path at ``nodes`` nodes: every phase added up."""
        return sum(self.phase(name, nodes) for name in self.phases)

    def describe(self, nodes: int) -> str:
        """One line: the figure used and whether it was measured or modelled."""
        how = (f"modelled past {self.nodes[-1]:,} measured nodes" if self.modelled(nodes)
               else f"measured at {self.nodes[0]:,}-{self.nodes[-1]:,} nodes")
        return f"restart {self.seconds(nodes):.2f} s at {nodes:,} nodes ({how}; {self.source})"
