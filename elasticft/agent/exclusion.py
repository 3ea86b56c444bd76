"""``--eft-straggler-action exclude`` and ``--eft-suspect-action exclude``: a node with a
straggler, or one suspect of computing bad numbers, leaves the job at a restart.

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

from elasticft.agent.context import AgentContext
from elasticft.agent.stragglers import StragglerMonitor, may_leave
from elasticft.contract.events import EventKind
from elasticft.contract.records import NodeState
from elasticft.rendezvous.backend import leave_without_closing
from elasticft.rendezvous.membership import running_nodes
from elasticft.store import StoreError

log = logging.getLogger(__name__)


def why_leaving(ctx: AgentContext, services, numerics, worker_group) -> str | None:
    """At a restart, before the next round: why this node has left the job (the caller ends
    the agent), for a straggler or for suspect numbers; None: it stays."""
    handler = worker_group.spec.rdzv_handler
    if leave_if_straggler(ctx, services.stragglers, handler):
        return f"node {ctx.node_id} left the job as a straggler"
    sampler = services.sampler
    ranks = sorted(w.global_rank for w in worker_group.workers)
    if numerics.at_restart(ctx, sampler.model if sampler else None, handler, ranks):
        return f"node {ctx.node_id} left the job: suspect of bad numbers"
    return None


def leave_if_straggler(ctx: AgentContext, monitor: StragglerMonitor | None, rdzv_handler) -> bool:
    """True when this node has left the job (the caller ends the agent); False: it stays."""
    if monitor is None or not monitor.wants_exclusion():
        return False
    return leave_job(ctx, rdzv_handler, sorted(s.rank for s in monitor.stragglers), "straggler")


def leave_job(ctx: AgentContext, rdzv_handler, ranks: list[int], reason: str) -> bool:
    """Leave the job for ``reason`` (the ``node_excluded`` event's) unless the others alone
    would be too few; True when this node has left (the caller ends the agent)."""
    node_id, lease = ctx.node_id, ctx.node
    min_nodes = rdzv_handler.settings.min_nodes
    try:
        lease.set_state(NodeState.EXCLUDED)
        others = len([n for n in running_nodes(ctx.client, ctx.keys) if n != node_id])
        why = f"without node {node_id} the job would have {others} node(s), fewer than --nnodes' minimum {min_nodes}"
    except StoreError as exc:
        others, why = None, f"cannot count the other nodes: {exc}"
    if others is None or not may_leave(others, min_nodes):
        try:
            lease.set_state(NodeState.RUNNING)
        except StoreError:
            pass  # the lease keeps the record; the next restart tries again
        log.warning("%s rank(s) %s stay: %s", reason, ranks, why)
        return False
    ctx.record(EventKind.NODE_EXCLUDED, ranks=ranks, reason=reason, remaining_nodes=others)
    log.warning("node %s leaves the job: %s rank(s) %s; %d node(s) go on without it", node_id, reason, ranks, others)
    leave_without_closing(rdzv_handler)
    lease.close(clean=False)
    return True
