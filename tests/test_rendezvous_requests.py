"""What a round of the keys rendezvous asks of etcd grows by a constant per node (issue 53).

Each node puts its participant key, reading the control keys in the same request, and counts
its rank; it learns the decision and rank 0's bootstrap store address from the one control
watch it holds. Only the closer reads the participants, and only rank 0 writes the address.
Before, every other rank also read rank 0's address from the rendezvous store (most of them
before it was written: a read, a watch, a read again), and every node read the control keys
in a request of its own: five and more requests a node.
"""

from __future__ import annotations

import pytest

from bench.rdzv_sim import simulate_round

pytestmark = pytest.mark.timeout(180)

# The closer's reads and its decision, rank 0's store writes and its address: the same at any size.
FIXED = 12


def test_a_round_costs_etcd_two_requests_a_node_at_any_size(etcd_server):
    requests = {}
    for n in (4, 16):
        result = simulate_round("keys", n, etcd_server.endpoint, cap=60, idle=0.5)
        assert result.seconds is not None, result.error
        requests[n] = result.round.kv_requests
    for n, count in requests.items():
        assert count <= 2 * n + FIXED, requests
    # and nothing per other node: twelve more nodes cost two requests each
    assert requests[16] - requests[4] <= 2 * 12 + 4, requests
