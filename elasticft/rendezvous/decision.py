"""A round's decision, made once by its closer, and each node's place read from it (``rounds.py``).

The decision is ``{"revision": R, "size": n, "first": <rank 0>}``: the participants are the keys
at revision R, a node's rank the number of participant keys sorting before its own (one
count-only read, the same answer on every node). Without segments a round takes the first
``max_nodes`` keys; with segments (``segments.py``) the closer chooses whole segments, and the
decision adds the participants it left out (``out``: they wait as spares; ranks skip them) and
how many members each domain has (``domains``: what a member weighs a waiting node against).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from elasticft.contract.keys import RunKeys
from elasticft.rendezvous.round_types import Round
from elasticft.rendezvous.segments import Candidate, choose, domains_of, size_with
from elasticft.store import EtcdClient
from elasticft.store.keyset import KeySet


@dataclass(frozen=True)
class SegmentRule:
    """This node's domain, and the nodes per segment (``--eft-segment``; the same on every node)."""

    per_segment: int
    domain: str


def participant_value(node: str, rule: SegmentRule | None, last: Round | None) -> str:
    """What a node's participant key holds: its name, the round it was last a member of and its
    rank there (so that the closer can keep its rank), and with segments its domain."""
    fields: dict = {"node": node}
    if last is not None:
        fields.update(member_of=last.number, rank=last.rank)
    if rule is not None:
        fields["domain"] = rule.domain
    return json.dumps(fields)


def candidates(values: list[bytes]) -> list[Candidate]:
    out = []
    for value in values:
        fields = json.loads(value)
        out.append(Candidate(fields["node"], fields.get("domain", ""), int(fields.get("member_of", -1)),
                             int(fields.get("rank", -1))))
    return out


def eligible(values: list[bytes], number: int, max_nodes: int, rule: SegmentRule | None) -> int:
    """How many of these participants a round would take now."""
    if rule is None:
        return len(values)
    return len(choose(candidates(values), number, max_nodes, rule.per_segment))


def kept_ranks(found: list[Candidate], members: list[str], number: int) -> dict[str, int]:
    """Every member's rank: a member of the round before keeps its rank there while it fits the new
    size (a spare then takes the lost node's rank, and every survivor restores its own share from
    its own memory); the others fill the free ranks in name order."""
    size, taken = len(members), set(members)
    ranks: dict[str, int] = {}
    for c in found:  # in key order: of two claims to one rank (none in practice), the first wins
        if c.node in taken and c.member_of == number - 1 and 0 <= c.rank < size and c.rank not in ranks.values():
            ranks[c.node] = c.rank
    free = iter(sorted(set(range(size)) - set(ranks.values())))
    for node in members:
        if node not in ranks:
            ranks[node] = next(free)
    return ranks


def make(client: EtcdClient, keys: RunKeys, number: int, max_nodes: int, rule: SegmentRule | None,
         before: bytes | None) -> str:
    """Round ``number``'s decision from its participants now (one read, at the closer only).

    A round of the size of the one before (``before``: its decision; None for round 0) whose
    ranks in name order would move a survivor (a spare taken in whose name sorts before it) says
    ``keep``: every member of the round before keeps its rank, and ``fill`` names the rank of each other member (the spares
    taken in: a few entries, not the list of members). Otherwise, as when the size changes (the
    planner lays the job out anew then), the decision is the plain one: each node counts its rank."""
    prefix = keys.rdzv_participants(number)
    kvs, revision = client.get_prefix(prefix)  # in key order: by name
    found = candidates([kv.value for kv in kvs])
    if rule is not None:
        members = choose(found, number, max_nodes, rule.per_segment)
    else:  # the members of the round before first: a spare or a newcomer never displaces a survivor
        members = sorted(c.node for c in sorted(found, key=lambda c: (c.member_of != number - 1, c.node))[:max_nodes])
    by_name = {node: rank for rank, node in enumerate(members)}
    same_size = before is not None and len(members) == int(json.loads(before)["size"])
    ranks = kept_ranks(found, members, number) if same_size else by_name
    first = min(ranks, key=ranks.get) if ranks else None
    decision: dict = {"revision": revision, "size": len(members), "first": first}
    taken = set(members)
    if rule is not None or ranks != by_name or members != [c.node for c in found][:len(members)]:
        decision["out"] = [c.node for c in found if c.node not in taken]  # not the first ``size`` by name
    if rule is not None:
        decision["domains"] = domains_of(members, found)
    if ranks != by_name:
        survivors = {c.node for c in found if c.member_of == number - 1 and ranks.get(c.node) == c.rank}
        decision.update(keep=1, fill={node: rank for node, rank in ranks.items() if node not in survivors})
    return json.dumps(decision)


def place(client: EtcdClient, keys: RunKeys, number: int, node: str, decision: bytes, joined_at: int,
          last: Round | None) -> Round | None:
    """My place in round ``number`` by its decision (``last``: the round I was last a member of, whose
    rank my participant key holds); None when I came too late for it or was left out."""
    fields = json.loads(decision)
    revision, size, first = int(fields["revision"]), int(fields["size"]), fields.get("first")
    out = fields.get("out")
    left_out = tuple(out) if out is not None else None
    domains = fields.get("domains") or {}
    if joined_at > revision or (left_out is not None and node in left_out):
        return None
    if "keep" in fields:  # survivors keep their ranks, the others' are named
        if node in fields["fill"]:
            rank = int(fields["fill"][node])
        elif last is not None and last.number == number - 1:
            rank = last.rank
        else:
            return None
        return Round(number, rank, size, revision, left_out, domains, first)
    if first == node:  # rank 0, named by the closer: it starts the store at once
        return Round(number, 0, size, revision, left_out, domains, first)
    prefix = keys.rdzv_participants(number)
    rank, _ = client.count_range(prefix, keys.rdzv_participant(number, node), revision)
    rank -= sum(1 for other in left_out or () if other < node)  # keys sort as the names do
    return Round(number, rank, size, revision, left_out, domains, first) if rank < size else None


def left_out_of(decision: bytes | None, node: str) -> bool:
    """Whether a decision left ``node`` out (segments only; a node beyond ``max_nodes`` is not named)."""
    return decision is not None and node in (json.loads(decision).get("out") or ())


class Waiting:
    """With segments: the nodes waiting in the round after a formed one, watched (a node left out
    may wait for weeks, and every member looks at every monitor tick: no request per look)."""

    def __init__(self, client: EtcdClient, keys: RunKeys):
        self._client, self._keys = client, keys
        self._number: int | None = None
        self._following: KeySet | None = None

    def adds(self, formed: Round, max_nodes: int, rule: SegmentRule) -> int:
        """How many nodes a new round would add (0: those waiting make no whole segment with the
        members of their domain)."""
        if self._following is None or self._following.broken or self._number != formed.number:
            self.close()
            self._number = formed.number
            self._following = KeySet(self._client, self._keys.rdzv_participants(formed.number + 1), lambda: None)
        waiting = [c.domain for c in candidates(list(self._following.snapshot().values()))]
        return max(0, size_with(formed.domains, waiting, max_nodes, rule.per_segment) - formed.size)

    def close(self) -> None:
        if self._following is not None:
            self._following.close()
        self._following = None
