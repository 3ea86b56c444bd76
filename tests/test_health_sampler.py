"""HealthSampler and EtcdHealthPublisher against a real etcd (tests/conftest.py)."""

import json
import logging
import threading
import time
from pathlib import Path

import pytest

from elasticft.config import RiskConfig
from elasticft.health import (
    FACTORS,
    EtcdHealthPublisher,
    HealthSampler,
    HostSource,
    ReplaySource,
    RiskModel,
)

DATA = Path(__file__).parent / "data"


def watch_keys(etcd, prefix, count):
    """An Event set once ``count`` distinct keys under ``prefix`` have been written."""
    seen, done = set(), threading.Event()

    def on_events(events):
        seen.update(e.key for e in events if not e.deleted)
        if len(seen) >= count:
            done.set()

    cancel = etcd.watch_prefix(prefix, on_events)
    return done, cancel


def test_records_appear_under_the_lease_and_vanish_with_it(etcd, run_keys):
    lease = etcd.lease(10)
    publisher = EtcdHealthPublisher(etcd, run_keys, "node-a", lease)
    written, cancel = watch_keys(etcd, run_keys.health("node-a"), 8)
    source = ReplaySource(DATA / "healthy.csv", node="node-a")
    sampler = HealthSampler(source, RiskModel(), interval=0.01, publish=publisher).start()
    try:
        assert written.wait(20)
    finally:
        sampler.stop()
        cancel()
    items, _ = etcd.get_prefix(run_keys.health("node-a"))
    assert sorted(kv.key for kv in items) == [run_keys.health("node-a", g) for g in range(8)]
    assert {kv.lease for kv in items} == {lease.id}
    record = json.loads(items[4].value)
    assert (record["node"], record["gpu"]) == ("node-a", 4)
    assert 0 <= record["score"] < 0.8 and record["triggered"] is False
    assert set(record["factors"]) == set(FACTORS)
    # every factor above 0 shows what it adds to the score (eft top and the events say why)
    assert record["contributions"] == {
        k: pytest.approx(RiskConfig().weights()[k] * v, abs=1e-3) for k, v in record["factors"].items() if v
    }
    assert record["factors"]["straggler"] is None  # set by the straggler monitor, not by samples
    assert record["sample"]["temperature_c"] > 0 and record["time"].startswith("2024-05-01T")
    latest_sample, latest_score = sampler.latest[("node-a", 4)]
    assert record["timestamp"] == latest_sample.timestamp == latest_score.timestamp
    lease.revoke()
    assert etcd.get_prefix(run_keys.health("node-a"))[0] == []


@pytest.mark.parametrize("name, gpu", [("ecc_fall_off_bus.csv", 6), ("thermal_runaway.csv", 5)])
def test_trigger_callback_fires_once_on_a_failing_trace(etcd, run_keys, name, gpu):
    lease = etcd.lease(10)
    fired = []
    source = ReplaySource(DATA / name, node="node-a")
    sampler = HealthSampler(
        source, RiskModel(), interval=0.001,
        publish=EtcdHealthPublisher(etcd, run_keys, "node-a", lease), on_trigger=fired.append,
    )
    sampler.start()
    try:
        assert source.finished.wait(60)
    finally:
        sampler.stop()
    assert [(s.node, s.gpu) for s in fired] == [("node-a", gpu)]
    assert fired[0].triggered and fired[0].score >= RiskConfig().risk_threshold
    record = json.loads(etcd.get(run_keys.health("node-a", gpu)).value)
    assert record["triggered"] is True  # the last record is the failure row
    lease.revoke()


def test_etcd_trouble_does_not_stop_sampling_or_the_trigger(etcd, run_keys, caplog):
    lease = etcd.lease(10)
    lease.revoke()  # every put under it now fails
    fired = threading.Event()
    source = ReplaySource(DATA / "ecc_nvidia_smi.csv", node="node-b")
    sampler = HealthSampler(
        source, RiskModel(), interval=0.001,
        publish=EtcdHealthPublisher(etcd, run_keys, "node-b", lease), on_trigger=lambda s: fired.set(),
    )
    with caplog.at_level(logging.WARNING, logger="elasticft.health"):
        sampler.start()
        try:
            assert fired.wait(30)
        finally:
            sampler.stop()
    failures = [r for r in caplog.records if "publishing health records failed" in r.getMessage()]
    assert len(failures) == 1  # one line per new problem, not one per sample
    assert etcd.get_prefix(run_keys.health("node-b"))[0] == []


def test_stop_is_prompt_even_with_a_long_interval(tmp_path):
    sampled = threading.Event()
    source = ReplaySource(DATA / "healthy.csv")
    sampler = HealthSampler(source, RiskModel(), interval=3600, publish=lambda records: sampled.set(),
                            host_source=HostSource("n", [str(tmp_path)]))
    sampler.start()
    assert sampled.wait(10)
    started = time.monotonic()
    sampler.stop()
    assert time.monotonic() - started < 1.0
    assert not sampler.running
    assert sampler.latest_host is not None and sampler.latest_host.disks[0].path == str(tmp_path)
    assert len(sampler.latest) == 8


def test_a_failing_callback_is_logged_and_sampling_goes_on(caplog):
    def explode(score):
        raise RuntimeError("checkpoint service down")

    source = ReplaySource(DATA / "ecc_fall_off_bus.csv")
    sampler = HealthSampler(source, RiskModel(), interval=0.001, on_trigger=explode)
    with caplog.at_level(logging.ERROR, logger="elasticft.health"):
        sampler.start()
        try:
            assert source.finished.wait(30)
        finally:
            sampler.stop()
    assert any("trigger callback failed" in r.getMessage() for r in caplog.records)
    assert sampler.latest[("node-a", 6)][1].triggered  # the node column of the trace
