"""One of three etcd members down: a client made now (an agent starting or joining a run,
`eft status`) must still connect, through the two that serve.

Found by the chaos table's "1 of 3 etcd members lost" row (bench/chaos_rows.py): the
running agents failed over, but an eft-run started then exited 2 about a third of the time
(the etcd library picks a client's first member at random and moved on only after a request
had failed); now a request that finds its member down goes to the next one at once.
"""

import queue
import time

from bench.etcd_cluster import EtcdCluster
from elasticft.store import StoreError, StoreOptions, StoreUnavailable, connect

TRIES = 20  # each client picks its first member at random: all 20 miss the dead one with p = (2/3)^20
ELECTION_WINDOW = 15.0  # seconds two members of three may take to elect a leader on a loaded machine


def read_revision(client, prefix: str) -> int:
    """The revision of a read of ``prefix``, once etcd answers. If the member killed was the
    leader, the two left hold an election first (etcd's election timeout, 1 s, and more on a
    busy machine) and refuse reads meanwhile: etcd's behaviour, which the agents ride out as a
    short outage (their reads are retried); the client must be answered once there is a leader."""
    deadline = time.monotonic() + ELECTION_WINDOW
    while True:
        try:
            return client.get_prefix(prefix)[1]
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # between tries: each failed one was refused at once


def test_a_new_client_connects_while_one_of_three_members_is_down():
    with EtcdCluster() as cluster:
        leader = cluster.leader()
        cluster.kill(next(i for i in cluster.alive() if i != leader))
        failures = []
        for _ in range(TRIES):
            try:
                connect(StoreOptions(cluster.endpoint)).close()
            except StoreError as err:
                failures.append(err)
        assert not failures, f"{len(failures)} of {TRIES} clients could not connect: {failures[0]}"


def test_the_member_a_client_talks_to_dies_and_its_lease_watches_and_writes_go_on_through_the_others():
    # eft's own client (etcd_rpc.py, etcd_watch.py): one channel per member, one watch stream a
    # client, one keep-alive stream a period. Kill the very member it uses, mid-watch, under a lease.
    with EtcdCluster() as cluster:
        client = connect(StoreOptions(cluster.endpoint, timeout=3))
        try:
            lease = client.lease(3)
            client.put("/eft-test/held", "x", lease=lease)
            seen, ended = queue.Queue(), queue.Queue()
            client.watch_prefix("/eft-test/w/", lambda events: [seen.put(e.key) for e in events], on_error=ended.put)
            client.put("/eft-test/w/before", "1")
            assert seen.get(timeout=10) == "/eft-test/w/before"
            used = client._rpc.pick().target
            cluster.kill(next(i for i, m in enumerate(cluster.members) if m.endpoint == used))
            # the watch's stream ends with its member: the owner hears it as etcd away, in one error
            assert isinstance(ended.get(timeout=10), StoreUnavailable)
            # As KeySet does: read, then watch from the read's revision on. (A watch from "now" on a
            # member that has not yet applied the last write replays it: etcd's own semantics.)
            revision = read_revision(client, "/eft-test/w/")
            client.watch_prefix("/eft-test/w/", lambda events: [seen.put(e.key) for e in events],
                                start_revision=revision + 1)
            client.put("/eft-test/w/after", "2")  # the requests after the kill go to a live member
            assert seen.get(timeout=10) == "/eft-test/w/after"
            refreshed = lease.refreshed_at
            deadline = time.monotonic() + 10
            while lease.refreshed_at == refreshed and time.monotonic() < deadline:
                time.sleep(0.1)  # the keeper's period is ttl / 3: nothing to await but its next refresh
            assert lease.refreshed_at > refreshed and not lease.lost.is_set(), "the lease was not kept alive"
            assert client.get("/eft-test/held").value == b"x"  # the lease's key outlived the dead member
        finally:
            client.close()
