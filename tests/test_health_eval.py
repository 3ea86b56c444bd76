"""``eft health eval``: the metric on tiny hand-made traces, the CLI on the corpus."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elasticft.health import GpuSample, RiskModel, read_trace
from elasticft.health.evaluate import (
    Failure,
    LabelError,
    Labels,
    crossings,
    derive_failures,
    evaluate,
    score_trace,
)
from elasticft.health.labels import parse_labels
from elasticft.health.trace import batches, write_trace
from launcher.cli import app

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent
T0 = 1714564800.0
CORPUS_FAILURES = {  # trace -> the GPU that fails in it
    "thermal_runaway": 5, "ecc_fall_off_bus": 6, "power_oscillation": 2, "ecc_nvidia_smi": 3,
    "falling_clocks": 1, "memory_leak_oom": 7, "sudden_fall_off": 0, "steady_overheat": 3, "power_delivery": 4,
    "power_instability": 3,
}


def row(minute: float, gpu: int, **fields) -> GpuSample:
    values = {
        "temperature_c": 60.0, "memory_used_mib": 1000.0, "memory_total_mib": 80000.0, "power_w": 500.0,
        "power_limit_w": 700.0, "utilization_pct": 97.0, "ecc_uncorrected": 0,
    }
    values.update(fields)
    return GpuSample(timestamp=T0 + 60 * minute, node="n", gpu=gpu, **values)


def lost(minute: float, gpu: int) -> GpuSample:
    return GpuSample(timestamp=T0 + 60 * minute, node="n", gpu=gpu, xids=(79,))


def tiny_trace() -> list[GpuSample]:
    """An hour, three GPUs a minute apart.

    GPU 0: a row remap pending from minute 20, off the bus at 30 (the all-missing row).
    GPU 1: healthy, two isolated Xid 63 events (minutes 5 and 40): two false triggers.
    GPU 2: normal until minute 30, then gone without a trace (a sudden fall-off).
    """
    samples = []
    for minute in range(61):
        if minute < 30:
            samples.append(row(minute, 0, rows_pending=minute >= 20))
        elif minute == 30:
            samples.append(lost(minute, 0))
        samples.append(row(minute, 1, xids=(63,) if minute in (5, 40) else ()))
        if minute < 30:
            samples.append(row(minute, 2))
    return samples


SUDDEN_FALL_OFF = Labels(failures=(Failure(None, 2, T0 + 30 * 60, "sudden_fall_off"),))


def tiny_result(threshold=0.95, labels=SUDDEN_FALL_OFF):
    scored = score_trace("tiny", tiny_trace(), RiskModel(), labels)
    (result,) = evaluate([scored], [threshold])
    return result


def test_a_gpu_that_triggers_ten_minutes_before_failing_is_caught_with_a_600_s_lead():
    assert derive_failures(tiny_trace()) == {("n", 0): T0 + 30 * 60}
    result = tiny_result(labels=None)
    (outcome,) = result.outcomes
    assert (outcome.gpu, outcome.mode, outcome.lead_s) == (0, "tiny", 600.0)
    assert result.recall == 1.0
    assert result.true_triggers == 1  # the pending row keeps the score at 1: one crossing


def test_a_healthy_gpu_that_triggers_twice_is_two_false_triggers_over_its_duration():
    result = tiny_result(labels=None)
    # GPU 1 (an hour) and GPU 2 (29 minutes, unlabelled: healthy for what it shows)
    assert result.false_triggers == 2
    assert result.healthy_gpu_days == pytest.approx((60 + 29) / 1440)
    assert result.false_per_gpu_day == pytest.approx(2 / ((60 + 29) / 1440))
    assert result.precision == pytest.approx(1 / 3)


def test_a_sudden_fall_off_labelled_by_a_sidecar_is_not_caught():
    result = tiny_result()
    outcomes = {o.gpu: o for o in result.outcomes}
    assert outcomes[2].mode == "sudden_fall_off" and outcomes[2].first_trigger is None
    assert outcomes[2].lead_s is None
    assert result.recall == 0.5
    assert result.healthy_gpu_days == pytest.approx(60 / 1440)  # only GPU 1 is healthy now
    modes = result.by_mode()
    assert [o.gpu for o in modes["sudden_fall_off"]] == [2] and [o.gpu for o in modes["tiny"]] == [0]


def test_ignored_gpus_count_nowhere_and_labels_must_fit_the_trace():
    result = tiny_result(labels=Labels(ignored=((None, 1),)))
    assert (result.false_triggers, result.precision) == (0, 1.0)
    with pytest.raises(LabelError, match="has no GPU 9"):
        score_trace("tiny", tiny_trace(), RiskModel(), Labels(ignored=((None, 9),)))


def test_a_gpu_that_answers_again_after_missing_rows_has_not_failed():
    samples = [row(0, 0), lost(1, 0), row(2, 0), lost(3, 0), lost(4, 0)]
    assert derive_failures(samples) == {("n", 0): T0 + 180}
    assert derive_failures(samples[:3]) == {}


def test_crossings_are_the_models_crossed_flags():
    model = RiskModel()
    series, crossed = [], []
    for round_ in batches(read_trace(DATA / "power_oscillation.csv")):
        for score in model.update(round_):
            if score.gpu == 2:
                series.append((score.timestamp, score.score))
                if score.crossed:
                    crossed.append(score.timestamp)
    assert crossed and crossings(series, model.threshold) == crossed
    assert crossings([(1, 0.9), (2, 0.8), (3, 0.9), (4, 0.5), (5, 0.95)], 0.9) == [1, 5]


def test_sidecar_labels_parse_and_errors_name_the_place():
    labels = parse_labels({"mode": "m", "failures": [{"gpu": 1, "time": "2024-05-01T12:40:00Z"}],
                           "ignore": [{"gpu": 2, "node": "a"}]}, "x.json")
    assert labels == Labels((Failure(None, 1, T0 + 2400),), (("a", 2),), "m")
    for data, message in [
        ([], "x.json: expected a JSON object"),
        ({"failure": []}, "unknown key 'failure'"),
        ({"failures": [{"gpu": 1}]}, "failures[0]: missing 'time'"),
        ({"failures": [{"gpu": "1", "time": 0}]}, "'gpu': expected a GPU index"),
        ({"failures": [{"gpu": 1, "time": "soon"}]}, "failures[0]: 'time': expected a timestamp"),
        ({"ignore": {"gpu": 1}}, "'ignore': expected a list"),
    ]:
        with pytest.raises(LabelError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_labels(data, "x.json")


def run_eval(*args):
    return CliRunner().invoke(app, ["health", "eval", *map(str, args)])


def test_cli_on_the_corpus_names_every_failure():
    traces = sorted(DATA.glob("*.csv"))
    result = run_eval("--json", "--thresholds", "0.5,0.95", *traces)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [t["threshold"] for t in report["thresholds"]] == [0.5, 0.95]
    for level in report["thresholds"]:
        assert {o["trace"]: o["gpu"] for o in level["outcomes"]} == CORPUS_FAILURES
        assert set(level["modes"]) == set(CORPUS_FAILURES)
        assert level["modes"]["sudden_fall_off"]["caught"] == 0
        assert level["healthy_gpu_days"] > 3  # 65 healthy GPUs, one to three hours each
        assert 0 <= level["recall"] <= 1 and level["failures"] == len(CORPUS_FAILURES)
    table = run_eval(DATA / "ecc_fall_off_bus.csv", "--thresholds", "0.9")
    assert table.exit_code == 0
    assert table.stdout.splitlines()[1].split() == ["0.9", "1/1", "100%", "1/1", "100%", "0.00", "6m30s", "6m30s"]
    assert "ecc_fall_off_bus             1/1" in table.stdout


@pytest.mark.parametrize("args, message", [
    (["nope.csv"], "nope.csv: cannot open"),
    (["--thresholds", "0.5,x", "T"], "--thresholds: expected numbers in (0, 1] separated by commas, got '0.5,x'"),
    (["--thresholds", "1.5", "T"], "--thresholds: expected numbers"),
    (["--thresholds", "", "T"], "--thresholds: expected numbers"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    args = [str(DATA / "healthy.csv") if a == "T" else str(tmp_path / a) if a.endswith(".csv") else a for a in args]
    result = run_eval(*args)
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith("eft health eval: error: ") and message in result.output


def test_real_command_bad_trace_or_sidecar_is_one_line_without_traceback(tmp_path):
    broken = tmp_path / "broken.csv"
    broken.write_text("timestamp,gpu,temperature_c\n1,0,60\n2,0,sixty\n")
    good = tmp_path / "good.csv"
    write_trace(good, [row(0, 0), row(1, 0)])
    (tmp_path / "good.csv.labels.json").write_text('{"failures": [{"gpu": 0}]')
    for trace, expected in [
        (broken, f"{broken}:3: column 'temperature_c': expected a number, got 'sixty'"),
        (good, f"{good}.labels.json:1: not JSON: Expecting ',' delimiter"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "launcher.cli", "health", "eval", str(trace)],
            capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
        )
        assert (proc.returncode, proc.stdout) == (2, "")
        assert proc.stderr.strip().splitlines() == [f"eft health eval: error: {expected}"]


def test_calibrate_proposes_the_lowest_threshold_within_the_target():
    traces = [DATA / "healthy.csv", DATA / "job_wide_throttle.csv", DATA / "falling_clocks.csv"]
    result = CliRunner().invoke(app, ["health", "calibrate", "--json", "--target", "1", *map(str, traces)])
    assert result.exit_code == 0, result.output
    proposal = json.loads(result.stdout)
    scored = [score_trace(p.stem, read_trace(p), RiskModel()) for p in traces]
    at, below = evaluate(scored, [proposal["threshold"], round(proposal["threshold"] - 0.01, 4)])
    assert at.false_triggers == proposal["false_triggers"] == 0
    assert below.false_triggers > 0 or proposal["threshold"] == 0.3  # nothing lower also meets it
    assert proposal["caught"] == 1 and proposal["enough_data"] is False  # a few GPU-days cannot show 1 per 100
    text = CliRunner().invoke(app, ["health", "calibrate", *map(str, traces)])
    assert f"proposed --eft-risk-threshold {proposal['threshold']:g}" in text.stdout
    assert "replay at least 100 GPU-days" in text.stdout


@pytest.mark.parametrize("target", ["-1", "nan", "x"])
def test_calibrate_bad_target_is_one_line_and_exit_2(target):
    result = CliRunner().invoke(app, ["health", "calibrate", "--target", target, str(DATA / "healthy.csv")])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "--target" in result.output
