"""Which participants a round takes when nodes come in segments (``--eft-segment N``).

A segment is N nodes of one domain (the NVLink domain their GPUs report, or
``--eft-segment-domain``): nodes that must train together, as a GB200-class rack does. With
segments a round takes whole segments only, as NVRx's ``--ft-segment`` does: from each
domain as many whole segments as its participants make, up to ``--nnodes``'s maximum. The
others wait in the next round as spares. So a lost node is replaced by a spare of its own
domain (with it, the domain makes as many segments as before); where its domain has no
spare, the domain makes one segment fewer, and the round is that much smaller: the job
re-plans, as it would without spares.

Pure: the closer of a round calls ``choose`` with the participants' records, every other node
reads the outcome from the decision (``Round.left_out``: a handful of names, not the list
of members, so a decision stays O(spares) bytes).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A participant of a round, as its key's value says: its domain ("" none), the last round
    it was a member of (-1: none) and its rank there. The round's previous members are kept first."""

    node: str
    domain: str
    member_of: int = -1
    rank: int = -1  # its rank in round ``member_of``


def choose(candidates: list[Candidate], number: int, max_nodes: int, per_segment: int) -> list[str]:
    """The nodes round ``number`` takes: whole segments of ``per_segment`` nodes of one domain, at
    most ``max_nodes`` in all. The domains with the most members of the round before come first,
    and within a domain its previous members (ties: by name), so that a loss moves no survivor
    out and the spare of the lost node's domain comes in. Sorted by name."""
    by_domain: dict[str, list[Candidate]] = {}
    for c in candidates:
        if c.domain:  # a node without a domain is in no segment (eft-run refuses to start so)
            by_domain.setdefault(c.domain, []).append(c)

    def kept_first(c: Candidate) -> tuple[bool, str]:
        return (c.member_of != number - 1, c.node)

    def members_before(domain: str) -> int:
        return sum(c.member_of == number - 1 for c in by_domain[domain])

    chosen: list[str] = []
    for domain in sorted(by_domain, key=lambda d: (-members_before(d), d)):
        room = (max_nodes - len(chosen)) // per_segment * per_segment
        whole = len(by_domain[domain]) // per_segment * per_segment
        chosen += [c.node for c in sorted(by_domain[domain], key=kept_first)[:min(room, whole)]]
    return sorted(chosen)


def size_with(per_domain: dict[str, int], waiting: list[str], max_nodes: int, per_segment: int) -> int:
    """How many nodes a new round would take: the members of a round (``per_domain``: how many of
    each domain it took, less those lost) and the nodes waiting in the next (their domains). A
    round whose members see nodes wait restarts only when this is more than it has: nodes left
    out because their domain makes no whole segment wait as spares, and must not restart it."""
    counts = Counter(per_domain) + Counter(d for d in waiting if d)
    whole = sum(n // per_segment * per_segment for n in counts.values())
    return min(whole, max_nodes // per_segment * per_segment)


def domains_of(chosen: list[str], candidates: list[Candidate]) -> dict[str, int]:
    """How many of ``chosen`` each domain holds (a decision's ``domains``)."""
    domain = {c.node: c.domain for c in candidates}
    return dict(Counter(domain[n] for n in chosen))
