"""Properties of the risk model (elasticft/health/risk.py) and its config."""

import argparse
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticft.config import (
    ConfigError,
    HealthConfig,
    RiskConfig,
    add_arguments,
    from_args,
    from_env,
)
from elasticft.health import FACTORS, GpuSample, RiskModel
from elasticft.health.trend import temperature_slope

T0 = 1_714_564_800.0


def busy(gpu, t, node="n", **fields):
    """A healthy GPU in training: the fields a typical H100 reports."""
    values = dict(
        temperature_c=65.0, memory_used_mib=60_000.0, memory_total_mib=81_559.0, power_w=600.0,
        power_limit_w=700.0, utilization_pct=97.0, ecc_corrected=0, ecc_uncorrected=0,
        rows_pending=False, throttle_reasons=0,
    )
    values.update(fields)
    return GpuSample(timestamp=T0 + t, node=node, gpu=gpu, **values)


def run(model, rounds):
    """Feed rounds (lists of samples); return the scores of the last round."""
    scores = []
    for round_ in rounds:
        scores = model.update(round_)
    return scores


def steady(model, gpus=4, count=20, step=10.0, **fields):
    return run(model, [[busy(g, i * step, **fields) for g in range(gpus)] for i in range(count)])


def test_healthy_steady_gpus_score_near_zero():
    scores = steady(RiskModel())
    assert all(s.score < 0.05 and not s.triggered for s in scores)
    assert all(set(s.factors) == set(FACTORS) for s in scores)


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"ecc_uncorrected": 1}, "uncorrected ECC error (+1)"),
        ({"rows_pending": True}, "row remap pending"),
        ({"xids": (79,)}, "Xid 79"),
        ({"xids": (13, 48)}, "Xid 48"),
    ],
)
def test_a_critical_event_alone_sets_the_score_to_one(fields, reason):
    model = RiskModel()
    steady(model)
    scores = model.update([busy(0, 300, **fields), busy(1, 300)])
    assert scores[0].score == 1.0 and scores[0].triggered and scores[0].crossed
    assert scores[0].critical == reason and scores[0].dominant == "errors"
    assert not scores[1].triggered


def test_non_critical_xid_and_old_uncorrected_errors_are_not_critical():
    model = RiskModel()
    first = model.update([busy(0, 0, ecc_uncorrected=3)])[0]  # from before we started watching
    later = model.update([busy(0, 10, ecc_uncorrected=3, xids=(13, 31))])[0]
    assert first.critical is None and later.critical is None and not later.triggered


def test_trigger_fires_once_per_crossing():
    model = RiskModel()
    steady(model, gpus=1)
    pending = [model.update([busy(0, 300 + i, rows_pending=True)])[0] for i in range(5)]
    assert [s.crossed for s in pending] == [True, False, False, False, False]
    assert all(s.triggered for s in pending)
    cleared = model.update([busy(0, 400)])[0]
    again = model.update([busy(0, 410, xids=(94,))])[0]
    assert not cleared.triggered and again.crossed


def test_a_score_hovering_at_the_threshold_is_one_crossing():
    only_temperature = {f"risk_weight_{k}": 0.0 for k in FACTORS if k != "temperature"}
    model = RiskModel(RiskConfig(**only_temperature))  # score = temperature factor
    temps = [70, 85, 84, 85, 83, 86, 70, 85]  # 85 C scores 1.0; 83-84 C 0.87-0.93
    scores = [model.update([busy(0, 10 * i, temperature_c=t)])[0] for i, t in enumerate(temps)]
    assert [s.triggered for s in scores] == [False, True, False, True, False, True, False, True]
    assert [s.crossed for s in scores] == [False, True, False, False, False, False, False, True]


def test_factor_without_data_gives_its_weight_to_the_others():
    """A GPU without ECC or throttle reasons is scored on what it does report."""
    config = RiskConfig()
    weights = config.weights()
    model = RiskModel(config)
    hot = dict(temperature_c=80.0, memory_used_mib=80_000.0)
    with_ecc = run(model, [[busy(0, i * 10, **hot), busy(1, i * 10)] for i in range(20)])[0]
    no_ecc = dict(hot, ecc_corrected=None, ecc_uncorrected=None, throttle_reasons=None)
    model = RiskModel(config)
    without = run(model, [[busy(0, i * 10, **no_ecc), busy(1, i * 10)] for i in range(20)])[0]
    assert with_ecc.factors["errors"] == 0.0 and without.factors["errors"] is None
    present = {k: v for k, v in without.factors.items() if v is not None}
    expected = sum(weights[k] * v for k, v in present.items()) / sum(weights[k] for k in present)
    assert without.score == pytest.approx(expected)
    assert without.score == pytest.approx(with_ecc.score / (1 - weights["errors"]))


def test_missing_everything_is_no_risk_and_no_crash():
    model = RiskModel()
    steady(model, gpus=2)
    empty = GpuSample(T0 + 500, "n", 0)
    scores = model.update([empty, busy(1, 500)])
    assert scores[0].score == 0.0 and all(v is None for v in scores[0].factors.values())
    assert scores[0].dominant is None and not scores[0].triggered


def test_first_samples_cannot_trigger_on_few_factors():
    """History factors start at 0, not 'no data': a hot GPU's first sample is not 0.95."""
    model = RiskModel()
    first = model.update([busy(0, 0, temperature_c=99.0, memory_used_mib=81_500.0)])[0]
    assert first.factors["temperature"] == 1.0 and first.factors["power"] == 0.0
    assert not first.triggered


def test_hot_gpu_is_judged_against_its_own_baseline():
    model = RiskModel()
    rounds = [[busy(g, i * 30, temperature_c=74.0 if g == 3 else 64.0) for g in range(4)] for i in range(40)]
    scores = run(model, rounds)
    assert scores[3].factors["temperature"] == pytest.approx((74 - 70) / 15)  # absolute part only
    jump = model.update([busy(g, 1300, temperature_c=64.0 + (12 if g == 0 else 0)) for g in range(4)])
    assert jump[0].factors["temperature"] == 1.0  # 12 C over its own flat baseline
    assert jump[1].factors["temperature"] == 0.0


def test_utilization_drop_counts_only_while_peers_are_busy():
    model = RiskModel()
    idle_one = [[busy(g, i * 10, utilization_pct=5.0 if g == 0 else 97.0) for g in range(4)] for i in range(6)]
    assert run(model, idle_one)[0].factors["utilization_drop"] == 1.0
    model = RiskModel()
    all_idle = [[busy(g, i * 10, utilization_pct=5.0) for g in range(4)] for i in range(6)]
    assert run(model, all_idle)[0].factors["utilization_drop"] == 0.0
    alone = RiskModel().update([busy(0, 0, utilization_pct=5.0)])[0]
    assert alone.factors["utilization_drop"] is None  # no peers: nothing to compare with


def test_power_swing_shared_by_every_gpu_is_the_workload_not_a_fault():
    model = RiskModel()
    watts = [600, 150, 620, 140, 610, 160]
    together = run(model, [[busy(g, i * 10, power_w=w) for g in range(4)] for i, w in enumerate(watts)])
    assert all(s.factors["power"] == 0.0 for s in together)
    model = RiskModel()
    alone = run(model, [[busy(g, i * 10, power_w=w if g == 2 else 600) for g in range(4)] for i, w in enumerate(watts)])
    assert alone[2].factors["power"] == 1.0 and alone[0].factors["power"] == 0.0


def test_temperature_rise_rate_relative_to_peers():
    model = RiskModel()
    rounds = [[busy(g, i * 30, temperature_c=60.0 + (1.5 * i if g == 1 else 0)) for g in range(4)] for i in range(8)]
    scores = run(model, rounds)
    assert scores[1].factors["temp_rise"] == 1.0  # 3 C/minute while the others stay flat
    assert scores[0].factors["temp_rise"] == 0.0


def test_temperature_slope_is_c_per_minute_at_epoch_timestamps():
    """The one slope the risk model and eft top share: exact at real clock values, None without a span."""
    assert temperature_slope([(T0, 60.0), (T0 + 30, 61.0), (T0 + 60, 62.0)]) == pytest.approx(2.0, abs=1e-9)
    assert temperature_slope([(T0, 70.0), (T0 + 120, 64.0)]) == pytest.approx(-3.0, abs=1e-9)
    assert temperature_slope([(T0, 60.0)]) is None and temperature_slope([]) is None
    assert temperature_slope([(T0, 60.0), (T0, 65.0)]) is None


def test_corrected_ecc_rate_raises_the_errors_factor():
    model = RiskModel()
    rounds = [[busy(0, i * 60, ecc_corrected=20 * i), busy(1, i * 60)] for i in range(30)]
    scores = run(model, rounds)
    assert scores[0].factors["errors"] == pytest.approx(1.0)  # 1200 per hour
    assert scores[1].factors["errors"] == 0.0
    reset = model.update([busy(0, 1900, ecc_corrected=0)])[0]  # driver reload: counters restart
    assert reset.factors["errors"] == 0.0


def test_every_factor_at_once_reaches_the_threshold():
    """Only a combination of factors can trigger without a critical event."""
    model = RiskModel()
    steady(model, gpus=4, count=30, step=30.0)
    scores = []
    for i in range(6):
        t = 900 + 30 * i
        bad = busy(0, t, temperature_c=86.0 + 2 * i, memory_used_mib=81_000.0, throttle_reasons=0x48,
                   power_w=150.0 if i % 2 else 700.0, utilization_pct=30.0)
        scores = model.update([bad] + [busy(g, t) for g in range(1, 4)])
    assert scores[0].triggered and scores[0].critical is None
    telemetry = {k: v for k, v in scores[0].factors.items() if k != "straggler"}
    assert all(v == pytest.approx(1.0, abs=0.1) for v in telemetry.values())
    assert scores[0].factors["straggler"] is None  # no straggler monitor: no data


reading = st.one_of(st.none(), st.floats(min_value=0, max_value=1000, allow_nan=False))


@st.composite
def sample_streams(draw):
    rounds = []
    corrected = [0] * 3
    for i in range(draw(st.integers(1, 12))):
        round_ = []
        for gpu in range(draw(st.integers(1, 3))):
            corrected[gpu] += draw(st.integers(0, 5))
            round_.append(GpuSample(
                timestamp=T0 + 10 * i,
                node="n", gpu=gpu,
                temperature_c=draw(reading), memory_used_mib=draw(reading),
                memory_total_mib=draw(st.one_of(st.none(), st.just(0.0), st.just(1000.0))),
                power_w=draw(reading), power_limit_w=draw(st.one_of(st.none(), st.just(0.0), st.just(700.0))),
                utilization_pct=draw(st.one_of(st.none(), st.floats(0, 100))),
                ecc_corrected=draw(st.one_of(st.none(), st.just(corrected[gpu]))),
                ecc_uncorrected=draw(st.one_of(st.none(), st.integers(0, 2))),
                rows_pending=draw(st.one_of(st.none(), st.booleans())),
                throttle_reasons=draw(st.one_of(st.none(), st.integers(0, 0xFF))),
                xids=tuple(draw(st.lists(st.sampled_from([13, 31, 48, 79]), max_size=2))),
            ))
        rounds.append(round_)
    return rounds


@settings(max_examples=30, deadline=None)
@given(sample_streams())
def test_scores_are_bounded_deterministic_and_one_per_sample(rounds):
    a, b = RiskModel(), RiskModel()
    for round_ in rounds:
        first, second = a.update(round_), b.update(round_)
        assert first == second
        assert len(first) == len(round_)
        for sample, score in zip(round_, first):
            assert (score.node, score.gpu, score.timestamp) == (sample.node, sample.gpu, sample.timestamp)
            assert 0.0 <= score.score <= 1.0
            assert all(v is None or 0.0 <= v <= 1.0 for v in score.factors.values())
            assert score.triggered == (score.score >= 0.95)


def test_config_knobs_have_flags_env_and_defaults(monkeypatch):
    monkeypatch.setenv("EFT_RISK_WINDOW", "30")
    monkeypatch.setenv("EFT_HEALTH_SOURCE", "none")
    parser = argparse.ArgumentParser()
    add_arguments(parser, RiskConfig, "risk")
    add_arguments(parser, HealthConfig, "health")
    args = parser.parse_args(["--eft-risk-threshold", "0.9", "--eft-health-interval", "2"])
    risk, health = from_args(RiskConfig, args), from_args(HealthConfig, args)
    assert (risk.risk_window, risk.risk_threshold, risk.risk_weight_errors) == (30, 0.9, 0.25)
    assert (health.health_interval, health.health_source) == (2.0, "none")
    # The telemetry weights add up to 1; the straggler factor weighs in only for a scored rank.
    weights = RiskConfig().weights()
    assert sum(w for k, w in weights.items() if k != "straggler") == pytest.approx(1.0)
    assert weights["straggler"] == 0.15
    assert from_env(RiskConfig).risk_window == 30
    assert "--eft-risk-weight-temp-rise" in parser.format_help()


@pytest.mark.parametrize(
    "cls, field, value, flag",
    [
        (RiskConfig, "risk_threshold", 1.5, "--eft-risk-threshold"),
        (RiskConfig, "risk_window", 3, "--eft-risk-window"),
        (RiskConfig, "risk_weight_power", -0.1, "--eft-risk-weight-power"),
        (HealthConfig, "health_interval", 0.1, "--eft-health-interval"),
    ],
)
def test_bad_config_names_its_flag(cls, field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        dataclasses.replace(cls(), **{field: value})
