"""Joins the members hold back: when the nodes waiting for the next round may come in.

torch's agent restarts a healthy round's workers as soon as ``num_nodes_waiting()`` says a
node waits. With an ``Admission`` (eft's agent: ``agent/join_gate.py``, ``--eft-join-at
save``) the members ask it first, and while it says no they count only the members they
lost: a lost node or a member that moved on still restarts the round at once, and the
waiting nodes come in with it.

A node told to wait (``rdzv/ctl/held/<r>``, a ``JoinHold``, seen in the control keys it
watches anyway) must not fail for waiting: ``HeldWait`` starts its join timeout again
after the most the members may hold it.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

from elasticft.contract.records import JoinHold
from elasticft.store.keyset import KeySet

log = logging.getLogger(__name__)


class Formed(Protocol):
    number: int
    rank: int
    size: int
    revision: int


class Admission(Protocol):
    def admit(self, formed: Formed, control: KeySet) -> bool:
        """Whether the nodes waiting for the round after ``formed`` may come in now (``control``:
        the control keys as the node's watch holds them). Asked by a member at every look
        while someone waits; raises nothing."""

    def close(self) -> None:
        """The member left ``formed``: drop what ``admit`` opened."""


class HeldWait:
    """A waiting node's side of a held join: one log line, and a later join deadline."""

    def __init__(self, node: str, join_timeout: float):
        self._node = node
        self._join_timeout = join_timeout
        self._seen: tuple[int, bytes] | None = None
        self._held_in: int | None = None  # the round this node was told to wait in

    def deadline(self, number: int, raw: bytes | None, deadline: float) -> float:
        """The deadline of the wait in round ``number``, given its held record ``raw`` (None:
        not held): a new hold gives the members its ``wait``, then the join timeout again."""
        if raw is None or self._seen == (number, raw):
            return deadline
        self._seen = (number, raw)
        try:
            hold = JoinHold.from_json(raw)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("etcd-v3 rendezvous: ignoring a malformed held join record: %s", exc)
            return deadline
        if hold.let_in is not None:
            if self._held_in == number:
                log.info("node %s joins round %d: let in (%s)", self._node, number, hold.let_in)
            return deadline
        self._held_in = number
        log.info("node %s waits to join: held until the next checkpoint (at most %g s)", self._node, hold.wait)
        return max(deadline, time.monotonic() + hold.wait + self._join_timeout)
