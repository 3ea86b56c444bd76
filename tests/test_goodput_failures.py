"""Failure models: Llama 3's rate and causes, Titan's lifetimes, predictions."""

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from elasticft.goodput.failures import (DAY, LLAMA3_CAUSES, LLAMA3_GPU_MTBF_HOURS, Prediction, TitanLifetimes,
                                        default_titan_csv, draw_trace)
from launcher.cli import app

TITAN = default_titan_csv(Path(__file__).resolve().parent.parent)
needs_titan = pytest.mark.skipif(not TITAN.exists(), reason=f"Titan data not at {TITAN} (../shared/data/titan)")


def test_llama3_table_is_419_failures():
    assert sum(LLAMA3_CAUSES.values()) == 419 and LLAMA3_CAUSES["faulty GPU"] == 148
    assert LLAMA3_GPU_MTBF_HOURS == pytest.approx(54 * 24 * 16384 / 419)


def test_llama3_rate_over_many_seeds_is_419_per_54_days_on_16k():
    counts = [len(draw_trace(16384, 8, 54 * DAY, np.random.default_rng(seed)).times) for seed in range(40)]
    assert np.mean(counts) == pytest.approx(419, rel=0.03)


def test_predictions_and_false_alarms():
    trace = draw_trace(16384, 8, 54 * DAY, np.random.default_rng(3), Prediction(0.5, 600, 1e-3))
    caught = ~np.isnan(trace.leads)
    assert caught.mean() == pytest.approx(0.5, abs=0.08)
    assert np.mean(trace.leads[caught]) == pytest.approx(600, rel=0.2)
    assert len(trace.alarms) == pytest.approx(1e-3 * 16384 * 54, rel=0.1)
    assert trace.nodes.max() < 2048


def test_negative_rates_are_refused():
    with pytest.raises(ValueError):
        Prediction(false_alarms_per_gpu_day=-1)
    with pytest.raises(ValueError):
        draw_trace(8, 8, DAY, np.random.default_rng(0), gpu_mtbf_hours=-5)


@needs_titan
def test_titan_kaplan_meier_and_failure_rate():
    titan = TitanLifetimes.from_csv(TITAN)
    assert len(titan.death_days) == 5089  # rows with dead == TRUE
    assert np.all(np.diff(titan.cdf) >= 0) and 0.2 < titan.cdf[-1] < 0.6
    times, nodes = titan.failures(16384, 8, 54 * DAY, np.random.default_rng(0))
    # Titan's deaths per GPU-day (5,089 over 36.8 M) give ~120 in 54 days on 16,384 GPUs;
    # ages spread over the whole service life weigh the later, deadlier years more.
    assert 80 < len(times) < 400 and np.all(np.diff(times) >= 0) and nodes.max() < 2048


@needs_titan
def test_cli_titan_and_a_missing_titan_file(tmp_path):
    result = CliRunner().invoke(app, ["simulate", "--failure-model", "titan", "--gpus", "16384", "--days", "5"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["simulate", "--failure-model", "titan", "--titan", str(tmp_path / "no.csv")])
    assert result.exit_code == 2 and result.stderr.startswith("eft simulate: --titan:")


def test_cli_titan_not_a_titan_table(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    result = CliRunner().invoke(app, ["simulate", "--failure-model", "titan", "--titan", str(other)])
    assert result.exit_code == 2 and "not the Titan table" in result.stderr
