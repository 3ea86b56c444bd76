"""A real AgentContext for tests of one agent service: a lease, an event log, a membership watch."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.agent.context import AgentContext
from elasticft.agent.events import EventLog
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import Membership, NodeLease


def agent_context(etcd, keys: RunKeys, node_id: str, run_dir: Path, ttl: float = 3.0) -> AgentContext:
    """Node ``node_id`` joined to run ``keys`` on a live etcd, its run directory ``run_dir``."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    node = NodeLease(etcd, keys, NodeRecord(node_id, "host", "host", 1), ttl)
    ctx = AgentContext(etcd, keys, node, EventLog(etcd, keys, node_id), Membership(etcd, keys), Path(run_dir))
    _made.append(ctx)
    return ctx


_made: list[AgentContext] = []


@pytest.fixture(autouse=True)
def close_agent_contexts(etcd):
    """Stop the contexts' lease keep-alives and watches before the test's etcd client closes."""
    yield
    while _made:
        ctx = _made.pop()
        ctx.membership.close()
        ctx.node.close(clean=True)


def recorded(ctx: AgentContext) -> list[tuple[str, dict]]:
    """(kind, fields) of every event this node recorded, oldest first."""
    return [(e["kind"], e) for e in ctx.events.read() if e["source"] == ctx.node_id]
