"""``--eft-straggler-action exclude``: a node with a straggler leaves the job at a restart.

The agent asks at every restart, when its workers are stopped and the next round is not
yet joined. The node marks its record ``excluded`` *before* counting the others, so two
straggling nodes that decide at once never both leave: each sees the other as no longer
running. It stays (and says so) when the others alone would be fewer than ``--nnodes``'
minimum. Leaving is a ``node_excluded`` event, the rendezvous left open for the others
(``leave_without_closing``) and the lease revoked: the others see a lost node and
restart without it at once, not charged to ``--max-restarts``.
"""

from __future__ import annotations

import logging
from typing import Callable

from elasticft.contract.events import EventKind
from elasticft.rendezvous.membership import NodeLease, running_nodes
from elasticft.rendezvous.backend import leave_without_closing
from elasticft.store import EtcdClient, RunKeys, StoreError
from elasticft.agent.stragglers import StragglerMonitor, may_leave

log = logging.getLogger(__name__)


def leave_if_straggler(
    monitor: StragglerMonitor | None,
    lease: NodeLease,
    client: EtcdClient,
    keys: RunKeys,
    rdzv_handler,
    record: Callable[..., None],
) -> bool:
    """True when this node has left the job (the caller ends the agent); False: it stays."""
    if monitor is None or not monitor.wants_exclusion():
        return False
    node_id = lease.record.node_id
    ranks = sorted(s.rank for s in monitor.stragglers)
    min_nodes = getattr(getattr(rdzv_handler, "settings", None), "min_nodes", 1)
    try:
        lease.set_state("excluded")
        others = len([n for n in running_nodes(client, keys) if n != node_id])
        why = f"without node {node_id} the job would have {others} node(s), fewer than --nnodes' minimum {min_nodes}"
    except StoreError as exc:
        others, why = None, f"cannot count the other nodes: {exc}"
    if others is None or not may_leave(others, min_nodes):
        try:
            lease.set_state("running")
        except StoreError:
            pass  # the lease keeps the record; the next restart tries again
        log.warning("straggler rank(s) %s stay: %s", ranks, why)
        return False
    record(EventKind.NODE_EXCLUDED, ranks=ranks, reason="straggler", remaining_nodes=others)
    log.warning("node %s leaves the job: straggler rank(s) %s (--eft-straggler-action exclude); "
                "%d node(s) go on without it", node_id, ranks, others)
    leave_without_closing(rdzv_handler)
    lease.close(clean=False)
    return True
