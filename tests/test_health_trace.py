"""Trace formats, ReplaySource and HostSource."""

import os
from datetime import datetime, timezone
from pathlib import Path

import pytest

from elasticft.config import ConfigError
from elasticft.health import (
    HostSource,
    ReplaySource,
    TraceError,
    make_source,
    read_trace,
    write_trace,
)
from elasticft.health.sample import GpuSample

NVSMI = """\
timestamp, index, uuid, temperature.gpu, power.draw [W], power.limit [W], utilization.gpu [%], memory.used [MiB], memory.total [MiB], ecc.errors.uncorrected.volatile.total
2024/05/01 12:00:00.123, 0, GPU-aaaa, 45, 250.12 W, 400.00 W, 98 %, 30000 MiB, 81559 MiB, 0
2024/05/01 12:00:00.127, 1, GPU-bbbb, 47, [N/A], 400.00 W, 97 %, 30010 MiB, 81559 MiB, [N/A]
"""


def write(tmp_path, text, name="trace.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_nvidia_smi_rows_lose_their_units_and_na_is_missing(tmp_path):
    first, second = read_trace(write(tmp_path, NVSMI), node="node-x")
    moment = datetime(2024, 5, 1, 12, 0, 0, 123000, tzinfo=timezone.utc).timestamp()
    assert first.timestamp == pytest.approx(moment)
    assert (first.node, first.gpu, first.uuid) == ("node-x", 0, "GPU-aaaa")
    assert (first.temperature_c, first.power_w, first.power_limit_w) == (45.0, 250.12, 400.0)
    assert (first.utilization_pct, first.memory_used_mib, first.memory_total_mib) == (98.0, 30000.0, 81559.0)
    assert first.ecc_uncorrected == 0 and first.ecc_corrected is None
    assert second.power_w is None and second.ecc_uncorrected is None


def test_nvidia_smi_node_defaults_to_the_file_name(tmp_path):
    samples = list(read_trace(write(tmp_path, NVSMI, "gpu-node-7.csv")))
    assert {s.node for s in samples} == {"gpu-node-7"}


def test_eft_format_round_trips_and_absent_columns_are_missing(tmp_path):
    samples = [
        GpuSample(1714564800.5, "a", 0, temperature_c=60.0, ecc_corrected=3, rows_pending=True,
                  throttle_reasons=0x48, xids=(13, 79)),
        GpuSample(1714564800.5, "a", 1),
    ]
    path = tmp_path / "t.csv"
    write_trace(path, samples, comments=["a comment line"])
    assert list(read_trace(path)) == samples
    path.write_text("gpu,timestamp,temperature_c\n0,2024-05-01T12:00:00Z,61\n")
    (only,) = read_trace(path)
    assert only.temperature_c == 61.0 and only.power_w is None and only.node == "t"


@pytest.mark.parametrize(
    "text, line, message",
    [
        ("", 1, "empty trace"),
        ("timestamp,gpu,temperature_c\n1,0,hot\n", 2, "column 'temperature_c': expected a number"),
        ("timestamp,gpu,temperature_c\n1,0,60\n2,0\n", 3, "expected 3 fields, got 2"),
        ("timestamp,gpu,temprature_c\n", 1, "unknown column 'temprature_c'"),
        ("timestamp,temperature_c\n", 1, "without a 'gpu' column"),
        ("timestamp,gpu\n# note\n\n5,0\n4,0\n", 5, "timestamp goes backwards"),
        ("timestamp,gpu\nyesterday,0\n", 2, "expected a timestamp"),
        ("timestamp,gpu,xids\n1,0,79;x\n", 2, "Xid numbers"),
        (NVSMI + "2024/05/01 12:00:01.000, 1, GPU-bbbb, 47, 250 W\n", 4, "expected 10 fields"),
    ],
)
def test_malformed_trace_names_file_and_line(tmp_path, text, line, message):
    path = write(tmp_path, text)
    with pytest.raises(TraceError) as info:
        list(read_trace(path))
    assert str(info.value).startswith(f"{path}:{line}:")
    assert message in str(info.value)


def test_unreadable_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot open"):
        list(read_trace(tmp_path / "absent.csv"))
    (tmp_path / "bin.csv").write_bytes(b"timestamp,gpu\n\xff\xfe\x00\n")
    with pytest.raises(TraceError, match="bin.csv:2: not a text file"):
        list(read_trace(tmp_path / "bin.csv"))


ROUNDS = "timestamp,gpu,temperature_c\n" + "".join(
    f"{100 + 10 * i},{g},{60 + i}\n" for i in range(4) for g in range(2)
)


def test_replay_as_fast_as_possible_gives_one_round_per_read(tmp_path):
    source = ReplaySource(write(tmp_path, ROUNDS))
    reads = [source.read() for _ in range(4)]
    assert [[(s.timestamp, s.gpu) for s in r] for r in reads] == [
        [(100.0 + 10 * i, 0), (100.0 + 10 * i, 1)] for i in range(4)
    ]
    assert source.finished.is_set() and source.read() == []


def test_replay_in_real_time_gives_what_is_due_retimed_to_now(tmp_path):
    now = [5000.0]
    source = ReplaySource(write(tmp_path, ROUNDS), speed=2.0, clock=lambda: now[0])
    assert [s.timestamp for s in source.read()] == [5000.0, 5000.0]
    now[0] += 4.0  # 8 trace seconds: nothing new is due yet
    assert source.read() == []
    now[0] += 6.0  # 20 trace seconds: two more rounds
    assert [s.timestamp for s in source.read()] == [5005.0] * 2 + [5010.0] * 2
    assert not source.finished.is_set()
    now[0] += 100.0
    assert len(source.read()) == 2 and source.finished.is_set()


def test_replay_gives_the_good_rounds_before_the_bad_row(tmp_path):
    source = ReplaySource(write(tmp_path, "timestamp,gpu\n1,0\n2,0\n3,zero\n"))
    assert len(source.read()) == 1 and len(source.read()) == 1
    with pytest.raises(TraceError, match=":4:"):
        source.read()
    assert source.read() == [] and source.finished.is_set()


def test_make_source_parses_the_flag(tmp_path):
    path = write(tmp_path, ROUNDS)
    source = make_source(f"replay:{path}", "node-r")
    assert isinstance(source, ReplaySource) and source.speed == 1.0
    assert {s.node for s in source.read()} == {"node-r"}
    assert make_source("none", "n") is None
    for spec, message in [
        ("nvidia", "expected nvml, replay:PATH, none"),
        ("replay:", "replay needs a trace"),
        (f"replay:{tmp_path}/missing.csv", "is not a file"),
        (f"replay:{write(tmp_path, 'x,y', 'bad.csv')}", "bad.csv:1: unknown column"),
    ]:
        with pytest.raises(ConfigError, match="--eft-health-source") as info:
            make_source(spec, "n")
        assert message in str(info.value)


def test_host_source_reports_memory_and_checkpoint_space(tmp_path):
    later = tmp_path / "not" / "yet"  # checkpoint dir before the first save
    host = HostSource("node-h", [str(tmp_path), str(later)]).read()
    assert host.node == "node-h" and host.memory_total_mib > 0
    assert 0 < host.memory_available_mib <= host.memory_total_mib
    assert [d.path for d in host.disks] == [str(tmp_path), str(later)]
    st = os.statvfs(tmp_path)
    assert abs(host.disks[0].free_bytes - st.f_bavail * st.f_frsize) < 64 * 2**20
    assert host.disks[1].free_bytes > 0


# -- DCGM exporter metrics in a Prometheus text dump ------------------------------------

DCGM_OF = {
    "temperature_c": "DCGM_FI_DEV_GPU_TEMP", "power_w": "DCGM_FI_DEV_POWER_USAGE",
    "utilization_pct": "DCGM_FI_DEV_GPU_UTIL", "memory_used_mib": "DCGM_FI_DEV_FB_USED",
    "sm_clock_mhz": "DCGM_FI_DEV_SM_CLOCK", "ecc_corrected": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "ecc_uncorrected": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "throttle_reasons": "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
}


def dcgm_dump(samples, path):
    """The samples as promtool tsdb dump prints dcgm-exporter's series: one series after another."""
    series = {}
    for s in samples:
        labels = f'gpu="{s.gpu}",UUID="GPU-{s.gpu:04d}",Hostname="{s.node}",modelName="NVIDIA H100 80GB HBM3"'
        stamp = round(s.timestamp * 1000)
        for field, metric in DCGM_OF.items():
            value = getattr(s, field)
            if value is not None:
                series.setdefault((metric, labels), []).append(f"{metric}{{{labels}}} {value} {stamp}")
        if s.memory_total_mib is not None and s.memory_used_mib is not None:
            free = s.memory_total_mib - s.memory_used_mib
            series.setdefault(("DCGM_FI_DEV_FB_FREE", labels), []).append(
                f"DCGM_FI_DEV_FB_FREE{{{labels}}} {free} {stamp}")
    lines = ["# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).", "# TYPE DCGM_FI_DEV_GPU_TEMP gauge"]
    for rows in series.values():
        lines.extend(rows)
    path.write_text("\n".join(lines) + "\n")


def test_a_dcgm_dump_replays_like_the_csv_it_came_from(tmp_path):
    from elasticft.health import RiskModel, summarize

    csv_path = Path(__file__).parent / "data" / "falling_clocks.csv"
    samples = [s for s in read_trace(csv_path) if s.temperature_c is not None]  # the lost row has no series
    dump = tmp_path / "dcgm.prom"
    dcgm_dump(samples, dump)
    replayed = list(read_trace(dump))
    assert len(replayed) == len(samples)
    first = next(s for s in replayed if s.gpu == 1)
    original = next(s for s in samples if s.gpu == 1)
    assert (first.node, first.uuid, first.memory_total_mib) == ("node-a", "GPU-0001", original.memory_total_mib)
    assert first.temperature_c == original.temperature_c and first.throttle_reasons == original.throttle_reasons
    from_csv = {s.gpu: s for s in summarize(samples, RiskModel())}
    from_dump = {s.gpu: s for s in summarize(replayed, RiskModel())}
    assert from_dump[1].first_trigger.timestamp == from_csv[1].first_trigger.timestamp
    assert [g for g, s in from_dump.items() if s.first_trigger] == [1]


@pytest.mark.parametrize("text, message", [
    ('DCGM_FI_DEV_GPU_TEMP{gpu="0",Hostname="a"} 65\n', "sample without a timestamp"),
    ('DCGM_FI_DEV_GPU_TEMP{gpu="0",Hostname="a"} hot 1714564800000\n', "bad value 'hot'"),
    ('DCGM_FI_DEV_GPU_TEMP{gpu="0",Hostname="a} 65 1714564800000\n', "malformed labels"),
    ('DCGM_FI_DEV_GPU_TEMP{Hostname="a"} 65 1714564800000\n', "without a numeric 'gpu' label"),
    ('DCGM_FI_DEV_GPU_TEMP{gpu="0"} 65 1714564800000\nthis is not a metric line\n', ":2: not a Prometheus sample line"),
])
def test_a_malformed_dump_is_one_line_naming_the_file_and_exit_2(tmp_path, text, message):
    from typer.testing import CliRunner

    from launcher.cli import app

    dump = tmp_path / "dcgm.prom"
    dump.write_text(text)
    result = CliRunner().invoke(app, ["health", "replay", str(dump)])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert result.output.startswith(f"eft health replay: error: {dump}:") and message in result.output
