"""etcd housekeeping (elasticft/agent/housekeeping.py): compaction, its floors, the events bound.

Compaction is global to an etcd, so these tests run their own etcd, not the session's.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from elasticft.agent.context import AgentContext, EtcdTarget
from elasticft.agent.housekeeping import EtcdHousekeeper
from elasticft.config import ConfigError, HousekeepingConfig
from elasticft.contract.keys import RunKeys
from elasticft.store.keyset import KeySet
from elasticft.store import EmbeddedEtcd, StoreError, StoreOptions, connect


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def own_etcd():
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def join(own_etcd, tmp_path):
    contexts = []

    def make(node_id: str, run_id: str = "hk") -> AgentContext:
        target = EtcdTarget(StoreOptions(own_etcd.endpoint), RunKeys(run_id))
        ctx = AgentContext.join(target, node_id, "127.0.0.1", 1, 3.0, tmp_path / node_id)
        contexts.append(ctx)
        return ctx

    yield make
    for ctx in contexts:
        ctx.leave(clean=True)


def housekeeper(ctx, archive="", clock=None, **knobs) -> EtcdHousekeeper:
    config = HousekeepingConfig(**{"compact_retention": 600.0, **knobs})
    return EtcdHousekeeper(config, ctx, archive or "/nonexistent/archive", clock=clock or Clock())


def test_compacts_to_the_revision_seen_retention_ago_and_live_watches_go_on(join):
    ctx = join("n1")
    client, clock = ctx.client, Clock()
    keeper = housekeeper(ctx, clock=clock, max_events=0)
    seen = []
    watch = KeySet(client, ctx.keys.root + "w/", lambda: seen.append(1))  # live from a revision read now
    assert keeper.check_once() is None  # nothing is old enough yet
    first = client.revision()
    for i in range(20):
        client.put(ctx.keys.root + f"w/{i % 3}", str(i))
    clock.now += 599.0
    assert keeper.check_once() is None
    clock.now += 1.0
    assert keeper.check_once() == first
    with pytest.raises(StoreError, match="compacted"):
        client.count_range(ctx.keys.root, ctx.keys.root + "\xff", revision=first - 1)
    client.count_range(ctx.keys.root, ctx.keys.root + "\xff", revision=first)  # the target stays readable
    # a live watch of eft goes on across the compaction; one asked to start before it breaks at once
    # (the rendezvous makes its round's watch anew from the round's revision: hence the floors)
    client.put(ctx.keys.root + "w/after", "1")
    deadline = time.monotonic() + 10
    while ctx.keys.root + "w/after" not in watch and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ctx.keys.root + "w/after" in watch and not watch.broken
    stale = KeySet(client, ctx.keys.root + "w/", lambda: None, after=first - 2)
    deadline = time.monotonic() + 10
    while not stale.broken and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stale.broken
    stale.close()
    # membership (a watch since join) still sees a new node
    join("n2")
    deadline = time.monotonic() + 10
    while "n2" not in ctx.membership.members() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "n2" in ctx.membership.members()
    watch.close()


def test_no_compaction_past_any_live_runs_round(join):
    """The rendezvous reads its round's participants at the round's revision for as long as
    the round lasts: another run's housekeeper must not compact past it either."""
    mine, other = join("a", run_id="hk-a"), join("b", run_id="hk-b")
    clock = Clock()
    client = other.client
    client.put(other.keys.rdzv_decision(0), json.dumps({"revision": client.revision(), "size": 1}))
    floor = int(json.loads(client.get(other.keys.rdzv_decision(0)).value)["revision"])
    other_keeper = housekeeper(other, clock=Clock(), max_events=0, compact_retention=0)
    assert other_keeper.check_once() == floor  # publishes run b's floor, compacts up to it only
    for i in range(50):
        mine.client.put(mine.keys.root + "x", str(i))
    keeper = housekeeper(mine, clock=clock, max_events=0, compact_retention=0)
    keeper.check_once()  # etcd is compacted to the floor already: nothing further
    assert keeper.compacted == floor
    client.count_range(other.keys.root, other.keys.root + "\xff", revision=floor)  # still readable


def test_only_the_housekeeper_acts_and_the_role_passes_on(join):
    first, second = join("n1"), join("n2")
    assert housekeeper(first).is_housekeeper()
    assert not housekeeper(second).is_housekeeper()
    first.node.close(True)  # its lease goes, and the role with it
    assert housekeeper(second).is_housekeeper()


def test_events_beyond_the_bound_move_to_the_archive_in_order_and_none_is_lost(join, tmp_path):
    ctx = join("n1")
    for i in range(300):
        ctx.record("test_event", i=i)
    archive = tmp_path / "events.jsonl.archive"
    keeper = housekeeper(ctx, archive=str(archive), max_events=100)
    keeper.check_once()
    assert keeper.moved == 200 and ctx.client.count_prefix(ctx.keys.events) == 100
    moved = [json.loads(line) for line in archive.read_text().splitlines()]
    assert [e["i"] for e in moved] == list(range(200))
    for i in range(300, 350):  # more come; the next round moves 50 more
        ctx.record("test_event", i=i)
    keeper.check_once()
    assert ctx.client.count_prefix(ctx.keys.events) == 100
    # a crash between the append and the delete leaves a copy in both: the export keeps one
    with open(archive, "a") as out:
        out.write(json.dumps(ctx.events.read()[0]) + "\n")
    ctx.events.export(str(tmp_path / "events.jsonl"), str(archive))
    exported = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["i"] for e in exported if e["kind"] == "test_event"] == list(range(350))


def test_knobs_are_checked():
    with pytest.raises(ConfigError, match="--eft-max-events"):
        HousekeepingConfig(max_events=-1)
    assert HousekeepingConfig().archive_path("/x/ev.jsonl", "r") == "/x/ev.jsonl.archive"
    assert HousekeepingConfig().archive_path("", "r").endswith("/eft-events-r.archive.jsonl")


def uncompacted_db_size(endpoint: str, rounds: int) -> int:
    """etcd's db size after a job's health records (64 GPUs, 2 KB each) are rewritten ``rounds`` times."""
    client = connect(StoreOptions(endpoint))
    keys = RunKeys("busy")
    try:
        for r in range(rounds):
            client.put_many([(keys.health("n", gpu), json.dumps({"r": r, "pad": "x" * 2000})) for gpu in range(64)])
        return client.status().db_size
    finally:
        client.close()


def test_a_long_busy_job_keeps_etcds_database_bounded(join, tmp_path):
    """Rewrites of health-like records through the housekeeper (a writer thread, a
    compaction round every 0.3 s with 0.5 s of retention): the database stops growing; the
    same writes on an etcd nobody compacts grow it without bound."""
    ctx = join("n1")
    keeper = housekeeper(ctx, clock=time.monotonic, max_events=0, compact_retention=0.5, compact_interval=0.3)
    stop = threading.Event()
    writes = [0]

    def writer():
        while not stop.is_set():
            ctx.client.put_many([(ctx.keys.health("n1", g), json.dumps({"w": writes[0], "pad": "x" * 2000}))
                                 for g in range(64)])
            writes[0] += 1
            time.sleep(0.01)  # about 10 MB of history a second: a big job's health records, sped up

    thread = threading.Thread(target=writer, daemon=True)
    keeper.start()
    thread.start()
    sizes = []
    for _ in range(16):
        time.sleep(0.5)
        sizes.append(ctx.client.status().db_size)
    stop.set()
    thread.join()
    keeper.stop()
    assert keeper.compacted > 0
    rounds = min(writes[0], 1000)  # the same writes, on an etcd nobody compacts (capped: time)
    with EmbeddedEtcd() as uncompacted:
        grown = uncompacted_db_size(uncompacted.endpoint, rounds)
    print(f"\nhistory written {writes[0] * 64 * 2000 / 1e6:.1f} MB in {writes[0]} rounds; db size with compaction "
          f"{[round(s / 1e6, 1) for s in sizes]} MB; without, after {rounds} rounds {grown / 1e6:.1f} MB")
    assert grown > 0.8 * rounds * 64 * 2000  # every revision stays
    assert max(sizes[8:]) <= 1.5 * max(sizes[:8]) + 4e6  # the second half grows no further
    assert max(sizes) < grown / 2
