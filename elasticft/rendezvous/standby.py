"""A node that waits as a spare: it says so, waits as long as the job runs, and sits out unfit.

With more nodes than ``--nnodes``'s MAX, a round forms with MAX members and the others wait
in the next round (torch's redundancy list): when a member is lost, the survivors restart
into that round and find the spare already there, at the same layout. Until then the spare
costs nothing but its lease, and its own loss must cost the job nothing: its node record says
``spare`` (and the round it waits in) from the moment it waits as one until the round that
takes it in forms (``Membership`` tells a spare's loss from a member's by that round number).

A node that waits after its own round's workers failed, or after a loss, is no spare: it was
a member of the round before.

Two rules differ from torch's redundancy list. A spare waits as long as the job runs: the join
timeout counts only once it stops being one (torch's spare fails after the join timeout, 600 s,
on a job meant to run for weeks). And a spare that is unfit (its own GPU risk at or above the
trigger, ``unfit``) takes its participant key out of the round it waits in, so that no round can
take it in, and puts it back once it is fit again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from elasticft.contract.keys import RunKeys
from elasticft.store.keyset import KeySet

log = logging.getLogger(__name__)

FIT_LOOK = 1.0  # seconds between two looks at an unfit spare's health (and at a spare's, while it waits)


class SitOut(Exception):
    """Raised by ``Standby.waiting`` in the join of an unfit spare: it leaves the round it waits in."""


def after_full(control: KeySet, keys: RunKeys, number: int, max_nodes: int) -> bool:
    """Whether round ``number - 1`` was decided with ``max_nodes`` members (the control keys hold decisions)."""
    decided = control.get(keys.rdzv_decision(number - 1)) if number > 0 else None
    return decided is not None and int(json.loads(decided)["size"]) >= max_nodes


class Standby:
    """One node's spare state in the rendezvous, asked from its join.

    ``tell(round, spare)`` hears each change: True, it waits as a spare in that round; False,
    the spare is a member of that round (before the join returns: the record says ``running``
    before the workers start). ``unfit()`` says why this node must not be taken in now (None:
    it may be); ``tell_unfit(why)`` hears when it sits out."""

    def __init__(self, join_timeout: float) -> None:
        self.tell: Callable[[int, bool], None] | None = None
        self.unfit: Callable[[], str | None] | None = None
        self.tell_unfit: Callable[[str], None] | None = None
        self._join_timeout = join_timeout
        self._member_of: int | None = None  # the last round this node was a member of
        self._told: int | None = None

    def waiting(self, number: int, full_before: bool, deadline: float) -> float:
        """This node waits in round ``number``; ``full_before``: the round before it formed full.
        The join's deadline, pushed on while this node is a spare. Raises ``SitOut`` when unfit."""
        if full_before and self._member_of != number - 1 and self._told != number:
            self._told = number
            self._say(number, True)
        if self._told != number:
            return deadline
        why = self.unfit() if self.unfit is not None else None
        if why is not None:
            raise SitOut(why)
        return max(deadline, time.monotonic() + self._join_timeout)

    def next_look(self) -> float:
        """When a waiting spare's join should look at its health again (never: no spare, no check)."""
        return time.monotonic() + FIT_LOOK if self._told is not None and self.unfit is not None else float("inf")

    def sit_out(self, why: str, check_run: Callable[[], None]) -> None:
        """Wait, out of every round, until this node is fit; ``check_run`` raises once the run closed."""
        log.warning("this spare is unfit (%s): out of the rendezvous until it is fit again, so that no round "
                    "takes it in", why)
        if self.tell_unfit is not None:
            self.tell_unfit(why)
        self._told = None  # back in a round, it says again that it waits as a spare
        while why is not None:
            check_run()
            time.sleep(FIT_LOOK)
            why = self.unfit() if self.unfit is not None else None
        log.info("this spare is fit again: it waits in the rendezvous")

    def member(self, number: int) -> None:
        """This node is a member of round ``number``."""
        self._member_of = number
        if self._told is not None:
            self._told = None
            self._say(number, False)

    def _say(self, number: int, spare: bool) -> None:
        if self.tell is not None:
            self.tell(number, spare)
