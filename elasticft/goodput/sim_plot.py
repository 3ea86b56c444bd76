"""The picture of one simulated run: per policy, the training time lost as the days pass
(with the failures marked under it), and the goodput of each policy as bars."""

from __future__ import annotations

from elasticft.goodput.failures import DAY, FailureTrace
from elasticft.goodput.policies import Result
from elasticft.goodput.svg import PALETTE, Axes, Canvas, ticks


def picture(results: list[Result], trace: FailureTrace, title: str) -> Canvas:
    """Needs results run with ``record=True`` (their progress points)."""
    canvas = Canvas(960, 460)
    canvas.text(20, 26, title, size=15, bold=True)
    days = trace.seconds / DAY
    lost_curves = []
    for result in results:
        points = result.progress or [(0.0, 0.0)]
        # progress is training done as a share of the run; lost = elapsed - done, in hours.
        lost_curves.append([(t / DAY, (t - share * trace.seconds) / 3600.0) for t, share in points])
    top = max((hours for curve in lost_curves for _, hours in curve), default=1.0) or 1.0
    axes = Axes(canvas, 70, 60, 560, 300, (0.0, days), (0.0, top * 1.05))
    axes.frame("day", "job-hours of training lost (all GPUs stopped = 1 h per hour)",
               ticks(0, days, 6), ticks(0, top, 5))
    for index, (result, curve) in enumerate(zip(results, lost_curves)):
        colour = PALETTE[index % len(PALETTE)]
        canvas.polyline([(axes.x(d), axes.y(h)) for d, h in curve], stroke=colour)
        canvas.rect(axes.left + 10, axes.top + 8 + 18 * index, 12, 12, colour)
        canvas.text(axes.left + 28, axes.top + 18 + 18 * index, result.policy, size=12)
    bottom = axes.top + axes.height
    for time, lead in zip(trace.times, trace.leads):
        x = axes.x(time / DAY)
        predicted = lead == lead  # not NaN
        canvas.line(x, bottom + 40, x, bottom + 52, stroke="#ff7f0e" if predicted else "#d62728", width=1)
    canvas.text(axes.left, bottom + 68, f"{len(trace.times)} failures (red; orange: predicted), "
                f"{len(trace.alarms)} false alarms", size=11)
    bars = Axes(canvas, 720, 60, 210, 300, (0.0, float(len(results))), (0.0, 1.0))
    bars.frame("", "goodput", [], ticks(0, 1, 5), y_format="{:.0%}")
    for index, result in enumerate(results):
        colour = PALETTE[index % len(PALETTE)]
        x = bars.x(index + 0.15)
        canvas.rect(x, bars.y(result.goodput), bars.x(index + 0.85) - x, bars.y(0) - bars.y(result.goodput),
                    colour, title=f"{result.policy}: {result.goodput:.2%}")
        canvas.text(bars.x(index + 0.5), bars.y(result.goodput) - 4, f"{result.goodput:.1%}", size=10,
                    anchor="middle")
        canvas.text(bars.x(index + 0.5), bars.y(0) + 16, result.policy, size=10, anchor="middle")
    return canvas
