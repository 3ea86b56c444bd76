"""What ``eft top`` knows about a run: its etcd records, parsed, at one moment.

``RunMirror`` (mirror.py) fills a ``RunState`` from etcd; ``build_view`` (view.py)
turns it into what to show. Keeping the two apart lets the view be a pure
function that tests can feed by hand-written states as well as by a real etcd.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elasticft.contract.records import NodeRecord


@dataclass(frozen=True)
class Record:
    """One key's parsed JSON value (None when malformed) and its etcd mod_revision.

    Revisions are etcd's global write counter, so comparing two records' revisions
    says which was written last without trusting any machine's clock.
    """

    value: Any
    revision: int


@dataclass(frozen=True)
class LostNode:
    """A node whose record the watch saw deleted without a clean exit."""

    record: NodeRecord
    seen_at: float  # the viewer's clock when the delete arrived
    revision: int
    last_health: dict[int, dict] = field(default_factory=dict)  # gpu -> its last health record


@dataclass
class RunState:
    run_id: str
    nodes: dict[str, NodeRecord] = field(default_factory=dict)  # records present in nodes/
    health: dict[tuple[str, int], dict] = field(default_factory=dict)  # (node, gpu) -> health record
    layout: Record | None = None
    started: float | None = None
    ckpt_request: Record | None = None
    acks: dict[str, dict] = field(default_factory=dict)  # request id -> ack record
    filtered: dict[str, dict] = field(default_factory=dict)  # request id -> filter record
    latest: dict | None = None
    restarts: dict | None = None  # the job-wide restart record (contract.restarts.RestartRecord)
    memory_parts: list[dict] = field(default_factory=list)  # the memory tier's index (contract.memory.MemPart)
    events: list[Record] = field(default_factory=list)  # oldest first
    lost_seen: dict[str, LostNode] = field(default_factory=dict)  # only a watching viewer has these
    # (timestamp, C) of the samples this viewer saw per GPU, oldest first: the trend
    temperatures: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)
    xids_seen: dict[tuple[str, int], set[int]] = field(default_factory=dict)  # since the viewer started
    watch_error: str | None = None  # the watch broke and is being re-established

    @property
    def exists(self) -> bool:
        """Whether etcd holds anything of this run at all."""
        return bool(
            self.nodes or self.health or self.layout or self.started is not None or self.ckpt_request
            or self.acks or self.latest or self.events or self.lost_seen
        )
