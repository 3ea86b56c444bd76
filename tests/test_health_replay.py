"""Acceptance through ``eft health replay``: the committed traces (tests/data/)."""

import csv
import json
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from elasticft.health import FACTORS, read_trace
from launcher.cli import app

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parent.parent
FAILING = {  # trace -> the GPU that fails in it
    "thermal_runaway.csv": 5,
    "ecc_fall_off_bus.csv": 6,
    "power_oscillation.csv": 2,
    "ecc_nvidia_smi.csv": 3,
    "steady_overheat.csv": 3,
    "power_delivery.csv": 4,
    "power_instability.csv": 3,
}
# make_more_traces.py's traces (and labels), which the risk model is not expected to
# foresee: test_health_eval.py measures them.
EVAL_ONLY = {
    "falling_clocks.csv", "job_wide_throttle.csv", "memory_leak_oom.csv", "memory_leak_oom.csv.labels.json",
    "sudden_fall_off.csv", "sudden_fall_off.csv.labels.json",
}
NOT_METRICS = {"timestamp", "node", "gpu", "index", "uuid", "xids"}


def replay(*args):
    result = CliRunner().invoke(app, ["health", "replay", *map(str, args)])
    return result


def replay_json(path, *args):
    result = replay("--json", path, *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def epoch(text):
    try:
        return float(text)
    except ValueError:
        moment = datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f")
        return moment.replace(tzinfo=timezone.utc).timestamp()


def failure_row(path):
    """(gpu, time) of the first row whose every metric is empty or [N/A], read with csv alone."""
    lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    rows = csv.DictReader(lines, skipinitialspace=True)
    for row in rows:
        metrics = [v for k, v in row.items() if k.split(" [")[0] not in NOT_METRICS]
        if all(v.strip() in ("", "[N/A]") for v in metrics):
            return int(row.get("gpu") or row["index"]), epoch(row["timestamp"])
    return None


def test_traces_are_small_and_reproducible(tmp_path):
    for path in DATA.glob("*.csv"):
        assert path.stat().st_size < 150_000, path
    assert sum(p.stat().st_size for p in DATA.glob("*.csv")) < 800_000
    committed = {p.name: p.read_bytes() for p in DATA.glob("*.csv*")}
    assert set(FAILING) | {"healthy.csv"} | EVAL_ONLY == set(committed)
    subprocess.run(
        [sys.executable, str(DATA / "make_traces.py"), str(tmp_path)],
        check=True, cwd=ROOT, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert {p.name: p.read_bytes() for p in tmp_path.glob("*.csv*")} == committed
    assert failure_row(DATA / "healthy.csv") is None
    assert {name: failure_row(DATA / name)[0] for name in FAILING} == FAILING


def test_healthy_trace_triggers_no_gpu_not_even_the_hot_one():
    temps = {}
    for s in read_trace(DATA / "healthy.csv"):
        temps.setdefault(s.gpu, []).append(s.temperature_c)
    mean = {g: statistics.fmean(t) for g, t in temps.items()}
    others = statistics.fmean(m for g, m in mean.items() if g != 4)
    assert mean[4] - others > 7  # GPU 4 really runs hotter
    assert len(temps[0]) >= 150  # hours of samples
    report = replay_json(DATA / "healthy.csv")
    assert len(report["gpus"]) == 8
    assert [g["first_trigger"] for g in report["gpus"]] == [None] * 8
    assert all(g["max_risk"] < 0.6 for g in report["gpus"]), report


@pytest.mark.parametrize("name", sorted(FAILING))
def test_failing_gpu_triggers_before_the_failure_and_no_other_gpu_does(name):
    failing_gpu, failed_at = failure_row(DATA / name)
    report = replay_json(DATA / name)
    by_gpu = {g["gpu"]: g for g in report["gpus"]}
    assert len(by_gpu) == 8
    failing = by_gpu.pop(failing_gpu)
    assert failing["first_trigger"] is not None, failing
    triggered_at = datetime.fromisoformat(failing["first_trigger"]).timestamp()
    assert triggered_at < failed_at
    assert failing["max_risk"] >= report["threshold"]
    assert set(failing["factors_at_trigger"]) == set(FACTORS)
    assert failing["factors_at_trigger"]["straggler"] is None  # a trace has no step times
    assert [g["first_trigger"] for g in by_gpu.values()] == [None] * 7
    if name == "ecc_nvidia_smi.csv":  # nothing but the uncorrectable error foretells it
        assert "uncorrected" in failing["critical"]
    else:  # foreseen by the telemetry before any critical event
        assert failing["critical"] is None
    if name == "ecc_fall_off_bus.csv":  # the corrected-error rate, before the uncorrectable one
        assert failing["dominant_factor"] == "errors"
    if name == "power_delivery.csv":  # the swinging power, held long enough to count alone
        assert failing["dominant_factor"] == "power"


def test_gpus_without_ecc_and_na_fields_give_no_spurious_risk(tmp_path):
    """nvidia-smi output of GPUs without ECC, with some fields [N/A] now and then."""
    lines = (DATA / "ecc_nvidia_smi.csv").read_text().splitlines()
    out = [lines[0]]
    for n, line in enumerate(lines[1:]):
        cells = line.split(", ")
        if cells[1] == "3":
            continue  # leave out the GPU that fails
        cells[-1] = "[N/A]"
        if n % 7 == 0:
            cells[3 + n % 5] = "[N/A]"
        out.append(", ".join(cells))
    trace = tmp_path / "no_ecc.csv"
    trace.write_text("\n".join(out) + "\n")
    report = replay_json(trace)
    assert len(report["gpus"]) == 7
    assert all(g["first_trigger"] is None and g["max_risk"] < 0.6 for g in report["gpus"])


def test_threshold_option_and_table_output():
    low = replay_json(DATA / "healthy.csv", "--threshold", "0.2")
    assert low["threshold"] == 0.2 and any(g["first_trigger"] for g in low["gpus"])
    table = replay(DATA / "ecc_fall_off_bus.csv")
    assert table.exit_code == 0
    (line,) = [row for row in table.stdout.splitlines() if row.split()[:2] == ["node-a", "6"]]
    assert "2024-05-01T" in line and "errors" in line
    assert "1 of 8 GPUs crossed the threshold 0.8" in table.stdout
    bad = replay(DATA / "healthy.csv", "--threshold", "2")
    assert bad.exit_code == 2 and "--threshold" in bad.output


def test_real_command_bad_file_is_one_line_and_exit_2(tmp_path):
    trace = tmp_path / "broken.csv"
    trace.write_text("timestamp,gpu,temperature_c\n1,0,60\n2,0,sixty\n")
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "health", "replay", "--json", str(trace)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"eft health replay: error: {trace}:3: column 'temperature_c': expected a number, got 'sixty'"
    ]
    missing = replay(tmp_path / "nope.csv")
    assert missing.exit_code == 2 and "nope.csv: cannot open" in missing.output


def test_real_command_scores_a_trace():
    proc = subprocess.run(
        [sys.executable, "-m", "launcher.cli", "health", "replay", "--json", str(DATA / "ecc_nvidia_smi.csv")],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    gpus = json.loads(proc.stdout)["gpus"]
    assert [g["gpu"] for g in gpus if g["first_trigger"]] == [3]
