"""What an agent leaves in etcd as it ends: the job's end event, and a closed rendezvous
before its lease goes.

torch's ``launch_agent`` closes the rendezvous after the agent returns, unless a signal
ended the agent (the rendezvous then stays open, for other nodes to scale into). Under
eft-run a node's rendezvous keys live under its record's lease (``round_lease.py``), which
the agent revokes as it ends: a node waiting to join would see the last member's key
vanish and form a round of its own, training a finished job again, before torch closed
the rendezvous. So the agent closes it first, whenever torch would, and also when a
signal ended this agent but the job as a whole ended (its outcome is decided: every rank
saved and stopped, or the restart rule stopped the job): a node waiting to join then
leaves within a second, instead of at its join timeout.
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.multiprocessing import SignalException

from elasticft.agent.context import AgentContext
from elasticft.config import Settings
from elasticft.contract.events import EventKind
from elasticft.rendezvous.backend import close_for_everyone, rendezvous_closed

log = logging.getLogger(__name__)

SIGNALLED = SignalException.__name__  # torch's exception for a signal to the agent (``stopped_by``)


def record_job_end(ctx: AgentContext | None, group: WorkerGroup, settings: Settings, clean: bool,
                   excluded: bool, stopped_by: str | None) -> None:
    """The job's end event: by the rank-0 node when it succeeded, by every node that failed.

    ``stopped_by``: the exception that ended the agent (SignalException for SIGTERM).
    A node that left as a straggler said so in its ``node_excluded`` event.
    """
    if ctx is None or excluded:
        return
    if clean:
        if group.group_rank in (0, None):
            ctx.record(EventKind.JOB_FINISHED)
    else:
        ctx.record(EventKind.JOB_FAILED, state=group.state.name, stopped_by=stopped_by)
    if settings.ft.events_file and (not clean or group.group_rank in (0, None)):
        ctx.events.export(settings.ft.events_file,
                          settings.housekeeping.archive_path(settings.ft.events_file, ctx.keys.run_id))


def close_before_leaving(group: WorkerGroup, excluded: bool, stopped_by: str | None, job_ended: bool) -> None:
    """Close the rendezvous now, while this node's keys still hold it, if the job is over for
    everyone: torch would close it next (the agent was not signalled), or the job's outcome is
    decided. A node that left the job alone (a straggler, a suspect) leaves it open."""
    if excluded or (stopped_by == SIGNALLED and not job_ended):
        return
    close_for_everyone(group.spec.rdzv_handler)


def why_left(handler, excluded: bool) -> str:
    """The one line of a node whose part of the job ended without a failure of its own."""
    if not excluded and rendezvous_closed(handler):
        return "the job ended while this node waited to join (the rendezvous is closed): leaving"
    return "left the rendezvous gracefully; this node's part of the job is over"
