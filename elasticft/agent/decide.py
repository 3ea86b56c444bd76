"""The monitor's decision: what one look at the workers and the job calls for.

torch's agent asks ``_monitor_workers`` every ``--monitor-interval`` what state the
workers are in, and restarts them (charging ``--max-restarts``) when they failed. eft
looks at more than the worker processes: lost nodes, nodes waiting to join, ranks
that overran a section timeout, a ``--eft-ckpt-mode signal`` save. The agent gathers
those into an ``Observation``; ``decide`` is the pure rule that turns it into a
``Decision``, tested on its own without an agent or processes.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field

from torch.distributed.elastic.agent.server.api import WorkerState

from elasticft.contract.records import NodeRecord


class Verdict(enum.Enum):
    REPORT = "report"  # hand torch's own result back (healthy, finished, or a failure it charges)
    HANG = "hang"  # report a failure for the hung ranks: torch restarts, charged to --max-restarts
    RESTART = "restart"  # restart through a new rendezvous now, not charged; report healthy


class RestartReason(enum.StrEnum):
    """The ``reason`` of a ``restart`` event."""

    WORKER_FAILED = "worker_failed"  # a worker exited with an error (torch's restart, charged)
    MEMBERSHIP = "membership"  # a node was lost, or nodes wait to join (not charged)
    HANG = "hang"  # a rank overran its section timeout (charged)
    SIGNAL_SAVE = "signal_save"  # workers saved and exited because the agent asked (not charged)
    ROLLBACK = "rollback"  # workers stopped on bad numbers, to re-run from the last good state (not charged)
    FENCED = "fenced"  # etcd let this node's own lease expire: the others went on without it (not charged)


@dataclass(frozen=True)
class Observation:
    """What the agent saw in one look.

    ``lost`` is None when no membership change explains what happened, a list of the
    nodes lost otherwise (empty when the change is nodes waiting to join). ``overruns``
    (hung ranks) are looked for only while the workers are healthy.
    """

    state: WorkerState
    lost: tuple[NodeRecord, ...] | None = None
    overruns: tuple = ()
    signal_save: bool = False
    rollback: bool = False  # the workers exited to re-run a bad iteration (elasticft.worker.numerics)
    fenced: bool = False  # this node's own lease expired (it was frozen, or cut from etcd, too long)
    # Live members whose workers of this round failed (their records say so): ranks here wait on dead peers.
    failed_peers: tuple[NodeRecord, ...] = ()


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: RestartReason = RestartReason.WORKER_FAILED
    # How the workers are stopped: SIGTERM lets them save; a rank with a dead peer (a lost
    # node, a member whose workers failed) or a hung rank would never act on it: SIGKILL.
    stop_signal: signal.Signals = signal.SIGTERM
    lost: tuple[NodeRecord, ...] = field(default=())
    failed_peers: tuple[NodeRecord, ...] = field(default=())


REPORT = Decision(Verdict.REPORT)
FENCED = Decision(Verdict.RESTART, RestartReason.FENCED, signal.SIGKILL)


def decide(seen: Observation) -> Decision:
    """The rule, in order: this node fenced off first (the job went on without it: its
    workers must stop before they touch anything the new round owns, and no save of theirs
    can complete), then a membership change or a member's failed workers (its peers' stalls
    and failures are their consequences), then a hang, then a signal-driven save or a
    rollback; else torch's own result."""
    if seen.fenced and seen.state is not WorkerState.SUCCEEDED:
        return FENCED
    if (seen.lost is not None or seen.failed_peers) and seen.state is not WorkerState.SUCCEEDED:
        kill = bool(seen.lost) or bool(seen.failed_peers)  # a dead peer: the collectives cannot finish a save
        return Decision(Verdict.RESTART, RestartReason.MEMBERSHIP,
                        signal.SIGKILL if kill else signal.SIGTERM, tuple(seen.lost or ()), seen.failed_peers)
    if seen.state is WorkerState.HEALTHY and seen.overruns:
        return Decision(Verdict.HANG, RestartReason.HANG, signal.SIGKILL)
    if seen.state is WorkerState.SUCCEEDED and seen.signal_save:
        return Decision(Verdict.RESTART, RestartReason.SIGNAL_SAVE)
    if seen.state is WorkerState.SUCCEEDED and seen.rollback:
        return Decision(Verdict.RESTART, RestartReason.ROLLBACK)
    return REPORT


def torchs_restart(pending: Decision, state: WorkerState, failed_peers: tuple[NodeRecord, ...]) -> Decision:
    """The decision a restart torch starts on its own (``pending`` is REPORT) stops the workers by.

    torch restarts a healthy group when nodes wait to join. When one of them is a member of
    this round whose workers failed (its agent restarts them and joins the next round), the
    ranks here wait on dead peers and get SIGKILL, as for a lost node; a join of a new node
    keeps SIGTERM (the workers are all alive: they save and exit)."""
    if pending is not REPORT or not failed_peers:
        return pending
    return Decision(Verdict.RESTART, restart_reason(pending, state), signal.SIGKILL, failed_peers=failed_peers)


def restart_reason(pending: Decision, state: WorkerState) -> RestartReason:
    """Why the workers restart now: the monitor's decision, or else torch's own reason.

    torch restarts on its own in two cases: after a failure it charged (the group is
    FAILED or UNHEALTHY), and when nodes wait to join a healthy group (a scale-up).
    """
    if pending is not REPORT:
        return pending.reason
    return RestartReason.MEMBERSHIP if state is WorkerState.HEALTHY else RestartReason.WORKER_FAILED
