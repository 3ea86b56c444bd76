"""Growth fits of a restart's phases against N, and their log-log picture (``bench/restart_scale.py``).

Three two-parameter models per phase, least squares each: ``a + b·log N``, ``a + b·N`` and the
power law ``c·N^k`` (a straight line in log time against log N; ``k`` is the exponent). The one
named is the model with the smallest relative error over the measured sizes; a size beyond the
measured ones is that model's value, marked "modelled" wherever it is shown.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from elasticft.goodput.svg import Axes, Canvas

FLOOR = 1e-4  # seconds: a phase measured as nothing still has a place on a log axis


@dataclass(frozen=True)
class Fit:
    model: str  # "log", "linear", "power"
    a: float
    b: float
    exponent: float  # the power law's k, whichever model was chosen
    error: float  # root mean square of the relative errors over the measured sizes

    def at(self, n: float) -> float:
        if self.model == "log":
            return max(FLOOR, self.a + self.b * math.log(n))
        if self.model == "linear":
            return max(FLOOR, self.a + self.b * n)
        return self.a * n ** self.b

    @property
    def growth(self) -> str:
        if self.model == "power":
            return f"N^{self.exponent:.2f}"
        if self.b <= 0 or self.at(1024) < 1.2 * self.at(8):
            return "flat"
        return "log N" if self.model == "log" else "linear in N"


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def fit(sizes: list[int], seconds: list[float]) -> Fit:
    ys = [max(FLOOR, s) for s in seconds]
    a, k = _line([math.log(n) for n in sizes], [math.log(y) for y in ys])
    candidates = [Fit("power", math.exp(a), k, k, 0.0)]
    for model, xs in (("log", [math.log(n) for n in sizes]), ("linear", [float(n) for n in sizes])):
        a, b = _line(xs, ys)
        candidates.append(Fit(model, a, b, k, 0.0))
    scored = []
    for f in candidates:
        error = math.sqrt(sum(((f.at(n) - y) / y) ** 2 for n, y in zip(sizes, ys)) / len(ys))
        scored.append(Fit(f.model, f.a, f.b, k, error))
    return min(scored, key=lambda f: f.error)


COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf"]


def picture(path: Path, sizes: list[int], measured: dict[str, list[float]], fits: dict[str, Fit],
            target_sizes: list[int], title: str) -> None:
    """Each phase (and the total) against N on log-log axes: dots measured, lines their fitted growth
    drawn out to the largest of ``target_sizes`` (dashed beyond the measured sizes)."""
    width, height = 820, 520
    canvas = Canvas(width, height)
    canvas.text(20, 24, title, size=14, bold=True)
    everything = [max(FLOOR, v) for values in measured.values() for v in values]
    top = max(everything + [fits[p].at(max(target_sizes)) for p in fits])
    lo_y, hi_y = math.floor(math.log10(min(everything))), math.ceil(math.log10(top))
    lo_x, hi_x = math.log2(min(sizes + target_sizes)), math.log2(max(sizes + target_sizes))
    axes = Axes(canvas, 70, 50, 520, 400, (lo_x, hi_x), (lo_y, hi_y))
    axes.frame("nodes N (log scale)", "seconds (log scale)", [math.log2(n) for n in sorted(set(sizes + target_sizes))],
               list(range(lo_y, hi_y + 1)), x_format="{:.0f}", y_format="{:.0f}")
    # the frame's labels are exponents; say them plainly
    canvas.items = [item for item in canvas.items if not item.startswith("<text") or 'font-size="11"' not in item]
    for n in sorted(set(sizes + target_sizes)):
        canvas.text(axes.x(math.log2(n)), 50 + 400 + 16, f"{n:,}", size=11, anchor="middle")
    for e in range(lo_y, hi_y + 1):
        canvas.text(63, axes.y(e) + 4, f"{10.0 ** e:g}", size=11, anchor="end")
    last = max(sizes)
    for i, (phase, values) in enumerate(measured.items()):
        colour = COLOURS[i % len(COLOURS)]
        f = fits[phase]
        grid = [min(sizes) * 2 ** (j / 8) for j in range(int(8 * math.log2(max(target_sizes) / min(sizes))) + 1)]
        inside = [(axes.x(math.log2(n)), axes.y(math.log10(f.at(n)))) for n in grid if n <= last * 1.0001]
        beyond = [(axes.x(math.log2(n)), axes.y(math.log10(f.at(n)))) for n in grid if n >= last * 0.9999]
        canvas.polyline(inside, stroke=colour, width=2.5 if phase == "total" else 1.5)
        for (x1, y1), (x2, y2) in zip(beyond, beyond[1:]):
            canvas.line(x1, y1, x2, y2, stroke=colour, width=1.5, dash="4,3")
        for n, v in zip(sizes, values):
            canvas.rect(axes.x(math.log2(n)) - 3, axes.y(math.log10(max(FLOOR, v))) - 3, 6, 6, colour,
                        title=f"{phase} at N={n}: {v:.3f} s (measured)")
        canvas.rect(605, 58 + 20 * i, 12, 12, colour)
        canvas.text(623, 68 + 20 * i, f"{phase}: {f.growth}", size=12, bold=phase == "total")
    canvas.text(605, 58 + 20 * len(measured) + 16, "dots: measured; solid: fit;", size=11)
    canvas.text(605, 58 + 20 * len(measured) + 30, "dashed: modelled beyond", size=11)
    canvas.save(path, title)
