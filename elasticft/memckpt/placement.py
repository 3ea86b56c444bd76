"""Which nodes keep a replica of a node's part: a pure function of the membership.

Every agent computes it alone and gets the same answer, so there is nothing to agree on.
Rules, in order: never the origin (a replica on the failing node is no replica); other
failure domains first (a rack that loses power takes its nodes together); then ring order
over the sorted node ids, starting just after the origin, so that with no domain preference
every node holds exactly ``min(replicas, nodes - 1)`` other nodes' parts (no hot holder).
"""

from __future__ import annotations


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
