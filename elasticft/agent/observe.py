"""The agent's one look at its job: what ``decide`` needs, gathered from where it lives.

Lost nodes come from the membership watch (etcd leases; this node's own record among the
losses, or its lease found expired, means it was fenced off), so do members whose workers of
this round failed (their records say which round: ``dead_peers.py``), nodes waiting to join from the
rendezvous, hung ranks from the heartbeats, a finished signal-driven save from the
checkpoint coordinator, a rollback from the numbers check's marker. Gathering is I/O and may wait (a failure is given the
attribution window to be explained by a lost node); deciding is ``decide.py``'s.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Mapping
from typing import Callable

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elasticft.agent.checkpoints import CheckpointCoordinator
from elasticft.agent.decide import Observation
from elasticft.agent.hang_monitor import HangMonitor
from elasticft.agent.numerics import NumericsWatch
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import Membership, NodeLease


# Deaths dealt only by a process's own fault, the kernel or a person (a crash, the OOM killer,
# kill -9), never by a peer that vanished: a rank in a collective with a dead peer exits with an
# error, or aborts (SIGABRT: NCCL's watchdog), and those still wait for the lost node.
SELF_INFLICTED = frozenset({signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})


def no_lost_node_explains(nodes: int | None, failures: Mapping[int, ProcessFailure]) -> bool:
    """A failure no lost node can explain, which needs no grace: the round is one node (no
    peer node to lose), or the first worker here to fail died of its own crash or a kill
    (``SELF_INFLICTED``). Only the first: torch's report lists the workers it then stopped too,
    and those it SIGKILLs (``torch_seam.failure_kills_the_rest``) were killed for the first."""
    if nodes == 1:
        return True
    if not failures:
        return False
    first = min(failures.values(), key=lambda f: f.timestamp)
    return first.exitcode < 0 and -first.exitcode in SELF_INFLICTED


class Observer:
    def __init__(self, membership: Membership | None, node: NodeLease | None, hangs: HangMonitor,
                 ckpt: CheckpointCoordinator, attribution_window: float, worker_pids: Callable[[], set[int]],
                 numerics: NumericsWatch, must_fence: Callable[[], bool] = lambda: False,
                 current_round: Callable[[], int | None] = lambda: None,
                 end_gone: Callable[[int], list[str]] | None = None):
        self._membership = membership  # None off the etcd-v3 backend: no leases to watch
        self._node = node  # this node's own record and lease (None off etcd-v3)
        self._hangs = hangs
        self._ckpt = ckpt
        self._window = attribution_window
        self._worker_pids = worker_pids
        self._numerics = numerics
        self._must_fence = must_fence  # cut off from etcd alone: stop the workers before the lease expires
        self._round = current_round  # the rendezvous round this node's workers run in (None: none yet)
        self._end_gone = end_gone  # asks the round's neighbours whether their agents are gone (gone_agents.py)

    def look(self, state: WorkerState, worker_group: WorkerGroup,
             failures: Mapping[int, ProcessFailure] | None = None) -> Observation:
        """What ``decide`` needs after torch's monitor said ``state`` (``failures``: its workers' exits)."""
        if state is WorkerState.SUCCEEDED:
            return Observation(state, signal_save=self._ckpt.take_signal_save(),
                               rollback=self._numerics.take_rollback())
        if state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
            lost, fenced = self._own_loss(self._explain_failure(worker_group, failures or {}))
            return Observation(state, lost=lost, fenced=fenced or self.fenced(), failed_peers=self.failed_peers())
        membership = self._membership
        lost = tuple(membership.take_losses()) if membership is not None and membership.lost.is_set() else None
        lost, fenced = self._own_loss(lost)
        fenced = fenced or self._must_fence()
        overruns = ()
        failed_peers = self.failed_peers()
        if lost is None and not failed_peers and not fenced and worker_group.workers and state is WorkerState.HEALTHY:
            overruns = tuple(self._hangs.check(self._worker_pids()))
        return Observation(state, lost=lost, overruns=overruns, fenced=fenced, failed_peers=failed_peers)

    def failed_peers(self) -> tuple[NodeRecord, ...]:
        """The other members whose records say their workers of this node's round failed (from the
        membership watch: no request)."""
        membership, node = self._membership, self._node
        round_ = self._round() if membership is not None and node is not None else None
        if round_ is None:
            return ()
        return tuple(r for r in membership.failed_in(round_) if r.node_id != node.record.node_id)

    def _own_loss(self, lost: tuple[NodeRecord, ...] | None) -> tuple[tuple[NodeRecord, ...] | None, bool]:
        """The losses without this node's own record, and whether this node was fenced off:
        its record vanished from etcd, or etcd said its lease expired."""
        node = self._node
        if node is None:
            return lost, False
        fenced = node.lease.lost.is_set()
        if lost:
            others = tuple(r for r in lost if r.node_id != node.record.node_id)
            if len(others) < len(lost):
                fenced, lost = True, others or None
        return lost, fenced

    def fenced(self) -> bool:
        """This node is, or may be, fenced off: etcd said its lease expired, or has not confirmed
        it for longer than its TTL. Asked before a restart torch starts on its own (nodes wait to
        join): a node that thaws sees the waiting nodes before it hears that its lease expired."""
        node = self._node
        return node is not None and (node.lease.lost.is_set() or self._cut_off() or self._must_fence())

    def _cut_off(self) -> bool:
        """No refresh of this node's lease reached etcd for longer than its TTL: etcd may have
        let it expire, and then the others went on without this node, which explains why its
        workers failed (their peers were restarted). Taken as fenced off, not as a failure to
        charge: the rendezvous finds out when etcd answers again (an etcd restart keeps leases)."""
        node = self._node
        return node is not None and time.monotonic() - node.lease.refreshed_at > node.lease.ttl

    def _explain_failure(self, worker_group: WorkerGroup,
                         failures: Mapping[int, ProcessFailure]) -> tuple[NodeRecord, ...] | None:
        """The nodes lost (() for a scale-up) if a membership change explains a failure, else None.

        A lost node is reported by its lease. A worker failure waits up to the
        attribution window for such a report: peers of a dead node fail at once, its
        lease expires later. A failure while nodes wait to join is the scale-up that
        another agent already started (it stopped its workers, ours lost their peers).
        A failure no lost node can explain (``no_lost_node_explains``) does not wait. One that
        waits first asks whether a neighbour's agent is gone: its lease then ends at once.
        """
        membership = self._membership
        deadline = time.monotonic() + self._window
        asked = self._end_gone is None
        while True:
            if self.fenced():
                return None  # fenced off: told by ``_own_loss`` and ``_cut_off``
            if membership is not None and (membership.lost.is_set() or self.failed_peers()):
                return tuple(membership.take_losses())
            # torch caches the rendezvous state for a second: ask again until the deadline.
            if worker_group.spec.rdzv_handler.num_nodes_waiting() > 0:
                return tuple(membership.take_losses()) if membership is not None else ()
            remaining = deadline - time.monotonic()
            if remaining <= 0 or no_lost_node_explains(worker_group.group_world_size, failures):
                return None
            if not asked and (round_ := self._round()) is not None:
                asked = True
                self._end_gone(round_)  # a lease ended reaches ``lost`` through the membership watch
            if membership is not None:
                membership.lost.wait(min(0.25, remaining))
            else:
                time.sleep(min(0.25, remaining))
