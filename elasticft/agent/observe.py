"""The agent's one look at its job: what ``decide`` needs, gathered from where it lives.

Lost nodes come from the membership watch (etcd leases), nodes waiting to join from the
rendezvous, hung ranks from the heartbeats, a finished signal-driven save from the
checkpoint coordinator, a rollback from the numbers check's marker. Gathering is I/O and may wait (a failure is given the
attribution window to be explained by a lost node); deciding is ``decide.py``'s.
"""

from __future__ import annotations

import time
from typing import Callable

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState

from elasticft.agent.checkpoints import CheckpointCoordinator
from elasticft.agent.decide import Observation
from elasticft.agent.hang_monitor import HangMonitor
from elasticft.agent.numerics import NumericsWatch
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.membership import Membership


class Observer:
    def __init__(self, membership: Membership | None, hangs: HangMonitor, ckpt: CheckpointCoordinator,
                 attribution_window: float, worker_pids: Callable[[], set[int]], numerics: NumericsWatch):
        self._membership = membership  # None off the etcd-v3 backend: no leases to watch
        self._hangs = hangs
        self._ckpt = ckpt
        self._window = attribution_window
        self._worker_pids = worker_pids
        self._numerics = numerics

    def look(self, state: WorkerState, worker_group: WorkerGroup) -> Observation:
        """What ``decide`` needs after torch's monitor said ``state``."""
        if state is WorkerState.SUCCEEDED:
            return Observation(state, signal_save=self._ckpt.take_signal_save(),
                               rollback=self._numerics.take_rollback())
        if state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
            return Observation(state, lost=self._explain_failure(worker_group))
        membership = self._membership
        lost = tuple(membership.take_losses()) if membership is not None and membership.lost.is_set() else None
        overruns = ()
        if lost is None and worker_group.workers and state is WorkerState.HEALTHY:
            overruns = tuple(self._hangs.check(self._worker_pids()))
        return Observation(state, lost=lost, overruns=overruns)

    def _explain_failure(self, worker_group: WorkerGroup) -> tuple[NodeRecord, ...] | None:
        """The nodes lost (() for a scale-up) if a membership change explains a failure, else None.

        A lost node is reported by its lease. A worker failure waits up to the
        attribution window for such a report: peers of a dead node fail at once, its
        lease expires later. A failure while nodes wait to join is the scale-up that
        another agent already started (it stopped its workers, ours lost their peers).
        """
        membership = self._membership
        deadline = time.monotonic() + self._window
        while True:
            if membership is not None and membership.lost.is_set():
                return tuple(membership.take_losses())
            # torch caches the rendezvous state for a second: ask again until the deadline.
            if worker_group.spec.rdzv_handler.num_nodes_waiting() > 0:
                return tuple(membership.take_losses()) if membership is not None else ()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if membership is not None:
                membership.lost.wait(min(0.25, remaining))
            else:
                time.sleep(min(0.25, remaining))
