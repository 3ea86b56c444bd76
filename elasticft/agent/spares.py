"""Spares, as the agent keeps and tells them (``rendezvous/standby.py`` says when a node is one).

A spare's own agent rewrites its record (state ``spare`` and the round it waits in) and records
``spare_waiting``; once a round takes it in, ``running`` again and ``spare_promoted``, both
before its workers start. A spare whose own GPUs are at risk sits out (``spare_unfit``). When a
spare is lost, every member's membership watch hears of it and none restarts; the lowest live
member's agent records ``spare_lost`` for the job.
"""

from __future__ import annotations

import logging
import threading

from torch.distributed.elastic.rendezvous import RendezvousHandler

from elasticft.agent.context import AgentContext
from elasticft.agent.services import AgentServices
from elasticft.contract.events import EventKind
from elasticft.contract.records import NodeRecord, NodeState
from elasticft.health.sampler import HealthSampler
from elasticft.config import SegmentConfig
from elasticft.rendezvous.backend import share_node_lease, use_segments
from elasticft.rendezvous.decision import SegmentRule
from elasticft.store import StoreError

log = logging.getLogger(__name__)


def attach(handler: RendezvousHandler, ctx: AgentContext, services: AgentServices, segments: SegmentConfig) -> None:
    """Under eft's agent: the rendezvous shares the node's lease and membership watch
    (``share_node_lease``) and tells this node's record when it waits as a spare; a spare whose
    own GPUs are at risk is unfit; a spare's loss is recorded once; rounds take whole segments."""
    if segments.segment:
        use_segments(handler, SegmentRule(segments.segment, segments.segment_domain))
    standby = share_node_lease(handler, ctx.node, ctx.membership)
    if standby is not None:
        standby.tell = lambda number, spare: _tell(ctx, number, spare)
        standby.unfit = lambda: unfit(services.sampler)
        standby.tell_unfit = lambda why: ctx.record(EventKind.SPARE_UNFIT, why=why)
    ctx.membership.on_spare_lost = lambda record: _lost(ctx, record)


def unfit(sampler: HealthSampler | None) -> str | None:
    """Why a spare with this health must not be taken into a round: a GPU at or above the risk
    trigger (the score that asks members for an emergency save); None: fit, or no readings."""
    if sampler is None:
        return None
    threshold = sampler.model.threshold
    at_risk = [(score.score, gpu) for (_, gpu), (_, score) in sampler.latest.items() if score.score >= threshold]
    if not at_risk:
        return None
    score, gpu = max(at_risk)
    return f"GPU {gpu} risk {score:.2f}, at or above the trigger {threshold:.2f}"


def _tell(ctx: AgentContext, number: int, spare: bool) -> None:
    try:
        ctx.node.wait_as_spare(number if spare else None)
    except StoreError as exc:  # etcd away: the record says so at the next rewrite; the event is held
        log.warning("could not mark this node's record %s: %s", "spare" if spare else "running", exc)
    if spare:
        log.info("waiting as a spare in rendezvous round %d: the round before took its --nnodes maximum (or, with "
                 "--eft-segment, whole segments) without this node; it takes the place of a member lost%s", number,
                 f" in its domain, {ctx.node.record.segment}" if ctx.node.record.segment else "")
        ctx.record(EventKind.SPARE_WAITING, round=number)
    else:
        log.info("this spare is a member of rendezvous round %d: it takes a lost member's place", number)
        ctx.record(EventKind.SPARE_PROMOTED, round=number)


def _lost(ctx: AgentContext, record: NodeRecord) -> None:
    """On the membership watch's thread: the event is written on a thread of its own."""
    if ctx.node.record.state is not NodeState.RUNNING:
        return  # a spare does not speak for the job
    members = [n for n, r in ctx.membership.members().items() if r.state is NodeState.RUNNING]
    if min([*members, ctx.node_id]) != ctx.node_id:
        return
    threading.Thread(target=ctx.record, args=(EventKind.SPARE_LOST,), daemon=True, name="eft-spare-lost",
                     kwargs={"node": record.node_id, "host": record.host, "round": record.spare_in}).start()
