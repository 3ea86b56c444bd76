"""Fault injection for demos and tests: ``--eft-inject`` / ``EFT_INJECT``.

A comma-separated list of ``KIND:TARGET@ITERATION``:

* ``gpu_degrade:RANK@I`` — after iteration I, the GPU of global rank RANK starts to fail:
  its node's health sampler reads an uncorrectable ECC error and Xid 79 for it from
  then on (a critical event: risk 1.0), so the node asks for an emergency checkpoint;
* ``rank_killed:RANK@I`` — after iteration I, rank RANK dies (SIGKILL);
* ``rank_hung:RANK@I`` — after iteration I, rank RANK stops making progress;
* ``node_lost:NODE@I`` — after iteration I, the node whose agent has group rank NODE
  dies: its agent and all of its workers are SIGKILLed;
* ``replica_corrupt:NODE@I`` — at the first start of the workers after iteration I, the
  agent with group rank NODE flips one byte of the newest memory checkpoint replica it
  holds, before it prepares the restore (memory gone bad at rest);
* ``replica_slow:NODE@I`` — from the first start of the workers on, the agent with group
  rank NODE holds every replica file of iteration I or later that a peer pushes to it for
  ``REPLICA_SLOW_SECONDS`` before it stores it (replication slower than the snapshots);
* ``copy_slow:RANK@I`` — from iteration I on, every memory snapshot of rank RANK takes
  ``COPY_SLOW_SECONDS`` longer to copy into host memory (a slow device-to-host link: the
  next iteration's forward and backward run during the copy, unless it blocks);
* ``nan:RANK@I`` — the loss rank RANK computes in the step that makes iteration I is NaN,
  once (a transient fault: the re-run is clean);
* ``poison:RANK@I`` — the same, every time that step runs (bad data: the re-run gives the
  same NaN, and the batch is skipped);
* ``corrupt:RANK@I`` — from iteration I on, every loss rank RANK computes is multiplied by
  a random factor between 100 and 1000 (a GPU that computes garbage: every re-run differs).

The loss faults act inside the training step (``FaultInjector.loss``), on a rank that
computes a loss (the last pipeline stage); the others after the iteration.

Workers call ``FaultInjector.after_iteration(i)`` once per iteration; only the target
acts. Each fault fires once per agent: a marker in the node's run directory remembers
it, so re-done iterations after a restart do not fire it again. A ``*`` after the
iteration makes a worker's fault repeat: ``rank_killed:1@8*`` kills rank 1 every time
it reaches iteration 8, after every restart (a job that can never get past a point, for
``--eft-max-no-progress-restarts``); only ``rank_killed`` and ``rank_hung`` repeat. Without ``EFT_RUN_DIR``
(not under eft-run) nothing fires. The worker side is ``elasticft.worker.inject.FaultInjector``; the agent side of
``gpu_degrade`` is ``elasticft.health.injected.InjectedGpuSource``. They meet in the run
directory (``DEGRADE_MARKER``, ``FIRED_PREFIX``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class FaultKind(enum.StrEnum):
    """What an injected fault does (the module's docstring says how)."""

    GPU_DEGRADE = "gpu_degrade"
    RANK_KILLED = "rank_killed"
    RANK_HUNG = "rank_hung"
    NODE_LOST = "node_lost"
    REPLICA_CORRUPT = "replica_corrupt"
    REPLICA_SLOW = "replica_slow"
    COPY_SLOW = "copy_slow"
    NAN = "nan"
    POISON = "poison"
    CORRUPT = "corrupt"


REPLICA_SLOW_SECONDS = 0.5  # replica_slow: how long the slow agent holds each replica file it receives
COPY_SLOW_SECONDS = 1.0  # copy_slow: how much longer each memory snapshot's copy into host memory takes
LOSS_FAULTS = frozenset({FaultKind.NAN, FaultKind.POISON, FaultKind.CORRUPT})  # act in FaultInjector.loss


KINDS = tuple(kind.value for kind in FaultKind)
_SPEC = re.compile(r"^(?P<kind>[a-z_]+):(?P<target>\d+)@(?P<iteration>\d+)(?P<repeat>\*?)$")
REPEATABLE = (FaultKind.RANK_KILLED, FaultKind.RANK_HUNG)  # faults a worker acts out: they can recur


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    target: int
    iteration: int
    repeat: bool = False  # fires every time the iteration is reached (``@I*``), not once per agent

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.target}-{self.iteration}"


class FaultSpecError(ValueError):
    """A malformed fault list; the message says what was expected. ``FTConfig`` names the flag."""


def parse_faults(spec: str) -> list[Fault]:
    """``gpu_degrade:2@8,node_lost:1@10,rank_killed:1@8*`` -> faults; a clear FaultSpecError otherwise."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = _SPEC.match(item)
        if not match or match["kind"] not in KINDS:
            raise FaultSpecError(f"expected KIND:TARGET@ITERATION[*] with KIND one of {', '.join(KINDS)}, got {item!r}")
        kind, repeat = FaultKind(match["kind"]), bool(match["repeat"])
        if repeat and kind not in REPEATABLE:
            raise FaultSpecError(f"only {' and '.join(REPEATABLE)} can repeat (@ITERATION*), got {item!r}")
        faults.append(Fault(kind, int(match["target"]), int(match["iteration"]), repeat))
    return faults
