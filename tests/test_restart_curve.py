"""eft simulate's restart cost is the measured curve's at the job's size, not one constant."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from elasticft.goodput.restart_curve import RestartCurve, fit_growth
from elasticft.goodput.restart_measured import measured_curve
from launcher.cli import app

SIZES = (8, 32, 128, 512)


def test_the_fit_names_the_growth_the_figures_have():
    logarithmic = tuple(0.2 + 0.05 * math.log2(n) for n in SIZES)
    linear = tuple(0.1 + 0.001 * n for n in SIZES)
    flat = (0.3, 0.29, 0.31, 0.3)
    assert fit_growth(SIZES, logarithmic).growth == "log N"
    assert fit_growth(SIZES, linear).growth == "N"
    assert fit_growth(SIZES, flat).growth == "constant"
    assert fit_growth(SIZES, linear).at(4096) == pytest.approx(0.1 + 0.001 * 4096)


def test_measured_sizes_give_the_measured_figures_and_larger_ones_are_modelled():
    curve = RestartCurve(SIZES, {"rendezvous": tuple(0.2 + 0.05 * math.log2(n) for n in SIZES),
                                 "stop": (0.1, 0.1, 0.1, 0.1)}, source="test")
    assert curve.seconds(128) == pytest.approx(0.2 + 0.05 * 7 + 0.1)
    assert curve.seconds(64) == pytest.approx(0.2 + 0.05 * 6 + 0.1)  # log-N interpolation is exact for log N
    assert not curve.modelled(512) and curve.modelled(2048)
    assert curve.seconds(2048) == pytest.approx(0.2 + 0.05 * 11 + 0.1)
    assert "modelled past 512" in curve.describe(2048)
    assert curve.seconds(2) == curve.seconds(8)  # below the smallest measured size: its figure


@pytest.mark.parametrize("nodes, phases", [((8, 8), {"a": (1.0, 1.0)}), ((8, 32), {"a": (1.0,)}),
                                           ((8, 32), {"a": (1.0, float("nan"))})])
def test_a_malformed_curve_is_refused(nodes, phases):
    with pytest.raises(ValueError):
        RestartCurve(nodes, phases)


def test_the_shipped_curve_is_a_measured_one_that_does_not_shrink_with_the_job():
    curve = measured_curve()
    assert curve.nodes[0] <= 8 and curve.nodes[-1] >= 128 and curve.source
    assert "detection" not in curve.phases  # the lease's expiry is eft simulate's detection cost, apart
    assert curve.seconds(100_000 // 8) >= curve.seconds(16_384 // 8) >= curve.seconds(8) > 0


def _simulate(*args: str) -> dict:
    result = CliRunner().invoke(app, ["simulate", "--days", "3", "--policies", "proactive", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_eft_simulate_charges_each_size_the_curve_s_restart_unless_told_otherwise(tmp_path):
    curve = measured_curve()
    small, large = _simulate("--gpus", "1024"), _simulate("--gpus", "131072")
    assert small["costs"]["proactive"]["restart_seconds"] == pytest.approx(curve.seconds(128))
    assert large["costs"]["proactive"]["restart_seconds"] == pytest.approx(curve.seconds(16384))
    assert "modelled" in large["restart_curve"]
    given = _simulate("--gpus", "1024", "--restart-seconds", "42")
    assert given["costs"]["proactive"]["restart_seconds"] == 42 and given["restart_curve"] is None
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"restart_seconds": 7.5}))  # what eft report measured on the user's job
    assert _simulate("--gpus", "1024", "--costs", str(costs))["costs"]["proactive"]["restart_seconds"] == 7.5
