"""One of three etcd members down: a client made now (an agent starting or joining a run,
`eft status`) must still connect, through the two that serve.

Found by the chaos table's "1 of 3 etcd members lost" row (bench/chaos_rows.py): the
running agents failed over, but an eft-run started then exited 2 about a third of the time
(the etcd library picks a client's first member at random and moved on only after a request
had failed); now a request that finds its member down goes to the next one at once.
"""

from bench.etcd_cluster import EtcdCluster
from elasticft.store import StoreError, StoreOptions, connect

TRIES = 20  # each client picks its first member at random: all 20 miss the dead one with p = (2/3)^20


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
