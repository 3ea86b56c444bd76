"""eft simulate: the simulator against Young–Daly, hand-computed replays, policy order, the CLI."""

import dataclasses
import json
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from elasticft.goodput.costs import JobCosts, young_daly_interval, young_daly_waste
from elasticft.goodput.failures import DAY, LLAMA3_GPU_MTBF_HOURS, FailureTrace, Prediction, draw_trace
from elasticft.goodput.policies import EFT, LOSSES, PRESETS, Cluster, Policy
from elasticft.goodput.simulate import replay, run_policy, simulate_job
from launcher.cli import app

COSTS = JobCosts(iteration_seconds=1, save_seconds=100, save_interval_seconds=1000, detection_seconds=10,
                 restart_seconds=20, load_seconds=30)


def _adds_up(result):
    assert result.productive + sum(result.losses.values()) == pytest.approx(result.paid, rel=1e-9)


def test_periodic_matches_young_daly_first_order_within_1_percent():
    """4(a). Regime: job MTBF 1000 h, save 60 s, recovery 180 s, so the Young–Daly interval
    (5.8 h) is 0.6 % of the MTBF and the second-order terms (failures during saves and
    recoveries, C/2M, (C/tau)(tau/2M)) are about 0.3 % of the waste. Exponential failures,
    100,000 of them on one seed, so the rework's sampling error is also ~0.3 %."""
    mtbf, save = 1000 * 3600.0, 60.0
    costs = JobCosts(iteration_seconds=1, save_seconds=save, save_interval_seconds=young_daly_interval(mtbf, save),
                     detection_seconds=30, restart_seconds=60, load_seconds=90)
    seconds = mtbf * 100_000
    rng = np.random.default_rng(1)
    times = np.sort(rng.uniform(0, seconds, rng.poisson(seconds / mtbf)))
    result = run_policy(costs, EFT, Cluster(8, 8), FailureTrace.fixed(times, seconds))
    expected = young_daly_waste(costs.save_interval_seconds, mtbf, save, 30 + 60 + 90)
    simulated = 1 - result.goodput
    assert simulated == pytest.approx(expected, rel=0.01), (simulated, expected)
    _adds_up(result)


def test_replay_of_two_failures_is_the_hand_computed_one():
    """Saves of 100 s after every 1000 s of training; recovery 10 + 20 + 30 s. Failure at
    500 s: 500 s re-done. Resumed at 560 s; failure at 3000 s: 2440 s = two cycles of 1100 s
    + 240 s trained, re-done. Resumed at 3060 s; to 5000 s: one cycle + 840 s."""
    result = replay(COSTS, [3000, 500], 5000, gpus=8)
    assert result.failures == 2 and result.disk_recoveries == 2
    assert result.losses["rework"] == pytest.approx((500 + 240) * 8)
    assert result.losses["saves"] == pytest.approx(300 * 8)
    assert result.losses["detection"] == pytest.approx(2 * 10 * 8)
    assert result.losses["restart"] == pytest.approx(2 * 50 * 8)
    assert result.goodput == pytest.approx((5000 - 120 - 300 - 740) / 5000)
    _adds_up(result)


def test_replay_from_memory_redoes_only_since_the_memory_save():
    """Memory saves of 5 s after every 150 s of training (6 inside each 1000 s span).
    At 500 s: 3 spans of 155 s + 35 s, so 35 s re-done; resumed at 540 s, failure at
    3000 s: two 1130 s cycles + 200 s = one span + 45 s, so 45 s re-done."""
    costs = dataclasses.replace(COSTS, memory_save_seconds=5, memory_interval_seconds=150, memory_load_seconds=10)
    result = replay(costs, [500, 3000], 5000, gpus=16, policy=Policy("memory", memory=True))
    assert result.memory_recoveries == 2
    assert result.losses["rework"] == pytest.approx((35 + 45) * 16)
    _adds_up(result)


def test_memory_is_lost_when_the_replica_holder_fails_too():
    costs = dataclasses.replace(COSTS, memory_save_seconds=5, memory_interval_seconds=150, memory_load_seconds=10)
    # nodes 0 and 1 (1 holds 0's replica) fail 1 s apart: back to disk; of the first 500 s,
    # 3 memory saves of 5 s, so 485 s of training re-done.
    result = replay(costs, [500, 501], 5000, gpus=32, nodes=[0, 1], policy=Policy("memory", memory=True))
    assert result.disk_recoveries == 1 and result.losses["rework"] == pytest.approx(485 * 32)
    apart = replay(costs, [500, 501], 5000, gpus=32, nodes=[0, 2], policy=Policy("memory", memory=True))
    assert apart.memory_recoveries == 1 and apart.losses["rework"] == pytest.approx(35 * 32)


def test_a_spare_in_repair_makes_the_job_wait():
    """No spare, repair 1000 s: the job waits for the node, 1000 s - detection."""
    result = replay(COSTS, [500], 5000, gpus=8, repair_seconds=1000)
    assert result.losses["waiting"] == pytest.approx((1000 - 10) * 8)
    _adds_up(result)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policies_in_order_on_the_same_trace(seed):
    costs = JobCosts(iteration_seconds=10, save_seconds=60, save_interval_seconds=0, detection_seconds=5,
                     restart_seconds=30, load_seconds=60, memory_save_seconds=1, memory_load_seconds=10,
                     reshard_seconds=30)
    gpus, seconds = 16384, 54 * DAY
    trace = draw_trace(gpus, 8, seconds, np.random.default_rng(seed), Prediction(0.25, 300, 1e-4))
    cluster = Cluster(gpus, 8, spare_nodes=16, repair_seconds=DAY)
    _, results = simulate_job(costs, cluster, trace, list(PRESETS.values()), LLAMA3_GPU_MTBF_HOURS * 3600 / gpus)
    goodput = {r.policy: r.goodput for r in results}
    assert goodput["memory"] > goodput["proactive"] > goodput["periodic"], goodput
    assert 0.5 < goodput["periodic"] and goodput["memory"] < 1
    for result in results:
        _adds_up(result)
    assert results[-1].losses["idle_spares"] == 0 and results[-1].losses["reduced_capacity"] > 0


def test_proactive_save_cuts_the_rework_of_a_predicted_failure():
    trace = FailureTrace(5000.0, np.array([900.0]), np.array([0]), np.array([300.0]), ("given",), np.empty(0))
    periodic = run_policy(COSTS, Policy("p"), Cluster(8), trace)
    proactive = run_policy(COSTS, Policy("q", proactive=True), Cluster(8), trace)
    assert periodic.losses["rework"] == pytest.approx(900 * 8)
    # saved at 600 s (100 s), trained 200 s more before the failure
    assert proactive.losses["rework"] == pytest.approx(200 * 8) and proactive.proactive_saves == 1


def test_16k_gpus_54_days_all_policies_well_under_a_minute():
    started = time.perf_counter()
    result = CliRunner().invoke(app, ["simulate", "--gpus", "16384", "--days", "54", "--json"])
    assert result.exit_code == 0, result.output
    assert time.perf_counter() - started < 30
    record = json.loads(result.stdout)
    assert [p["policy"] for p in record["policies"]] == list(PRESETS)
    assert set(record["policies"][0]["lost_gpu_hours"]) == set(LOSSES)
    assert 300 < record["failures"] < 560  # Llama 3: 419 in 54 days on 16,384 GPUs


def test_plot_writes_svg_and_html(tmp_path):
    for name in ("run.svg", "run.html"):
        result = CliRunner().invoke(app, ["simulate", "--gpus", "1024", "--days", "5", "--plot",
                                          str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        text = (tmp_path / name).read_text()
        assert "<svg" in text and "periodic" in text


@pytest.mark.parametrize("args, message", [
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--gpus", "12", "--gpus-per-node", "8"], "multiple of gpus_per_node"),
    (["--days", "-1"], "--days must be > 0"),
    (["--false-alarms-per-gpu-day", "-0.1"], "--false-alarms-per-gpu-day must be >= 0"),
    (["--predictable", "1.5"], "--predictable must be in [0, 1]"),
    (["--failure-model", "weibull"], "--failure-model: unknown model"),
    (["--policies", "periodic,magic"], "--policies: unknown magic"),
    (["--save-seconds", "-5"], "save_seconds must be"),
    (["--costs", "/nonexistent/costs.json"], "--costs /nonexistent/costs.json: cannot read"),
    (["--plot", "x.png"], "PNG needs matplotlib"),
    (["--gpus", "many"], "'--gpus'"),
])
def test_cli_bad_input_is_one_line_exit_2(args, message):
    result = CliRunner().invoke(app, ["simulate", *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("eft simulate: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_cli_costs_file_malformed_and_unknown_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = CliRunner().invoke(app, ["simulate", "--costs", str(bad)])
    assert result.exit_code == 2 and "not valid JSON" in result.stderr
    bad.write_text(json.dumps({"costs": {"save_seconds": 10, "colour": 3}}))
    result = CliRunner().invoke(app, ["simulate", "--costs", str(bad)])
    assert result.exit_code == 2 and "unknown cost field(s): colour" in result.stderr


def test_cli_reads_the_costs_of_eft_report_json(tmp_path):
    report = tmp_path / "report.json"
    costs = dataclasses.replace(COSTS, save_seconds=42)
    report.write_text(json.dumps({"goodput": 0.9, "costs": costs.to_json()}))
    result = CliRunner().invoke(app, ["simulate", "--gpus", "1024", "--days", "3", "--costs", str(report),
                                      "--keep-intervals", "--json"])
    assert result.exit_code == 0, result.output
    used = json.loads(result.stdout)["costs"]["periodic"]
    assert used["save_seconds"] == 42 and used["save_interval_seconds"] == 1000
