"""What the agent says (and records) when it restarts its workers for a reason torch does not charge."""

from __future__ import annotations

import logging
import time

from elasticft.agent.context import AgentContext
from elasticft.agent.decide import Decision, RestartReason
from elasticft.contract.events import EventKind

log = logging.getLogger(__name__)


def announce(decision: Decision, ctx: AgentContext | None, membership_restarts: int) -> None:
    """Log (and record) an uncharged restart; ``membership_restarts`` counts this one if it is one."""
    if decision.reason is RestartReason.SIGNAL_SAVE:
        log.info("workers exited after their signal-driven save; restarting them")
    elif decision.reason is RestartReason.ROLLBACK:
        log.warning("workers stopped on bad numbers; restarting them from the last good state")
    elif decision.reason is RestartReason.FENCED:
        silent = time.monotonic() - ctx.lease.refreshed_at
        if ctx.lease.lost.is_set():
            log.warning("etcd let this node's lease expire (no refresh reached it for %.0f s: the node was frozen, "
                        "or cut off from etcd); the others went on without it: its workers are stopped (fenced "
                        "off) and it rejoins at the next round", silent)
        elif silent < ctx.lease.ttl:
            log.warning("etcd has not confirmed this node's lease for %.1f s but answers its peers: this node is "
                        "cut off from etcd, and the others go on without it once its lease expires; its workers "
                        "are stopped now (fenced off) and it rejoins through a new rendezvous once etcd answers "
                        "(not charged to --max-restarts)", silent)
        else:
            log.warning("etcd has not confirmed this node's lease for %.0f s (longer than its TTL): the others may "
                        "have gone on without it; its workers are stopped (fenced off) and it rejoins through a new "
                        "rendezvous once etcd answers (not charged to --max-restarts)", silent)
    elif decision.lost:
        ctx.record(EventKind.NODE_LOST, nodes=[r.node_id for r in decision.lost], restarts=membership_restarts)
        log.warning(
            "lost node(s) %s; restarting workers through a new rendezvous "
            "(a membership change, not charged to --max-restarts)",
            ", ".join(f"{r.node_id} ({r.host})" for r in decision.lost),
        )
    elif decision.failed_peers:
        log.warning("the workers of node(s) %s failed; stopping this node's with SIGKILL (a rank with a dead peer "
                    "never acts on SIGTERM) and restarting them through a new rendezvous (not charged to "
                    "--max-restarts)", ", ".join(f"{r.node_id} ({r.host})" for r in decision.failed_peers))
    else:
        log.warning("workers failed while new nodes wait to join; restarting them "
                    "through a new rendezvous (not charged to --max-restarts)")
