"""The emergency-checkpoint protocol against a real etcd, and the gap rule."""

import json
import threading

import pytest

from elasticft.agent.ckpt_protocol import CheckpointProtocol
from elasticft.agent.events import EventLog
from elasticft.agent.relay import CheckpointRelay
from elasticft.worker.gap import gap_filter


@pytest.mark.parametrize(
    "reason, iteration, last, interval, allowed",
    [
        ("risk", 120, 100, 100, False),  # 20 < 25
        ("risk", 125, 100, 100, True),  # exactly the gap
        ("risk", 130, None, 100, True),  # nothing saved yet
        ("risk", 130, 100, None, True),  # no save interval known
        ("manual", 101, 100, 100, True),
        ("signal", 100, 100, 100, True),
        ("watchdog", 100, 100, 100, True),
    ],
)
def test_gap_rule(reason, iteration, last, interval, allowed):
    why = gap_filter(reason, iteration, last, interval, 0.25)
    assert (why is None) is allowed
    if not allowed:
        assert str(last) in why and "gap" in why


@pytest.fixture
def protocol(etcd, run_keys):
    return CheckpointProtocol(etcd, run_keys, "agent")


def test_concurrent_requests_collapse_into_one(etcd, run_keys):
    agents = [CheckpointProtocol(etcd, run_keys, f"node{i}") for i in range(8)]
    results = [None] * len(agents)
    start = threading.Barrier(len(agents))

    def ask(i):
        start.wait()
        results[i] = agents[i].request("risk", f"node{i}/gpu0", risk=0.97)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(agents))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({request.id for request, _ in results}) == 1
    assert sum(created for _, created in results) == 1


def test_acknowledged_request_is_closed_and_latest_moves(protocol):
    first, _ = protocol.request("manual", "me")
    protocol.acknowledge(first.id, 40, "/ckpt/iter_0000040", 1.5)
    second, created = protocol.request("manual", "me")
    assert created and second.id != first.id
    report = protocol.status()
    assert report["latest"]["iteration"] == 40
    assert [a["request_id"] for a in report["acks"]] == [first.id]
    assert report["request"]["id"] == second.id


def test_manual_request_does_not_join_a_risk_request_and_a_skipped_one_is_closed(protocol):
    risk, _ = protocol.request("risk", "node0/gpu3", risk=1.0)
    manual, created = protocol.request("manual", "operator")
    assert created and manual.id != risk.id  # the gap rule could still skip the risk one
    protocol.filtered(risk.id, 10, 8, "inside the gap")
    assert not protocol.is_open(risk)
    again, created = protocol.request("risk", "node1/gpu0", risk=1.0)
    assert not created and again.id == manual.id  # joins the open manual save


def test_stop_is_not_swallowed_by_an_open_save(protocol):
    save, _ = protocol.request("risk", "node0/gpu3", risk=1.0)
    stop, created = protocol.request("manual", "operator", exit=True)
    assert created and stop.exit and stop.id != save.id
    again, created = protocol.request("manual", "operator")
    assert not created and again.id == stop.id  # a plain save joins the stop


def test_relay_hands_requests_to_workers_and_acks_back(etcd, run_keys, tmp_path):
    p = CheckpointProtocol(etcd, run_keys, "node0")
    delivered = threading.Event()
    relay = CheckpointRelay(etcd, run_keys, p, tmp_path, on_request=lambda r: delivered.set()).start()
    try:
        request, _ = p.request("manual", "me")
        assert delivered.wait(5)
        assert json.loads((tmp_path / "request.json").read_text())["id"] == request.id
        # Rank 0 writes an ack without knowing the id: the relay fills in the pending one.
        (tmp_path / "outbox" / "1.json").write_text(
            json.dumps({"type": "ack", "request_id": None, "iteration": 7, "path": "/c/iter_0000007", "seconds": 0.2})
        )
        (tmp_path / "outbox" / "2.json").write_text(
            json.dumps({"type": "filtered", "request_id": "r1", "iteration": 8, "last_saved_iteration": 7, "why": "gap"})
        )
        relay.drain()
        assert not list((tmp_path / "outbox").iterdir())
        assert p.status()["acks"][0]["request_id"] == request.id
        kinds = [e["kind"] for e in EventLog(etcd, run_keys, "test").read()]
        assert kinds == ["ckpt_request", "ckpt_saved", "ckpt_filtered"]
    finally:
        relay.stop()


def test_relay_does_not_replay_a_saved_request_after_restart(etcd, run_keys, tmp_path):
    p = CheckpointProtocol(etcd, run_keys, "node0")
    old, _ = p.request("manual", "me")
    p.acknowledge(old.id, 3, "/c", 0.1)
    relay = CheckpointRelay(etcd, run_keys, p, tmp_path).start()
    relay.stop()
    assert not (tmp_path / "request.json").exists()
