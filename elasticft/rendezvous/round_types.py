"""What a rendezvous round is made of: its limits, the round a node joined, and the two ways a join fails
that torch's errors do not name (``rounds.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.elastic.rendezvous import RendezvousError


class MixedVersionError(RendezvousError):
    """An agent of the old (pickled-state) etcd-v3 backend shares this run."""


class OddOneOut(RendezvousError):
    """``join``'s ``leave_if`` said so while joining round ``number`` (``rendezvous/aside.py``)."""

    def __init__(self, number: int):
        super().__init__(f"left round {number}: the nodes standing aside cannot reach this one")
        self.number = number


@dataclass(frozen=True)
class RoundLimits:
    min_nodes: int
    max_nodes: int
    last_call: float  # seconds to wait for more nodes once min_nodes are there
    join_timeout: float  # seconds a node may wait for a round to form


@dataclass(frozen=True)
class Round:
    number: int
    rank: int
    size: int
    revision: int  # the participants are the keys that existed at this revision
    # With segments (decision.py): the participants the round left out (they wait as spares),
    # and how many members each domain has; None and {} without segments.
    left_out: tuple[str, ...] | None = None
    domains: dict[str, int] = field(default_factory=dict, compare=False)
    first: str | None = None  # the participant of rank 0 (its bootstrap store is the round's)
