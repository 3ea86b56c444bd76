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
        rows_pending=False, throttle_reasons=0, sm_clock_mhz=1980.0,
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


def test_a_node_suspect_of_bad_numbers_has_every_gpu_at_risk_one_once():
    model = RiskModel()
    steady(model, gpus=2)
    model.set_suspect("n", "numeric faults (node_suspect)")
    first = model.update([busy(0, 300), busy(1, 300), busy(0, 300, node="other")])
    assert [s.score for s in first] == [1.0, 1.0, pytest.approx(0.0, abs=0.05)]
    assert first[0].critical == "numeric faults (node_suspect)" and first[0].crossed
    assert not model.update([busy(0, 310), busy(1, 310)])[0].crossed  # one request, not one per sample


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
    # slowdown 85 C, shutdown 90 C (the defaults): 89 C scores 0.86, 88 C 0.72, 90 C 1.0
    temps = [70, 89, 88, 89, 88, 90, 70, 89]
    scores = [model.update([busy(0, 10 * i, temperature_c=t)])[0] for i, t in enumerate(temps)]
    assert [s.triggered for s in scores] == [False, True, False, True, False, True, False, True]
    assert [s.crossed for s in scores] == [False, True, False, False, False, False, False, True]


def test_a_factor_without_data_neither_dilutes_nor_adds():
    """A GPU without ECC or throttle reasons is scored on what it does report, and the
    same symptoms score the same with or without the extra (quiet) counters."""
    weights = RiskConfig().weights()
    hot = dict(temperature_c=87.0, memory_used_mib=81_300.0)
    with_ecc = run(RiskModel(), [[busy(0, i * 10, **hot), busy(1, i * 10)] for i in range(20)])[0]
    no_ecc = dict(hot, ecc_corrected=None, ecc_uncorrected=None, throttle_reasons=None)
    without = run(RiskModel(), [[busy(0, i * 10, **no_ecc), busy(1, i * 10)] for i in range(20)])[0]
    assert with_ecc.factors["errors"] == 0.0 and without.factors["errors"] is None
    assert without.score == pytest.approx(with_ecc.score)
    expected = 1.0
    for k, v in without.factors.items():
        expected *= 1 - weights[k] * (v or 0.0)
    assert without.score == pytest.approx(1 - expected)
    assert without.contributions == pytest.approx({k: weights[k] * v for k, v in without.factors.items() if v})


def test_missing_everything_is_no_risk_and_no_crash():
    model = RiskModel()
    steady(model, gpus=2)
    empty = GpuSample(T0 + 500, "n", 0)
    scores = model.update([empty, busy(1, 500)])
    assert scores[0].score == 0.0 and all(v is None for v in scores[0].factors.values())
    assert scores[0].dominant is None and not scores[0].triggered


def test_first_samples_are_judged_on_physics_alone():
    """History factors start at 0, not "no data"; the distance to the GPU's limits needs no history."""
    model = RiskModel()
    warm = model.update([busy(0, 0, temperature_c=84.0, memory_used_mib=79_000.0, throttle_reasons=0x48)])[0]
    assert warm.factors["power"] == 0.0 and warm.factors["time_to_limit"] == 0.0
    assert warm.factors["errors"] == pytest.approx(0.2)  # one sample in HW slowdown of five
    assert not warm.triggered
    model = RiskModel()
    at_shutdown = model.update([busy(0, 0, temperature_c=91.0)])[0]
    assert at_shutdown.factors["temperature"] == 1.0 and at_shutdown.triggered
    assert at_shutdown.dominant == "temperature"


def test_the_gpus_own_limits_replace_the_default():
    own = busy(0, 0, temperature_c=88.0, temp_slowdown_c=92.0, temp_shutdown_c=100.0)
    default = busy(0, 0, temperature_c=88.0)  # slowdown 85 C, shutdown 90 C
    assert RiskModel().update([own])[0].factors["temperature"] == pytest.approx(0.3 * 0.6)
    assert RiskModel().update([default])[0].factors["temperature"] == pytest.approx(0.3 + 0.7 * 3 / 5)


def test_hot_gpu_is_judged_against_its_own_offset_from_its_peers():
    model = RiskModel()
    rounds = [[busy(g, i * 30, temperature_c=74.0 if g == 3 else 64.0) for g in range(4)] for i in range(40)]
    scores = run(model, rounds)
    assert scores[3].factors["peer_temp"] == 0.0  # always 10 C above the others: its normal
    jump = model.update([busy(g, 1200, temperature_c=64.0 + (10 if g == 0 else 0) + (10 if g == 3 else 0))
                         for g in range(4)])
    assert jump[0].factors["peer_temp"] == 1.0  # 10 C above its peers, usually level with them
    assert jump[3].factors["peer_temp"] == 0.0 and jump[1].factors["peer_temp"] == 0.0
    assert not jump[0].triggered  # a peer difference alone is a weak symptom


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


def test_time_to_shutdown_at_the_current_rate_triggers_alone():
    """GPU 1 heats 3 C a minute beyond its peers: at 70.5 C it is 6.5 minutes from its
    90 C shutdown, less than a checkpoint (2 min) plus the 5-minute margin."""
    model = RiskModel()
    rounds = [[busy(g, i * 30, temperature_c=60.0 + (1.5 * i if g == 1 else 0)) for g in range(4)] for i in range(8)]
    scores = run(model, rounds)
    assert scores[1].factors["time_to_limit"] == 1.0 and scores[1].triggered
    assert scores[1].factors["temperature"] == 0.0  # still far below its slowdown temperature
    assert scores[0].factors["time_to_limit"] == 0.0
    # The same climb on every GPU (warming up after a pause) is the workload.
    model = RiskModel()
    together = run(model, [[busy(g, i * 30, temperature_c=60.0 + 1.5 * i) for g in range(4)] for i in range(8)])
    assert all(s.factors["time_to_limit"] == 0.0 and not s.triggered for s in together)
    # A slower checkpoint wants more warning: with 20 minutes to save, a 10-minute ETA is late already.
    slow = RiskModel(RiskConfig(risk_checkpoint_time=1200.0))
    rounds = [[busy(g, i * 60, temperature_c=70.0 + (1.0 * i if g == 1 else 0)) for g in range(4)] for i in range(6)]
    assert run(slow, rounds)[1].triggered and not run(RiskModel(), rounds)[1].triggered


def test_memory_running_out_at_the_current_rate():
    model = RiskModel()
    leak = [[busy(g, i * 60, memory_used_mib=76_000.0 + (500.0 * i if g == 2 else 0)) for g in range(4)]
            for i in range(8)]
    scores = run(model, leak)  # 79,500 MiB used, 500 MiB a minute: full in ~4 minutes
    assert scores[2].factors["time_to_limit"] == 1.0 and scores[2].triggered
    assert scores[0].factors["time_to_limit"] == 0.0


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


def test_one_strong_symptom_triggers_alone_and_weak_ones_add_up():
    def episode(**bad):
        model = RiskModel()
        steady(model, gpus=4, count=30, step=30.0)
        scores = []
        for i in range(6):
            t = 900 + 30 * i
            fields = {k: v(i) if callable(v) else v for k, v in bad.items()}
            scores = model.update([busy(0, t, **fields)] + [busy(g, t) for g in range(1, 4)])
        return scores[0]

    hw = episode(throttle_reasons=0x48)  # HW thermal slowdown while the peers run free
    assert hw.triggered and hw.dominant == "errors" and hw.critical is None
    swing = episode(power_w=lambda i: 150.0 if i % 2 else 700.0)
    assert swing.factors["power"] == 1.0 and not swing.triggered  # weak alone
    together = episode(power_w=lambda i: 150.0 if i % 2 else 700.0, utilization_pct=30.0, sm_clock_mhz=1200.0)
    assert together.triggered and together.critical is None
    assert set(together.contributions) >= {"power", "utilization_drop", "clocks"}


def test_a_strong_symptom_held_for_minutes_counts_alone_and_a_short_one_does_not():
    """A failing power delivery: power swinging and the GPU stalling beside busy peers. The
    pair's weights (0.5 each) cap it at 0.75, under the threshold however long it lasts;
    held for --eft-risk-sustain-seconds each counts at weight 1 and the GPU triggers."""
    def episode(seconds: float, sustain: float = 300.0):
        model = RiskModel(RiskConfig(risk_sustain_seconds=sustain))
        steady(model, gpus=4, count=30, step=30.0)
        scores = []
        for i in range(int(seconds // 30) + 1):
            t = 900 + 30 * i
            failing = busy(0, t, power_w=150.0 if i % 2 else 700.0, utilization_pct=55.0)
            scores = model.update([failing] + [busy(g, t) for g in range(1, 4)])
        return scores

    short = episode(240)[0]
    assert short.factors["power"] == short.factors["utilization_drop"] == 1.0 and not short.triggered
    held, *peers = episode(330)
    assert held.triggered and held.critical is None and held.contributions["power"] == 1.0
    assert not any(p.triggered for p in peers)
    never = episode(1800, sustain=0)[0]  # the rule off: the old cap, for half an hour
    assert not never.triggered and never.score == pytest.approx(0.75)


def test_a_job_wide_throttle_is_the_rack_not_a_gpu():
    model = RiskModel()
    steady(model, gpus=4, count=30, step=30.0)
    for i in range(10):
        scores = model.update([busy(g, 900 + 30 * i, throttle_reasons=0x88, sm_clock_mhz=1100.0, power_w=380.0)
                               for g in range(4)])
    assert all(s.factors["errors"] == 0.0 and s.factors["clocks"] == 0.0 and not s.triggered for s in scores)


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
            assert score.triggered == (score.score >= RiskConfig().risk_threshold)


def test_config_knobs_have_flags_env_and_defaults(monkeypatch):
    monkeypatch.setenv("EFT_RISK_WINDOW", "30")
    monkeypatch.setenv("EFT_HEALTH_SOURCE", "none")
    parser = argparse.ArgumentParser()
    add_arguments(parser, RiskConfig, "risk")
    add_arguments(parser, HealthConfig, "health")
    args = parser.parse_args(["--eft-risk-threshold", "0.9", "--eft-health-interval", "2"])
    risk, health = from_args(RiskConfig, args), from_args(HealthConfig, args)
    assert (risk.risk_window, risk.risk_threshold, risk.risk_weight_errors) == (30, 0.9, 0.9)
    assert (health.health_interval, health.health_source) == (2.0, "none")
    # A weight is what the factor alone gives at full strength: one per factor, in [0, 1].
    weights = RiskConfig().weights()
    assert set(weights) == set(FACTORS) and all(0 <= w <= 1 for w in weights.values())
    assert from_env(RiskConfig).risk_window == 30
    assert "--eft-risk-checkpoint-time" in parser.format_help()
    assert "--eft-risk-weight-time-to-limit" in parser.format_help()


@pytest.mark.parametrize(
    "cls, field, value, flag",
    [
        (RiskConfig, "risk_threshold", 1.5, "--eft-risk-threshold"),
        (RiskConfig, "risk_window", 3, "--eft-risk-window"),
        (RiskConfig, "risk_weight_power", -0.1, "--eft-risk-weight-power"),
        (RiskConfig, "risk_weight_clocks", 1.5, "--eft-risk-weight-clocks"),
        (RiskConfig, "risk_checkpoint_time", -1.0, "--eft-risk-checkpoint-time"),
        (HealthConfig, "health_interval", 0.1, "--eft-health-interval"),
    ],
)
def test_bad_config_names_its_flag(cls, field, value, flag):
    with pytest.raises(ConfigError, match=flag):
        dataclasses.replace(cls(), **{field: value})
