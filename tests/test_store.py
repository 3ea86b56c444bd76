"""The etcd layer against a real etcd: CAS, leases, watches, the c10d store."""

import pickle
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.blob import EtcdRendezvousBackend
from elasticft.rendezvous.membership import Membership, NodeLease
from elasticft.store import EmbeddedEtcd, StoreOptions, StoreUnavailable, connect
from elasticft.store.c10d_store import EtcdStore


def prefix():
    return f"/test/{uuid.uuid4().hex}/"


def test_compare_and_swap_lets_one_of_two_writers_win(etcd):
    key = prefix() + "state"
    ok1, first = etcd.compare_and_swap(key, None, b"a")
    ok2, current = etcd.compare_and_swap(key, None, b"b")
    assert ok1 and not ok2
    assert current.value == b"a"
    ok3, now = etcd.compare_and_swap(key, current.mod_revision, b"c")
    assert ok3 and now.value == b"c"
    ok4, _ = etcd.compare_and_swap(key, current.mod_revision, b"d")  # stale token
    assert not ok4
    assert etcd.get(key).value == b"c"


def test_revoked_lease_deletes_its_keys_and_watch_sees_it(etcd):
    base = prefix()
    seen = []
    deleted = threading.Event()

    def on_events(events):
        seen.extend(events)
        if any(e.deleted for e in events):
            deleted.set()

    cancel = etcd.watch_prefix(base, on_events)
    lease = etcd.lease(3)
    etcd.put(base + "n1", b"x", lease=lease)
    lease.revoke()
    assert deleted.wait(5)
    cancel()
    assert etcd.get(base + "n1") is None
    assert [(e.key, e.deleted) for e in seen] == [(base + "n1", False), (base + "n1", True)]


def test_membership_tells_a_lost_node_from_one_that_left(etcd, run_keys):
    membership = Membership(etcd, run_keys)
    try:
        lost = NodeLease(etcd, run_keys, NodeRecord("a", "host-a", "addr-a", 11), ttl=3)
        left = NodeLease(etcd, run_keys, NodeRecord("b", "host-b", "addr-b", 22), ttl=3)
        assert membership.lost.wait(0) is False
        left.close(clean=True)
        lost.close(clean=False)
        assert membership.lost.wait(5)
        assert [r.node_id for r in membership.take_losses()] == ["a"]
        assert membership.lost_rdzv_identities() == {("addr-a", 11)}
        assert not membership.lost.is_set()
    finally:
        membership.close()


def test_a_node_lost_while_the_round_formed_without_it_costs_no_second_restart(etcd, run_keys):
    """A node that dies during a restart (after the survivors stopped their workers, before their
    round formed) is no member of that round: once it formed, its loss asks for nothing more.
    Before, every survivor whose watch saw it after the restart began restarted again alone."""
    membership = Membership(etcd, run_keys)
    leases = {name: NodeLease(etcd, run_keys, NodeRecord(name, "h", name, i), ttl=3) for i, name in enumerate("abc")}
    try:
        membership.take_losses()  # the restart begins (the agent's _rendezvous)
        leases["b"].close(clean=False)  # dies while the survivors rendezvous
        assert membership.lost.wait(5)
        _, formed_at = etcd.get_prefix(run_keys.nodes)  # the round forms after: without it
        membership.forget_non_members(formed_at)
        assert not membership.lost.is_set() and membership.take_losses() == []
        leases["c"].close(clean=False)  # lost after the round formed: one of its members
        assert membership.lost.wait(5)
        membership.forget_non_members(formed_at)
        assert [r.node_id for r in membership.take_losses()] == ["c"]
    finally:
        membership.close()
        for lease in leases.values():
            lease.close(clean=True)


def test_rendezvous_backend_shows_torch_lost_nodes_long_silent(etcd):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        _NodeDesc,
        _RendezvousState,
    )

    lost, alive = _NodeDesc("addr-a", 11, 0), _NodeDesc("addr-b", 22, 0)
    now = datetime.now(timezone.utc)
    state = _RendezvousState()
    state.last_heartbeats = {lost: now, alive: now}
    keys = RunKeys(uuid.uuid4().hex, "/test")
    membership = SimpleNamespace(lost_rdzv_identities=lambda: {("addr-a", 11)})
    backend = EtcdRendezvousBackend(etcd, keys, membership)
    assert backend.get_state() is None
    _, _, swapped = backend.set_state(pickle.dumps(state))
    assert swapped
    shown = pickle.loads(backend.get_state()[0])
    assert shown.last_heartbeats[lost] < now - timedelta(hours=1) and shown.last_heartbeats[alive] == now
    # Only what torch is shown is aged: the stored state keeps the real heartbeat.
    assert pickle.loads(etcd.get(keys.rdzv_state).value).last_heartbeats[lost] == now


def test_c10d_store_blocking_get_wakes_on_set(etcd):
    store = EtcdStore(etcd, prefix(), timeout=timedelta(seconds=10))
    result = {}
    reader = threading.Thread(target=lambda: result.setdefault("v", store.get("k")))
    reader.start()
    store.set("k", "hello")
    reader.join(10)
    assert result["v"] == b"hello"


def test_c10d_store_counters_and_compare_set(etcd):
    store = EtcdStore(etcd, prefix(), timeout=timedelta(seconds=2))
    adders = [threading.Thread(target=lambda: [store.add("n", 1) for _ in range(10)]) for _ in range(4)]
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    assert store.add("n", 0) == 40
    assert store.compare_set("cs", "", "one") == b"one"
    assert store.compare_set("cs", "wrong", "two") == b"one"
    assert store.compare_set("cs", "one", "two") == b"two"
    assert store.check(["n", "cs"]) and not store.check(["missing"])
    with pytest.raises(dist.DistStoreError):
        store.wait(["missing"], timedelta(milliseconds=300))


def test_c10d_store_works_behind_torch_prefix_store(etcd):
    # Keep the Python object alive: pybind's trampoline forgets its overrides otherwise
    # (torch's handler holds its store the same way).
    inner = EtcdStore(etcd, prefix(), timeout=timedelta(seconds=5))
    store = dist.PrefixStore("round.1", inner)
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]


def test_unreachable_etcd_is_reported_with_its_endpoint():
    with EmbeddedEtcd() as server:
        endpoint = server.endpoint
    with pytest.raises(StoreUnavailable, match=endpoint):
        connect(StoreOptions(endpoint, timeout=1))


def test_closing_a_client_under_requests_watches_and_callbacks_refuses_them_and_crashes_nothing(etcd_server):
    # an agent ends with its services' threads mid-request; before the gate, a request
    # racing the close reached the closed channel (ValueError from gRPC, or a segfault)
    script = Path(__file__).with_name("store_close_race.py")
    done = subprocess.run([sys.executable, str(script), etcd_server.endpoint, "10"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


