"""A restart after a worker failed stops the round's other ranks with SIGKILL, on every node.

A rank whose peer is dead is stuck in a collective that cannot finish (on a GPU, an NCCL
kernel) and never acts on SIGTERM, which eft's ``Hook`` makes a request to save: stopped
with SIGTERM, its node waited out the 30 s grace before SIGKILL. ``decide`` already kills
for a lost node; a peer's death shows up two more ways:

* on its own node, torch's monitor closes the remaining workers as soon as one failed:
  ``torch_seam.failure_kills_the_rest`` makes that close SIGKILL;
* on the other nodes, its agent restarts and waits in the next round, which they see as
  nodes waiting to join. The failed node says so first, in its record (``failed_round``,
  one write of the node whose workers failed): every agent's membership watch sees it, with
  no request of its own, and the members of that round restart with SIGKILL
  (``Observer.failed_peers``, ``decide``; ``torchs_restart`` when torch's own restart for
  the waiting node comes first).

Workers that are all alive keep SIGTERM: a node joining, a signal-driven save, the agent's
own shutdown after an exit signal (their saves must happen).
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.rendezvous import RendezvousHandler

from elasticft.agent.context import AgentContext
from elasticft.agent.decide import Decision, torchs_restart
from elasticft.agent.observe import Observer
from elasticft.agent.restart_budget import CHARGED_REASONS
from elasticft.rendezvous.backend import rendezvous_round
from elasticft.store import StoreError

log = logging.getLogger(__name__)


def current_round(handler: RendezvousHandler) -> int | None:
    """The rendezvous round this node's workers run in; None before the first."""
    try:
        return rendezvous_round(handler)
    except RuntimeError:
        return None


def stop_decision(worker_group: WorkerGroup, pending: Decision, observer: Observer) -> Decision:
    """The decision the restart that begins now stops the workers by (``pending``: the monitor's):
    a restart torch starts on its own for waiting nodes kills when one of them is a member whose
    workers failed."""
    return torchs_restart(pending, worker_group.state, observer.failed_peers())


def tell_peers(ctx: AgentContext | None, worker_group: WorkerGroup, reason) -> None:
    """When this node's workers failed (a restart charged: a worker failed, a rank hung), its record
    says so before they are stopped, so that the round's other members stop theirs at once. Called
    after this node's ``restart`` event: the others' restarts follow it in the log, and ``eft
    report`` names this node's cause. etcd out of reach only loses the others' shortcut: they wait
    out the grace."""
    round_ = current_round(worker_group.spec.rdzv_handler) if ctx is not None else None
    if round_ is not None and reason in CHARGED_REASONS:
        try:
            ctx.node.workers_failed(round_)
        except StoreError as exc:
            log.warning("could not tell the other nodes that this node's workers failed (%s): theirs "
                        "get SIGTERM and torch's grace", exc)
