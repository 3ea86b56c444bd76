"""NvmlSource against a fake NVML at the pynvml call level (bench/fake_pynvml.py)."""

import logging

import pynvml
import pytest

from bench.fake_pynvml import FakeNvml
from elasticft.config import ConfigError
from elasticft.health import NvmlSource, NvmlUnavailable, RiskModel, make_source
from elasticft.health.nvml import visible_gpus


@pytest.fixture
def fake(monkeypatch):
    return FakeNvml(count=4).install(monkeypatch)


def test_reads_every_field_in_its_unit(fake):
    g = fake.gpus[1]
    g.temperature, g.power_mw, g.limit_mw, g.util = 71, 612_500, 700_000, 93
    g.ecc_corrected, g.ecc_uncorrected, g.reasons = 12, 0, 0x44
    source = NvmlSource("node-a", visible_devices=None, clock=lambda: 1000.0)
    samples = source.read()
    assert [s.gpu for s in samples] == [0, 1, 2, 3]
    s = samples[1]
    assert (s.node, s.timestamp, s.uuid) == ("node-a", 1000.0, g.uuid)
    assert s.temperature_c == 71.0
    assert s.power_w == 612.5 and s.power_limit_w == 700.0
    assert s.memory_used_mib == 78_000 and s.memory_total_mib == 81_559
    assert s.utilization_pct == 93.0
    assert (s.ecc_corrected, s.ecc_uncorrected, s.rows_pending) == (12, 0, False)
    assert s.throttle_reasons == 0x44 and s.hw_slowdown is True
    assert (s.sm_clock_mhz, s.mem_clock_mhz) == (1980.0, 2619.0)
    assert s.xids == ()
    source.close()
    assert not fake.initialised


def test_thermal_limits_are_read_once_and_drive_the_temperature_factor(fake):
    fake.gpus[0].slowdown_c, fake.gpus[0].shutdown_c = 80, 84  # a board that throttles early
    fake.gpus[3].unsupported.add("nvmlDeviceGetTemperatureThreshold")
    for g in fake.gpus:
        g.temperature = 81
    source = NvmlSource("n", visible_devices=None)
    before = fake.calls.copy()
    samples = source.read()
    assert (samples[0].temp_slowdown_c, samples[0].temp_shutdown_c) == (80.0, 84.0)
    assert (samples[1].temp_slowdown_c, samples[1].temp_shutdown_c) == (87.0, 92.0)
    assert (samples[3].temp_slowdown_c, samples[3].temp_shutdown_c) == (None, None)  # the knob's default then
    assert (fake.calls - before)["nvmlDeviceGetTemperatureThreshold", 0] == 0  # fixed per board: read at start
    scores = RiskModel().update(samples)
    # 81 C: past this board's slowdown, far below a standard one's, 4 C under the 85 C default
    assert scores[0].factors["temperature"] == pytest.approx(0.3 + 0.7 * 1 / 4)
    assert scores[1].factors["temperature"] == pytest.approx(0.3 * 4 / 10)
    assert scores[3].factors["temperature"] == pytest.approx(0.3 * 6 / 10)
    source.close()


def test_unsupported_field_is_missing_not_zero_and_not_asked_again(fake):
    g = fake.gpus[2]
    g.unsupported |= {"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetRemappedRows"}
    source = NvmlSource("n", visible_devices=None)
    first = source.read()[2]
    assert first.ecc_corrected is None and first.ecc_uncorrected is None
    assert first.power_w is None
    assert first.rows_pending is False  # fell back to the pre-Ampere retired-pages query
    assert first.temperature_c == 65.0 and first.power_limit_w == 700.0
    before = fake.calls.copy()
    source.read()
    asked = fake.calls - before
    assert asked["nvmlDeviceGetTotalEccErrors", 2] == 0  # NotSupported is not asked again
    assert asked["nvmlDeviceGetPowerUsage", 2] == 0
    assert asked["nvmlDeviceGetTotalEccErrors", 1] == 2  # the other GPUs still are
    # No ECC on this GPU: the errors factor has no data and costs it nothing.
    scores = RiskModel().update(source.read())
    assert scores[2].factors["errors"] == 0.0  # the throttle reasons still inform it
    g.unsupported.add("nvmlDeviceGetCurrentClocksEventReasons")
    g.unsupported.add("nvmlDeviceGetCurrentClocksThrottleReasons")
    fresh = NvmlSource("n", visible_devices=None)
    assert RiskModel().update(fresh.read())[2].factors["errors"] is None


def test_lost_gpu_gives_an_empty_sample_and_one_warning(fake, caplog):
    source = NvmlSource("n", visible_devices=None)
    fake.gpus[3].lost = True
    with caplog.at_level(logging.WARNING):
        lost = source.read()[3]
        source.read()
    assert lost.temperature_c is None and lost.memory_used_mib is None and lost.power_w is None
    warnings = [r for r in caplog.records if "GPU 3" in r.getMessage() and "temperature" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    "spec, expected",
    [
        (None, [0, 1, 2, 3]),
        ("", []),
        ("2,0", [2, 0]),
        ("1,7,2", [1]),  # CUDA stops at the first invalid entry
        ("GPU-00000003", [3]),  # a unique uuid prefix
        ("GPU-00000001-1111-2222-3333-000000000001,0", [1, 0]),
        ("GPU-0000000", []),  # ambiguous prefix
    ],
)
def test_cuda_visible_devices_decides_which_gpus_are_sampled(fake, monkeypatch, spec, expected):
    if spec is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    source = NvmlSource("n")
    assert [s.gpu for s in source.read()] == expected


def test_visible_gpus_ignores_duplicates():
    assert visible_gpus("1,1,0", ["GPU-a", "GPU-b"]) == [1, 0]


def test_xid_events_reach_the_sample_of_their_gpu_once(fake):
    source = NvmlSource("n", visible_devices="0,1,2")
    assert fake.registered == {0, 1, 2}
    fake.inject_xid(1, 79)
    fake.inject_xid(1, 13)
    fake.inject_xid(3, 48)  # not one of ours
    samples = source.read()
    assert samples[1].xids == (79, 13)
    assert all(s.xids == () for s in samples if s.gpu != 1)
    assert source.read()[1].xids == ()
    fake.inject_xid(2, 79)
    scores = RiskModel().update(source.read())
    assert scores[2].score == 1.0 and scores[2].critical == "Xid 79"
    source.close()
    assert fake.event_sets_freed == 1


def test_no_event_support_means_no_xids_but_sampling_works(fake):
    for g in fake.gpus:
        g.unsupported.add("nvmlDeviceRegisterEvents")
    source = NvmlSource("n", visible_devices=None)
    fake.inject_xid(0, 79)
    assert [s.xids for s in source.read()] == [()] * 4


def test_nvml_that_does_not_load_is_reported(monkeypatch, caplog):
    FakeNvml(init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    with pytest.raises(NvmlUnavailable):
        NvmlSource("n")
    with caplog.at_level(logging.INFO, logger="elasticft.health"):
        assert make_source("", "n") is None
    lines = [r for r in caplog.records if r.name.startswith("elasticft.health")]
    assert len(lines) == 1 and "--eft-health-source" in lines[0].getMessage()
    with pytest.raises(ConfigError, match="--eft-health-source nvml"):
        make_source("nvml", "n")


def test_make_source_auto_picks_nvml_when_it_loads(fake):
    source = make_source("", "node-b", visible_devices="3")
    assert isinstance(source, NvmlSource)
    assert [(s.node, s.gpu) for s in source.read()] == [("node-b", 3)]


def test_make_source_auto_is_off_when_no_gpu_is_visible(fake, caplog):
    with caplog.at_level(logging.INFO, logger="elasticft.health"):
        assert make_source("", "n", visible_devices="") is None
    assert len(caplog.records) == 1 and "shows no GPU" in caplog.records[0].getMessage()
    assert not fake.initialised
    assert make_source("nvml", "n", visible_devices="").read() == []  # asked for: an empty source
