"""Rates of change: how fast a GPU heats or fills its memory, and when, at that rate, it
reaches a limit. The risk model (its ``time_to_limit`` factor) and ``eft top`` (its
trend column) share ``temperature_slope``, so the two never disagree. Pure, no I/O."""

from __future__ import annotations


def slope_per_minute(points) -> float | None:
    """Least-squares slope of (timestamp, value) points, per minute; None for fewer than
    two points or when they share one timestamp. One pass: the sampler runs it for every
    GPU at every sample."""
    n = len(points)
    if n < 2:
        return None
    # Minutes since the first point: epoch seconds squared would lose the digits that matter.
    t0 = points[0][0]
    sx = sy = sxx = sxy = 0.0
    for t, y in points:
        x = (t - t0) / 60.0
        sx += x
        sy += y
        sxx += x * x
        sxy += x * y
    spread = sxx - sx * sx / n
    if spread <= 1e-12:
        return None
    return (sxy - sx * sy / n) / spread


def temperature_slope(points: list[tuple[float, float]]) -> float | None:
    """Slope of (timestamp, C) points in C per minute (see ``slope_per_minute``)."""
    return slope_per_minute(points)


def minutes_to(limit: float, value: float, rate: float | None) -> float | None:
    """Minutes until ``value`` reaches ``limit`` at ``rate`` per minute; 0 once there,
    None when it is not heading there."""
    if value >= limit:
        return 0.0
    if rate is None or rate <= 0:
        return None
    return (limit - value) / rate
