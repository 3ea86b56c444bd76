"""The power-instability factor (elasticft/health/instability.py): a GPU whose power swings
wider than its peers' over minutes triggers by itself, whatever the swing's phase; work the
whole node does together, a stray reading and a pause do not move it."""

import dataclasses
import math

import pytest

from elasticft.config import ConfigError, RiskConfig
from elasticft.health import GpuSample, RiskModel
from elasticft.health.instability import MAX_WINDOW_SAMPLES, MIN_WINDOW_SAMPLES, PowerWindow

T0 = 1_714_564_800.0
STEP = 10.0  # eft's default sample interval
WITHOUT_THE_FACTOR = RiskConfig(risk_weight_power_instability=0.0)


def gpu(index, t, power_w, utilization_pct=97.0, limit_w=700.0):
    """A GPU in training as a synchronous job's node sees it: only power and utilization vary."""
    return GpuSample(
        timestamp=T0 + t, node="n", gpu=index, temperature_c=65.0, memory_used_mib=60_000.0,
        memory_total_mib=81_559.0, power_w=power_w, power_limit_w=limit_w, utilization_pct=utilization_pct,
        ecc_corrected=0, ecc_uncorrected=0, rows_pending=False, throttle_reasons=0, sm_clock_mhz=1980.0,
    )


def noise(index, i):
    """A few watts of deterministic jitter, different per GPU: peers are never identical."""
    return 6.0 * math.sin(1.7 * i + 2.3 * index)


def node(model, minutes, swinging=None, common=lambda i: 600.0, limit_w=700.0, utilization=lambda g, i: 97.0):
    """Four GPUs sampled every STEP for ``minutes``; ``swinging(i)`` is GPU 0's offset in W.
    Returns every round's scores."""
    rounds = []
    for i in range(int(minutes * 60 / STEP)):
        samples = []
        for g in range(4):
            power = common(i) + noise(g, i) + (swinging(i) if swinging and g == 0 else 0.0)
            samples.append(gpu(g, i * STEP, max(0.0, power), utilization(g, i), limit_w))
        rounds.append(model.update(samples))
    return rounds


def square(amplitude, period_s):
    return lambda i: amplitude if (i * STEP) % period_s < period_s / 2 else -amplitude


def first_trigger_minute(rounds, index=0):
    return next((r[index].timestamp - T0) / 60 for r in rounds if r[index].triggered)


def test_a_swing_wider_than_the_peers_triggers_alone_while_the_five_sample_swing_flickers():
    """The issue's case: +-260 W around the peers' steady draw, a 2-minute period, nothing else
    wrong. The five-sample power factor rises and falls with the wave, so the sustain rule never
    counts it; the window's spread holds, and once held for 5 minutes it counts at weight 1."""
    rounds = node(RiskModel(), 20, swinging=lambda i: 260.0 * math.sin(2 * math.pi * i * STEP / 120.0))
    after_rise = [r[0] for r in rounds[int(6 * 60 / STEP):]]
    assert min(s.factors["power"] for s in after_rise) < 0.75 < max(s.factors["power"] for s in after_rise)
    assert min(s.factors["power_instability"] for s in after_rise) == 1.0
    assert first_trigger_minute(rounds) <= 11.0  # the window fills, then 5 minutes held
    trigger = next(r[0] for r in rounds if r[0].triggered)
    assert trigger.dominant == "power_instability" and trigger.contributions["power_instability"] == 1.0
    assert not any(s.triggered for r in rounds for s in r[1:])
    without = node(RiskModel(WITHOUT_THE_FACTOR), 20, swinging=lambda i: 260.0 * math.sin(2 * math.pi * i * STEP / 120.0))
    assert not any(r[0].triggered for r in without)  # the model before it misses the swing


@pytest.mark.parametrize("limit_w", [400.0, 700.0, 1000.0])
def test_the_factor_reads_the_swing_against_the_power_limit(limit_w):
    """The same swing relative to the part, on a 400, 700 or 1000 W part, is the same factor."""
    rounds = node(RiskModel(), 12, swinging=square(0.2 * limit_w, 60.0), common=lambda i: 0.85 * limit_w,
                  limit_w=limit_w)
    assert rounds[-1][0].factors["power_instability"] == 1.0
    assert all(s.factors["power_instability"] == 0.0 for s in rounds[-1][1:])


def test_the_whole_node_dropping_or_swinging_together_is_the_job():
    """A checkpoint phase every 3 minutes and a rack's power brake move every GPU at once."""
    phases = lambda i: 120.0 if (i * STEP) % 180 < 60 else 380.0 if (i * STEP) % 600 < 120 else 600.0  # noqa: E731
    rounds = node(RiskModel(), 40, common=phases)
    assert max(s.factors["power_instability"] for r in rounds for s in r) == 0.0
    rounds = node(RiskModel(), 40, common=lambda i: 600.0 + 250.0 * math.sin(i / 3.0))
    assert max(s.factors["power_instability"] for r in rounds for s in r) == 0.0
    assert not any(s.triggered for r in rounds for s in r)


def test_a_stray_reading_holds_no_weight():
    rounds = node(RiskModel(), 15, swinging=lambda i: -600.0 if i == 40 else 0.0)
    assert max(r[0].factors["power_instability"] for r in rounds) == 0.0


def test_a_job_wide_pause_neither_washes_the_swing_out_nor_restarts_its_clock():
    """The peers idle for 5 minutes (an evaluation or checkpoint pause, as long as the window) and
    the failing GPU with them: the window keeps what it saw and the sustain rule goes on counting."""
    idle = lambda i: 7 * 60 / STEP <= i < 12 * 60 / STEP  # noqa: E731
    rounds = node(
        RiskModel(), 15, swinging=lambda i: 0.0 if idle(i) else square(200.0, 60.0)(i),
        common=lambda i: 110.0 if idle(i) else 600.0, utilization=lambda g, i: 3.0 if idle(i) else 97.0,
    )
    factors = [r[0].factors["power_instability"] for r in rounds[MIN_WINDOW_SAMPLES:]]
    assert min(factors) == 1.0  # from the first full window on, through the pause
    assert first_trigger_minute(rounds) <= 11.0  # 5 minutes held, most of the pause among them


def test_a_gpu_keeps_a_bounded_window():
    window = PowerWindow(300.0)
    for i in range(2000):
        window.add(T0 + 10.0 * i, 0.0)
    assert len(window.points) == 300 / 10 + 1  # the last 300 s
    slow = PowerWindow(300.0)
    for i in range(2000):
        slow.add(T0 + 60.0 * i, 0.0)
    assert len(slow.points) == MIN_WINDOW_SAMPLES  # coarse sampling: enough samples to judge
    fast = PowerWindow(3600.0)
    for i in range(5000):
        fast.add(T0 + 0.5 * i, 0.0)
    assert len(fast.points) == MAX_WINDOW_SAMPLES


def test_a_window_too_short_to_judge_is_zero_and_a_lone_gpu_has_no_data():
    rounds = node(RiskModel(), (MIN_WINDOW_SAMPLES - 1) * STEP / 60, swinging=square(300.0, 40.0))
    assert rounds[-1][0].factors["power_instability"] == 0.0
    alone = RiskModel().update([gpu(0, 0, 600.0)])[0]
    assert alone.factors["power_instability"] is None


@pytest.mark.parametrize("value", [10.0, 7200.0])
def test_a_bad_power_window_names_its_flag(value):
    with pytest.raises(ConfigError, match="--eft-risk-power-window"):
        dataclasses.replace(RiskConfig(), risk_power_window=value)
