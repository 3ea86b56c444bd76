"""One etcd outage, one story: said when it starts, every 30 s, and when it ends."""

import logging

import pytest

from elasticft.store.outage import REPORT_EVERY, SETTLE, Outage


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_said_once_then_every_30_s_and_its_end_once(caplog):
    clock, ended = Clock(), []
    outage = Outage("etcd:2379", clock=clock)
    outage.on_recovered(lambda seconds, failed: ended.append((seconds, failed)))
    outage.success()
    with caplog.at_level(logging.WARNING, logger="elasticft.store.outage"):
        for _ in range(100):  # 100 requests in 70 s: three lines, not a hundred
            clock.now += 0.7
            outage.failure(started=clock.now)
        clock.now += 0.1
        outage.success()
        clock.now += 0.5
        outage.failure(started=clock.now - 1.0)  # in flight before etcd answered: not news
        outage.failure(started=clock.now)  # a failure right after the restart: the same outage
        clock.now += 0.1
        outage.success()
        clock.now += SETTLE
        outage.success()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("is unreachable" in line for line in lines) == 1
    assert sum("still unreachable" in line for line in lines) == int(70 // REPORT_EVERY)
    # from the first failure (100.7) to the answer that lasted (170.7); the late failure counted
    assert len(ended) == 1 and ended[0][0] == pytest.approx(70.0) and ended[0][1] == 101
    assert sum("answers again" in line for line in lines) == 1


def test_a_probe_of_an_etcd_not_yet_up_reports_nothing(caplog):
    clock = Clock()
    probe = Outage("etcd:2379", clock=clock, quiet=True)
    with caplog.at_level(logging.WARNING, logger="elasticft.store.outage"):
        for _ in range(5):
            clock.now += 1
            probe.failure(started=clock.now)
        probe.success()
    assert not caplog.records
