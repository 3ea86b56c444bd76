"""A node that waits as a spare, and says so.

With more nodes than ``--nnodes``'s MAX, a round forms with MAX members and the others wait
in the next round (torch's redundancy list): when a member is lost, the survivors restart
into that round and find the spare already there, at the same layout. Until then the spare
costs nothing but its lease, and its own loss must cost the job nothing: its node record says
``spare`` (and the round it waits in) from the moment it waits as one until the round that
takes it in forms (``Membership`` tells a spare's loss from a member's by that round number).

A node that waits after its own round's workers failed, or after a loss, is no spare: it was
a member of the round before.
"""

from __future__ import annotations

from collections.abc import Callable


class Standby:
    """One node's spare state in the rendezvous; ``tell(round, spare)`` hears each change: True,
    it waits as a spare in that round; False, the spare is a member of that round. Called from
    the rendezvous' join, before it returns (the record says ``running`` before workers start)."""

    def __init__(self) -> None:
        self.tell: Callable[[int, bool], None] | None = None
        self._member_of: int | None = None  # the last round this node was a member of
        self._told: int | None = None

    def waiting(self, number: int, after_full: bool) -> None:
        """This node waits in round ``number``; ``after_full``: the round before it formed full."""
        if after_full and self._member_of != number - 1 and self._told != number:
            self._told = number
            self._say(number, True)

    def member(self, number: int) -> None:
        """This node is a member of round ``number``."""
        self._member_of = number
        if self._told is not None:
            self._told = None
            self._say(number, False)

    @property
    def spare_in(self) -> int | None:
        """The round this node waits in as a spare (None: it is none)."""
        return self._told

    def _say(self, number: int, spare: bool) -> None:
        if self.tell is not None:
            self.tell(number, spare)
