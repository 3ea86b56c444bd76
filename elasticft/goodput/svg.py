"""A small SVG canvas for eft's pictures (no plotting library needed).

Coordinates are pixels from the top left. ``save`` writes ``.svg``, or ``.html`` with the
SVG inline; ``.png`` only when matplotlib is importable (it is not a dependency).
"""

from __future__ import annotations

import math
from html import escape
from pathlib import Path

# Distinct colours readable on white, in order of use.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


class SvgError(ValueError):
    """A picture that cannot be written (an unknown suffix, PNG without matplotlib)."""


class Canvas:
    def __init__(self, width: int, height: int, background: str = "white"):
        self.width, self.height = width, height
        self.items: list[str] = [f'<rect x="0" y="0" width="{width}" height="{height}" fill="{background}"/>']

    def rect(self, x: float, y: float, width: float, height: float, fill: str, title: str = "",
             stroke: str = "none") -> None:
        tip = f"<title>{escape(title)}</title>" if title else ""
        self.items.append(f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(width, 0):.2f}" '
                          f'height="{max(height, 0):.2f}" fill="{fill}" stroke="{stroke}">{tip}</rect>')

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = "black", width: float = 1,
             dash: str = "") -> None:
        dashed = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<line x1="{x1:.2f}" y1="{y1:.2f}" x2="{x2:.2f}" y2="{y2:.2f}" '
                          f'stroke="{stroke}" stroke-width="{width}"{dashed}/>')

    def polyline(self, points: list[tuple[float, float]], stroke: str = "black", width: float = 1.5) -> None:
        if points:
            path = " ".join(f"{x:.2f},{y:.2f}" for x, y in points)
            self.items.append(f'<polyline points="{path}" fill="none" stroke="{stroke}" stroke-width="{width}"/>')

    def text(self, x: float, y: float, content: str, size: int = 12, anchor: str = "start",
             fill: str = "black", bold: bool = False) -> None:
        weight = ' font-weight="bold"' if bold else ""
        self.items.append(f'<text x="{x:.2f}" y="{y:.2f}" font-family="sans-serif" font-size="{size}" '
                          f'text-anchor="{anchor}" fill="{fill}"{weight}>{escape(content)}</text>')

    def svg(self) -> str:
        body = "\n".join(self.items)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" '
                f'viewBox="0 0 {self.width} {self.height}">\n{body}\n</svg>\n')

    def save(self, path: Path, title: str = "") -> None:
        """Write ``path`` by its suffix: .svg, .html (the SVG inline) or .png (matplotlib)."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".svg":
            path.write_text(self.svg())
        elif suffix in (".html", ".htm"):
            path.write_text(f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{escape(title)}"
                            f"</title></head><body>\n{self.svg()}</body></html>\n")
        elif suffix == ".png":
            raise SvgError(f"{path}: PNG needs matplotlib, which eft does not depend on; "
                           "write .svg or .html")
        else:
            raise SvgError(f"{path}: unknown picture type {suffix or '(none)'}; use .svg or .html")


class Axes:
    """A plotting area on a canvas mapping data (x, y) to pixels, with ticks and labels."""

    def __init__(self, canvas: Canvas, left: float, top: float, width: float, height: float,
                 x_range: tuple[float, float], y_range: tuple[float, float]):
        self.canvas, self.left, self.top, self.width, self.height = canvas, left, top, width, height
        self.x0, self.x1 = x_range
        self.y0, self.y1 = y_range

    def x(self, value: float) -> float:
        span = (self.x1 - self.x0) or 1.0
        return self.left + (value - self.x0) / span * self.width

    def y(self, value: float) -> float:
        span = (self.y1 - self.y0) or 1.0
        return self.top + self.height - (value - self.y0) / span * self.height

    def frame(self, x_label: str = "", y_label: str = "", x_ticks: list[float] = (),
              y_ticks: list[float] = (), x_format: str = "{:g}", y_format: str = "{:g}") -> None:
        c, bottom = self.canvas, self.top + self.height
        c.line(self.left, bottom, self.left + self.width, bottom)
        c.line(self.left, self.top, self.left, bottom)
        for tick in x_ticks:
            c.line(self.x(tick), bottom, self.x(tick), bottom + 4)
            c.text(self.x(tick), bottom + 16, x_format.format(tick), size=11, anchor="middle")
        for tick in y_ticks:
            c.line(self.left - 4, self.y(tick), self.left, self.y(tick))
            c.line(self.left, self.y(tick), self.left + self.width, self.y(tick), stroke="#dddddd")
            c.text(self.left - 7, self.y(tick) + 4, y_format.format(tick), size=11, anchor="end")
        if x_label:
            c.text(self.left + self.width / 2, bottom + 34, x_label, anchor="middle")
        if y_label:
            c.text(self.left, self.top - 8, y_label, anchor="start")


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = min((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw), default=raw)
    start = -(-low // step) * step
    return [round(start + i * step, 10) for i in range(int((high - start) / step + 1e-9) + 1)]
