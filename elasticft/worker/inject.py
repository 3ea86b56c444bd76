"""The worker side of ``--eft-inject``: the targeted rank breaks itself on cue.

See ``elasticft.contract.faults`` for the spec. Workers call
``FaultInjector.after_iteration(i)`` once per iteration, and pass each loss they compute
through ``FaultInjector.loss(i, loss)``; only the target acts, once per agent (a repeating
fault, ``@I*``, every time iteration I is reached).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

from elasticft.contract.faults import LOSS_FAULTS, Fault, FaultKind, parse_faults
from elasticft.contract.run_dir import (
    DEGRADE_MARKER,
    FIRED_PREFIX,
    WorkerEnv,
    write_atomically,
)


class FaultInjector:
    """The worker side: call ``after_iteration`` every iteration on every rank."""

    def __init__(self, faults: list[Fault], run_dir: str | None, rank: int, local_rank: int, group_rank: int):
        self._faults = [f for f in faults if self._targets(f, rank, local_rank, group_rank)]
        self._run_dir = Path(run_dir) if run_dir else None
        self._local_rank = local_rank

    @classmethod
    def from_env(cls) -> "FaultInjector":
        env = os.environ
        return cls(
            parse_faults(env.get(WorkerEnv.INJECT, "")),
            env.get(WorkerEnv.RUN_DIR),
            int(env.get("RANK", "0")),
            int(env.get("LOCAL_RANK", "0")),
            int(env.get("GROUP_RANK", "0")),
        )

    @staticmethod
    def _targets(fault: Fault, rank: int, local_rank: int, group_rank: int) -> bool:
        if fault.kind is FaultKind.NODE_LOST:  # one worker of the node pulls the plug
            return fault.target == group_rank and local_rank == 0
        if fault.kind in (FaultKind.REPLICA_CORRUPT, FaultKind.REPLICA_SLOW):  # the agent's (elasticft.agent.memory)
            return False
        return fault.target == rank

    def copy_slow_from(self) -> int | None:
        """The iteration from which this rank's memory snapshots copy slowly (``copy_slow``), or None."""
        if self._run_dir is None:
            return None
        return min((f.iteration for f in self._faults if f.kind is FaultKind.COPY_SLOW), default=None)

    @property
    def acts_on_losses(self) -> bool:
        """Whether this rank has a fault that ``loss()`` applies (nan, poison, corrupt)."""
        return self._run_dir is not None and any(f.kind in LOSS_FAULTS for f in self._faults)

    def after_iteration(self, iteration: int, *, in_step: bool = False) -> None:
        """The faults due after ``iteration``. A loop that reaches into its steps passes
        ``in_step=True`` and calls ``in_step(iteration)`` from the next step: its hung rank
        then hangs mid-step, as a real one does, holding its peers in the step's collectives."""
        if self._run_dir is None:
            return
        for fault in self._faults:
            if fault.iteration != iteration or fault.kind in LOSS_FAULTS or fault.kind is FaultKind.COPY_SLOW:
                continue
            if in_step and fault.kind is FaultKind.RANK_HUNG:
                continue
            if self._first_time(fault):
                getattr(self, "_" + fault.kind.value)()

    def in_step(self, iteration: int) -> None:
        """Inside the step that follows ``iteration``: a ``rank_hung`` fault due after it hangs here."""
        if self._run_dir is None:
            return
        for fault in self._faults:
            if fault.kind is FaultKind.RANK_HUNG and fault.iteration == iteration and self._first_time(fault):
                self._rank_hung()

    def loss(self, iteration: int, loss):
        """``loss`` (a tensor) as the step that makes ``iteration`` computes it on this rank."""
        if self._run_dir is None:
            return loss
        for fault in self._faults:
            if fault.kind is FaultKind.CORRUPT and iteration >= fault.iteration:
                loss = loss * random.uniform(100.0, 1000.0)
            elif fault.iteration != iteration:
                continue
            elif fault.kind is FaultKind.POISON or (fault.kind is FaultKind.NAN and self._first_time(fault)):
                loss = loss * float("nan")
        return loss

    def _first_time(self, fault: Fault) -> bool:
        """True once per node (a repeating fault, ``@I*``: every time): a marker remembers it fired."""
        marker = self._run_dir / f"{FIRED_PREFIX}{fault.name}"
        if marker.exists() and not fault.repeat:
            return False
        marker.touch()
        return True

    def _gpu_degrade(self) -> None:
        write_atomically(self._run_dir / DEGRADE_MARKER, str(self._local_rank))

    @staticmethod
    def _rank_killed() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _rank_hung() -> None:
        while True:  # alive, silent, holding its peers in the next collective
            time.sleep(3600)

    @staticmethod
    def _node_lost() -> None:
        import psutil

        agent = psutil.Process(os.getppid())
        # Frozen first, as a dead node's agent: else it could see the workers killed before it
        # exit and tell its peers (its record) that its workers failed, not that it was lost.
        # (Killed first, its workers' death signal could end this one before their helpers.)
        agent.suspend()
        victims = agent.children(recursive=True) + [agent]
        for process in victims:
            if process.pid != os.getpid():
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
        os.kill(os.getpid(), signal.SIGKILL)
