"""How the members of a formed round learn that one of them is gone.

Alone (torchrun with eft's backend), a node watches its round's participant keys from
the revision the round formed at (``ParticipantWatch``): a key that vanishes is a member
lost, or a member that stood aside. Under eft's agent, which watches every node's record
already (``membership.py``), the rendezvous opens no second watch on the same nodes
(``AgentLosses``): a lost member is a loss the agent's membership watch saw, and a member
that stood aside left its marker in the control keys the node watches anyway; the round's
keys are watched only while someone waits for the next round. At 2,048 nodes that is one
watch event per survivor for a lost node, not two.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from elasticft.contract.keys import RunKeys
from elasticft.store.keyset import KeySet
from elasticft.store import EtcdClient


class Formed(Protocol):
    number: int
    size: int
    revision: int


class MemberLosses(Protocol):
    def lost(self, formed: Formed, control: KeySet) -> int:
        """Members of ``formed`` gone since it formed (0 when none); may raise StoreError."""

    def close(self) -> None:
        """Cancel what ``lost`` opened."""


class ParticipantWatch:
    """A watch on the round's participant keys, made at the first question: it starts from
    the round's revision whenever it is made, so nothing is missed, and the workers start one
    watch creation sooner (the client library makes watches one at a time per connection)."""

    def __init__(self, client: EtcdClient, keys: RunKeys):
        self._client = client
        self._keys = keys
        self._formed: Formed | None = None
        self._members: KeySet | None = None
        self._member: dict[str, bool] = {}  # vanished key -> was it a member (memo)

    def lost(self, formed: Formed, control: KeySet) -> int:
        if formed != self._formed or (self._members is not None and self._members.broken):
            self.close()  # a new round, or the watch broke: made anew, from the round's revision
            if formed != self._formed:
                self._formed, self._member = formed, {}
        if self._members is None:
            self._members = KeySet(self._client, self._keys.rdzv_participants(formed.number), lambda: None,
                                   after=formed.revision)
        return self._count(formed, self._members)

    def _count(self, formed: Formed, members: KeySet) -> int:
        """A key that vanished is a member's when it ranked below the size at the round's
        revision (else it was a node beyond ``max_nodes`` moving on) or, with segments, when the
        decision did not leave it out; classified lazily, one count each, and only until one is found."""
        lost = 0
        prefix = self._keys.rdzv_participants(formed.number)
        for key in list(members.vanished):
            if key not in self._member:
                if lost:
                    break  # one known loss is enough to restart; torch asks only for > 0
                if formed.left_out is not None:  # segments: every participant but those named is a member
                    self._member[key] = key[len(prefix):] not in formed.left_out
                else:
                    rank, _ = self._client.count_range(prefix, key, formed.revision)
                    self._member[key] = rank < formed.size
            lost += self._member[key]
        return lost

    def close(self) -> None:
        if self._members is not None:
            self._members.close()
        self._members = None


class AgentLosses:
    """Losses as eft's agent sees them: ``membership_lost`` (the agent's membership watch has
    losses it has not acted on yet) and the stand-aside markers made since the round formed.

    One loss the node records cannot show: a member whose own workers failed moves on to the
    next round while its lease lives. It marks that round's waiting key, which the control
    watch sees; only then, and only until this round ends, is the round's participant watch
    made (from the round's revision: nothing is missed), so that a full round (``--nnodes
    N:N``) tells a member that moved on from a newcomer on the redundancy list."""

    def __init__(self, client: EtcdClient, keys: RunKeys, membership_lost: Callable[[], bool]):
        self._keys = keys
        self._membership_lost = membership_lost
        self._participants = ParticipantWatch(client, keys)

    def lost(self, formed: Formed, control: KeySet) -> int:
        seen = control.created_after(self._keys.rdzv_asides, formed.revision) + int(self._membership_lost())
        if self._keys.rdzv_waiting(formed.number + 1) not in control:
            return seen
        return max(seen, self._participants.lost(formed, control))

    def close(self) -> None:
        self._participants.close()
