"""The SVG canvas shared by eft simulate and eft report."""

import pytest

from elasticft.goodput.svg import Axes, Canvas, SvgError, ticks


def test_canvas_writes_svg_and_html_and_escapes_text(tmp_path):
    canvas = Canvas(200, 100)
    axes = Axes(canvas, 20, 10, 160, 80, (0, 10), (0, 1))
    axes.frame("day", "share", ticks(0, 10), ticks(0, 1))
    canvas.rect(axes.x(2), axes.y(0.5), 10, axes.y(0) - axes.y(0.5), "#1f77b4", title="a<b")
    canvas.polyline([(axes.x(0), axes.y(0)), (axes.x(10), axes.y(1))])
    canvas.text(5, 5, "R&D <1>")
    canvas.save(tmp_path / "p.svg")
    canvas.save(tmp_path / "p.html", title="t")
    svg = (tmp_path / "p.svg").read_text()
    assert svg.startswith("<svg") and "R&amp;D &lt;1&gt;" in svg and "a&lt;b" in svg
    assert (tmp_path / "p.html").read_text().startswith("<!doctype html>")
    assert axes.y(0) == 90 and axes.x(10) == 180


@pytest.mark.parametrize("name", ["p.png", "p.pdf", "p"])
def test_other_suffixes_are_refused_in_one_line(tmp_path, name):
    with pytest.raises(SvgError, match="svg or .html"):
        Canvas(10, 10).save(tmp_path / name)


def test_ticks_are_round():
    assert ticks(0, 1) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert ticks(0, 54, 6) == [0, 10, 20, 30, 40, 50]
