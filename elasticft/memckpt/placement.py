"""Which nodes keep a replica of a node's part: a pure function of the membership.

Every agent computes it alone and gets the same answer, so there is nothing to agree on.
Rules, in order: never the origin (a replica on the failing node is no replica); other
failure domains first (a rack that loses power takes its nodes together); then ring order
over the sorted node ids, starting just after the origin, so that with no domain preference
every node holds exactly ``min(replicas, nodes - 1)`` other nodes' parts (no hot holder).

Spares (docs/spares.md) are not in the ring: each spare of the origin's segment (every spare,
without segments) holds one more copy of each part, beyond ``--eft-mem-ckpt-replicas``, so
that the spare that takes a lost node's place restores from its own memory. Those copies are
extra: an iteration is restorable without them, and a spare that refuses one (its budget) holds
nothing back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


def replica_holders(origin: str, domains: dict[str, str], replicas: int) -> list[str]:
    """Up to ``replicas`` holders of ``origin``'s part among ``domains`` (node id -> failure domain).

    A domain of "" is unknown: it is neither preferred nor avoided. When the origin's domain is
    unknown there is no preference at all, only the ring.
    """
    others = sorted(n for n in domains if n != origin)
    if replicas <= 0 or not others:
        return []
    # The ring: the nodes after the origin in sorted order, then those before it.
    ring = [n for n in others if n > origin] + [n for n in others if n < origin]
    mine = domains.get(origin, "")
    if mine:
        # Stable sort: other known domains first, each group still in ring order.
        ring.sort(key=lambda n: not (domains[n] and domains[n] != mine))
    return ring[:replicas]


@dataclass
class Spares:
    """The spares as this node's memory tier sees them, live from the membership watch."""

    waiting: Callable[[], dict[str, str]] = field(default=lambda: {})
    """The nodes waiting as spares now: node id -> its segment's domain ("" without segments)."""
    this_node: Callable[[], bool] = field(default=lambda: False)
    """Whether this node waits as a spare: it holds copies, saves nothing and computes nothing for the job."""
    segment: str = ""
    """This node's segment's domain ("": no segments): the spares that hold its copies are of it."""


def spare_holders(origin: str, spares: Spares) -> list[str]:
    """The spares that keep an extra copy of ``origin``'s part: those of its segment, sorted."""
    return sorted(node for node, segment in spares.waiting().items()
                  if node != origin and (not spares.segment or segment == spares.segment))
