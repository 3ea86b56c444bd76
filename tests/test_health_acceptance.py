"""Issue #18's acceptance, measured as ``eft health eval`` measures it (elasticft/health/evaluate.py):
at the default threshold every gradual failure of the corpus is caught at least five
minutes ahead, the sudden fall-off is not, and healthy GPUs — the always-hot one, the
checkpoint pauses, a job-wide throttle, days of a fleet — do not trigger. Issue #45's
(part 2): a GPU whose power swings wider than its peers', in any shape, period, amplitude
from +-150 W and power limit, is caught five minutes before it falls off the bus."""

import sys
from pathlib import Path

import pytest

from elasticft.config import RiskConfig
from elasticft.health import RiskModel, read_trace, summarize
from elasticft.health.evaluate import DAY_S, evaluate, score_trace
from elasticft.health.labels import read_labels

DATA = Path(__file__).parent / "data"
sys.path.insert(0, str(DATA))  # make_fleet imports make_traces by its bare name, as when run as a script
from make_fleet import healthy_fleet
from make_more_traces import PowerSwing
from make_traces import Node

GRADUAL = {"thermal_runaway", "power_oscillation", "ecc_fall_off_bus", "falling_clocks", "memory_leak_oom",
           "steady_overheat", "power_delivery", "power_instability"}
MIN_LEAD_S = 300.0


def corpus_result():
    threshold = RiskConfig().risk_threshold
    traces = [score_trace(p.stem, read_trace(p), RiskModel(), read_labels(p)) for p in sorted(DATA.glob("*.csv"))]
    return evaluate(traces, [threshold])[0]


def test_every_gradual_failure_is_caught_five_minutes_ahead_and_the_sudden_one_is_not():
    result = corpus_result()
    outcomes = {o.mode: o for o in result.outcomes}
    assert GRADUAL <= set(outcomes)
    late = {mode: outcomes[mode].lead_s for mode in GRADUAL if (outcomes[mode].lead_s or 0) < MIN_LEAD_S}
    assert late == {}, late
    assert outcomes["sudden_fall_off"].first_trigger is None
    assert outcomes["ecc_nvidia_smi"].first_trigger is not None  # the uncorrectable error, 3 minutes ahead


def test_no_healthy_gpu_of_the_corpus_triggers():
    """The hot GPU (healthy.csv), the checkpoint pauses in every trace, the job-wide
    throttle, and the seven healthy GPUs beside each failing one."""
    result = corpus_result()
    assert result.false_triggers == 0 and result.healthy_gpu_days > 3


def test_the_always_hot_gpu_stays_well_below_the_threshold():
    """The issue's case: beside a GPU heating toward shutdown, one that always runs ~9 C hotter."""
    summaries = {s.gpu: s for s in summarize(read_trace(DATA / "steady_overheat.csv"), RiskModel())}
    assert summaries[3].first_trigger is not None and summaries[3].first_trigger.critical is None
    assert summaries[4].first_trigger is None and summaries[4].max_risk < 0.6


def test_without_the_power_instability_factor_its_trace_is_missed():
    """The corpus's power_instability.csv is the issue's case: the model before the factor
    (its weight 0 leaves every other score as it was) never triggers on it."""
    path = DATA / "power_instability.csv"
    config = RiskConfig(risk_weight_power_instability=0.0)
    trace = score_trace(path.stem, read_trace(path), RiskModel(config), read_labels(path))
    (outcome,) = evaluate([trace], [config.risk_threshold])[0].outcomes
    assert outcome.first_trigger is None


# (shape, period s, amplitude W, power limit W, sample interval s): the swing starts at a random
# phase, and no period is a multiple of half the interval (a sampler in step with the swing sees
# a constant: no telemetry can show that).
SWINGS = [
    ("sine", 120, 260, 700, 10), ("square", 60, 150, 1000, 10), ("sawtooth", 180, 150, 1000, 10),
    ("random", 40, 150, 1000, 10), ("sine", 10, 150, 1000, 4), ("square", 250, 150, 400, 10),
    ("sine", 300, 200, 1000, 10), ("random", 25, 150, 1000, 60), ("sawtooth", 90, 200, 700, 30),
    ("square", 13, 150, 1000, 10),
]


@pytest.mark.parametrize("number, swing", list(enumerate(SWINGS)), ids=["/".join(map(str, c)) for c in SWINGS])
def test_a_gpu_swinging_wider_than_its_peers_is_caught_five_minutes_ahead(number, swing):
    """35 minutes of swinging, then off the bus; the onset moves so that checkpoint pauses fall
    at other points of the swing. No other GPU of the node triggers."""
    shape, period, amplitude, limit, interval = swing
    onset = 12 + 4 * number
    node = Node(seed=500 + number, limit_w=limit)
    fault = PowerSwing(shape, period, amplitude, center=0.85, onset=onset, off_bus=onset + 35)
    trace = score_trace("swing", node.run(minutes=onset + 36, step_s=interval, fault=fault), RiskModel())
    result = evaluate([trace], [RiskConfig().risk_threshold])[0]
    (outcome,) = result.outcomes
    assert outcome.lead_s is not None and outcome.lead_s >= MIN_LEAD_S, outcome
    assert result.false_triggers == 0


def fleet_false_triggers(nodes: int, days: float, **fleet) -> tuple[int, float]:
    traces = [score_trace(name, samples, RiskModel()) for name, samples in healthy_fleet(nodes, days, **fleet)]
    result = evaluate(traces, [RiskConfig().risk_threshold])[0]
    assert not result.outcomes  # nothing failed: every GPU counts as healthy time
    return result.false_triggers, result.healthy_gpu_days


@pytest.mark.parametrize("limit_w", [400.0, 700.0, 1000.0])
def test_a_day_of_a_healthy_node_never_triggers(limit_w):
    """Checkpoint pauses and job-wide power brakes drop every GPU's power together, on any part."""
    false, gpu_days = fleet_false_triggers(nodes=1, days=1.0, limit_w=limit_w)
    assert gpu_days == pytest.approx(8 * (1.0 - 60 / DAY_S), rel=1e-3) and false == 0


def test_hours_of_a_healthy_node_sampled_every_ten_seconds_never_trigger():
    false, gpu_days = fleet_false_triggers(nodes=1, days=0.25, step_s=10, seed=200)
    assert gpu_days > 1.9 and false == 0


def test_a_job_start_with_sparse_samples_is_no_trend():
    """At one sample a minute, a GPU warming up faster than its peers in a job's first minutes
    fitted a trend through three points and looked minutes from its shutdown temperature
    (fleet-1 GPU 1 of this fleet, at minute 2); a trend needs TREND_MIN_POINTS."""
    false, gpu_days = fleet_false_triggers(nodes=2, days=2.0, seed=100)
    assert gpu_days > 30 and false == 0


@pytest.mark.slow
def test_at_most_one_false_trigger_per_hundred_gpu_days():
    false, gpu_days = fleet_false_triggers(nodes=4, days=4.0)
    assert gpu_days > 100
    assert false / gpu_days * 100 <= 1.0, (false, gpu_days)
