"""How fast a GPU heats: the one slope both the risk model (its ``temp_rise`` factor) and
``eft top`` (its trend column) show, so the two never disagree. Pure, no I/O."""

from __future__ import annotations

import statistics


def temperature_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (timestamp, C) points, in C per minute; None for fewer than
    two points or when they share one timestamp."""
    if len(points) < 2:
        return None
    # Minutes since the first point: epoch seconds squared would lose the digits that matter.
    t0 = points[0][0]
    xs = [(t - t0) / 60.0 for t, _ in points]
    ys = [c for _, c in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    if spread <= 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread
