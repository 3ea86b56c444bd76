"""The records eft keeps in etcd, as both their writers and their readers know them.

* ``NodeRecord`` (``nodes/<node_id>``, under the node's lease) and ``NodeState``;
  ``apply_node_events`` is the one rule for "a node was lost", shared by the agent's
  membership watch and ``eft top``;
* ``CheckpointRequest`` (``ckpt/request``), relayed unchanged to the workers as
  ``request.json``, and ``RequestReason``;
* ``layout_record`` (``layout``): one rendezvous round and its plan;
* ``JoinHold`` (``rdzv/ctl/held/<r>``): the members hold the nodes waiting to join until a
  checkpoint (``--eft-join-at save``), and ``LetIn``, why they let them in.
"""

from __future__ import annotations

import enum
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Protocol

from elasticft import __version__
from elasticft.contract.json_object import json_object

log = logging.getLogger(__name__)


class NodeState(enum.StrEnum):
    """What a node's record says about it; a deleted record not ``EXITED`` is a lost node."""

    RUNNING = "running"
    EXITED = "exited"  # left cleanly after its workers finished
    EXCLUDED = "excluded"  # leaving the job as a straggler (--eft-straggler-action exclude)
    # Waiting to take a lost member's place: the round before the one it waits in formed full
    # (``--nnodes``'s MAX; torch's redundancy list). Its loss is no member's: the job goes on.
    SPARE = "spare"


# NodeRecord.attempt of a launch under torchrun's default run id: this, then the command's digest.
# An attempt that does not start so names a job (SLURM's, a JobSet's): its outcome is its own.
COMMAND_ATTEMPT = "cmd-"


@dataclass
class NodeRecord:
    """The value of ``nodes/<node_id>``.

    ``rdzv_addr`` and ``pid`` are how torch's dynamic rendezvous names this agent
    (a node descriptor is ``addr_pid_localid``), so a lost lease can be matched to
    the rendezvous participant it belonged to.
    """

    node_id: str
    host: str
    rdzv_addr: str
    pid: int
    gpus: list[int] = field(default_factory=list)
    version: str = __version__
    state: NodeState = NodeState.RUNNING
    started: float = field(default_factory=time.time)
    domain: str = ""  # failure domain (--eft-node-label): memory checkpoint replicas go to other domains
    # the launch it belongs to: SLURM "<job>.r<restart>", a JobSet's "<name>.<uid>.r<restart>";
    # run id 'none': COMMAND_ATTEMPT + the command's digest
    attempt: str = ""
    beacon: str = ""  # host:port where the agent tells peers how long etcd has been silent (agent/fence.py)
    metrics: str = ""  # host:port of the agent's Prometheus /metrics ("": off; `eft metrics targets`)
    # The rendezvous round whose workers on this node last failed (-1: none): that round's other
    # members are waiting on dead ranks, and stop theirs with SIGKILL (agent/dead_peers.py).
    failed_round: int = -1
    # The rendezvous round a spare (state ``spare``) waits in (-1: not a spare). The members of
    # an earlier round lose nothing when it goes; a member of that round or a later one does.
    spare_in: int = -1
    segment: str = ""  # the domain of this node's segment (--eft-segment; "": no segments)

    def __post_init__(self) -> None:
        self.state = NodeState(self.state)

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # a StrEnum state is written as its value

    @classmethod
    def from_json(cls, data: bytes | str) -> "NodeRecord":
        """Raises ValueError or TypeError on a malformed record (unknown fields are ignored)."""
        raw = json.loads(data)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**known)

    @property
    def rdzv_identity(self) -> tuple[str, int]:
        return (self.rdzv_addr, self.pid)


class KeyEvent(Protocol):
    """A watch event as the store reports it (``elasticft.store.WatchEvent``)."""

    key: str
    value: bytes
    deleted: bool


def store_node_record(records: dict[str, NodeRecord], prefix: str, key: str, value: bytes) -> None:
    """Put the record at ``key`` into ``records`` by node id; a malformed one is logged and skipped."""
    try:
        records[key[len(prefix):]] = NodeRecord.from_json(value)
    except (ValueError, TypeError) as exc:
        log.warning("ignoring malformed node record %s: %s", key, exc)


def apply_node_events(records: dict[str, NodeRecord], prefix: str, events: Iterable[KeyEvent]) -> list[NodeRecord]:
    """Apply watch events on ``prefix`` (``nodes/``) to ``records``; return the nodes lost.

    A deleted record that was not marked ``exited`` is a lost node: its lease expired
    or was revoked without a clean exit. The agent and ``eft top`` share this rule.
    """
    lost = []
    for event in events:
        if not event.deleted:
            store_node_record(records, prefix, event.key, event.value)
            continue
        record = records.pop(event.key[len(prefix):], None)
        if record is not None and record.state is not NodeState.EXITED:
            lost.append(record)
    return lost


class RequestReason(enum.StrEnum):
    """Why a checkpoint request was made (``ckpt/request``'s ``reason``)."""

    RISK = "risk"  # a GPU's risk score crossed the threshold; the gap rule may skip it
    MANUAL = "manual"  # ``eft ckpt save`` or the save switch
    SIGNAL = "signal"  # a preemption signal reached an agent
    WATCHDOG = "watchdog"  # host or GPU memory about to run out


@dataclass(frozen=True)
class CheckpointRequest:
    """The value of ``ckpt/request``, and of the ``request.json`` the agents relay it as.

    ``exit`` asks the ranks to stop after saving; ``risk`` is the requesting GPU's
    score for a risk request. ``reason`` stays a string on the workers' side: a newer
    agent may send a reason this worker does not know, which it treats as a request.
    """

    id: str
    reason: str
    requester: str = ""
    exit: bool = False
    risk: float | None = None
    time: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str | dict[str, Any]) -> "CheckpointRequest":
        """Raises ValueError (TypeError for a number of the wrong type) on a malformed record."""
        record = json_object(data)
        if not isinstance(record.get("id"), str) or not record["id"]:
            raise ValueError(f"'id' must be a non-empty string, got {record.get('id')!r}")
        if not isinstance(record.get("reason"), str):
            raise ValueError(f"'reason' must be a string, got {record.get('reason')!r}")
        risk = record.get("risk")
        return cls(
            id=record["id"],
            reason=str(record["reason"]),
            requester=str(record.get("requester", "")),
            exit=bool(record.get("exit", False)),
            risk=None if risk is None else float(risk),
            time=float(record.get("time") or 0.0),
        )


class PlanLike(Protocol):
    """What ``layout_record`` reads of a plan (``elasticft.planner.Plan``)."""

    world: int
    tp: int
    pp: int
    dp: int
    used: int
    spare: list[int]
    spare_nodes: list[int]
    used_per_node: list[int]
    reason: str


def layout_record(chosen: PlanLike | None, round_id: int, world_size: int | None = None) -> str:
    """The value of ``/eft/<run>/layout``: one rendezvous round and its plan.

    ``chosen`` is None for a job the planner does not plan (no Megatron model
    arguments): the record then gives the round's ``world_size`` and no TP/PP/DP.
    """
    if chosen is None:
        plan_fields = {"world_size": world_size, "tp": None, "pp": None, "dp": None, "used": world_size,
                       "spare": [], "spare_nodes": [], "used_per_node": None,
                       "reason": "no Megatron model arguments: not planned"}
    else:
        plan_fields = {"world_size": chosen.world, "tp": chosen.tp, "pp": chosen.pp, "dp": chosen.dp,
                       "used": chosen.used, "spare": chosen.spare, "spare_nodes": chosen.spare_nodes,
                       "used_per_node": chosen.used_per_node, "reason": chosen.reason}
    return json.dumps({**plan_fields, "round": round_id})


class LetIn(enum.StrEnum):
    """Why the members let the nodes waiting to join in (``JoinHold.let_in``)."""

    CHECKPOINT = "checkpoint"  # a checkpoint of either tier newer than the hold's ``after`` is complete
    WAITED = "waited"  # none came within ``--eft-join-wait`` seconds


@dataclass(frozen=True)
class JoinHold:
    """The value of ``rdzv/ctl/held/<r>``: the members of round ``r - 1`` hold the nodes that
    wait in round ``r`` until the next checkpoint, at most ``wait`` seconds.

    Created once (if absent) by the member that saw them first, under its lease; that member
    (``by``) watches the checkpoints and rewrites the record with ``let_in`` when it lets them
    in, which every member and the waiting nodes see in the control keys they watch anyway.
    ``after`` is the newest complete checkpoint (either tier) when the hold began (None: none).
    """

    by: str
    waiting: str  # the first waiting node, as the rendezvous names it
    after: int | None
    wait: float
    let_in: str | None = None  # a LetIn once they are let in
    iteration: int | None = None  # the checkpoint they were let in at

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> "JoinHold":
        """Raises ValueError (TypeError for a field of the wrong type) on a malformed record."""
        record = json_object(data)
        after, iteration = record.get("after"), record.get("iteration")
        return cls(by=str(record["by"]), waiting=str(record.get("waiting", "")),
                   after=None if after is None else int(after), wait=float(record["wait"]),
                   let_in=record.get("let_in"), iteration=None if iteration is None else int(iteration))
