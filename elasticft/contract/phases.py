"""The phases of a restart: from a failure to the next generation's first step (``eft report``).

Each phase is named by what it does and recorded as the unix time it *ended*, by whoever
sees that moment (one map, phase -> time, per node and generation):

* the job's event log: ``detection`` ends at the first ``restart``, ``node_lost`` or
  ``hang`` event after the failure's last heartbeat; ``stop`` at each node's
  ``workers_stopped`` event;
* the agent (``elasticft.agent.segments.StopRecorder``): ``rendezvous`` ends when the
  round formed (torch hands the agent its rank), ``replan`` when the round's ranks and
  layout are assigned, ``spawn`` when the worker processes are started;
* the worker's heartbeat (``elasticft.worker.phases``): ``imports`` ends when the script
  calls ``init_process_group`` (its imports done), ``process_group`` when that returns,
  ``load`` when the newest state is loaded (from memory, disk or none, and its size);
* ``first_step``: the heartbeat's first step (``ProgressRecord.first_step``).

The agent's and the worker's ends travel in the generation's own ``workers_stopped``
event (field ``phases``), so measuring them costs etcd nothing per step. A worker without
eft's hook records none of its own: those phases are absent, not zero.
"""

from __future__ import annotations

import enum


class RestartPhase(enum.StrEnum):
    """The phases of a restart, in the order they run."""

    DETECTION = "detection"
    STOP = "stop"
    RENDEZVOUS = "rendezvous"
    REPLAN = "replan"
    SPAWN = "spawn"
    IMPORTS = "imports"
    PROCESS_GROUP = "process_group"
    LOAD = "load"
    FIRST_STEP = "first_step"


ORDER = tuple(RestartPhase)
AGENT_PHASES = (RestartPhase.RENDEZVOUS, RestartPhase.REPLAN, RestartPhase.SPAWN)
WORKER_PHASES = (RestartPhase.IMPORTS, RestartPhase.PROCESS_GROUP, RestartPhase.LOAD)

PHASE_HELP = {
    RestartPhase.DETECTION: "the failure's last heartbeat to the job acting on it",
    RestartPhase.STOP: "stopping the workers on every node",
    RestartPhase.RENDEZVOUS: "the new rendezvous round, up to its forming",
    RestartPhase.REPLAN: "ranks and layout of the new round (the re-plan)",
    RestartPhase.SPAWN: "starting the worker processes",
    RestartPhase.IMPORTS: "the interpreter's start and the script's imports, up to init_process_group",
    RestartPhase.PROCESS_GROUP: "init_process_group, up to its return",
    RestartPhase.LOAD: "loading the newest state (memory or disk)",
    RestartPhase.FIRST_STEP: "the first training step",
}


class LoadTier(enum.StrEnum):
    """Where a generation's state came from."""

    MEMORY = "memory"
    DISK = "disk"
    NONE = "none"  # nothing to load: training started from scratch


def stamps_from_json(value) -> dict[RestartPhase, float]:
    """A record's ``phases`` field; unknown phases and non-numbers are dropped (newer or broken writers)."""
    stamps = {}
    for name, when in (value.items() if isinstance(value, dict) else ()):
        if name in ORDER and isinstance(when, (int, float)) and not isinstance(when, bool):
            stamps[RestartPhase(name)] = float(when)
    return stamps
