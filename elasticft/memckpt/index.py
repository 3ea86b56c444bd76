"""The memory checkpoint index in etcd, and which iterations the survivors can complete.

etcd holds one small record per node (``mem/parts/<node>``, a ``NodeParts``), listing the
parts it keeps: which files, their sizes and crc32s, and which nodes hold a verified copy.
The bytes stay on the nodes. ``complete_iterations`` is pure: given the index and who is alive, it says
which iterations can be assembled in full and where each file can be read from;
``restorable_iterations`` says which of them also have every replica in place, so that they
stay complete when a node is lost: what each node keeps until a newer one is restorable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import logging

from elasticft.contract.keys import RunKeys
from elasticft.contract.memory import MemPart, NodeParts, Restorable, node_of_key, node_parts_key
from elasticft.store import EtcdClient

log = logging.getLogger(__name__)


@dataclass
class FileSource:
    """Where to read one file of a complete iteration: its origin's part and its alive holders."""

    name: str
    origin: str
    size: int
    crc: int
    holders: list[tuple[str, str]] = field(default_factory=list)  # (node, address), the origin first


@dataclass
class CompleteIteration:
    iteration: int
    files: dict[str, FileSource]

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())


def complete_iterations(parts: list[MemPart], alive: set[str]) -> list[CompleteIteration]:
    """Iterations whose every needed file has an alive holder, newest first.

    An iteration is complete when some part of it names the checkpoint's files (``needs``,
    from rank 0's ``.metadata``) and each of them is listed by a part of that iteration that
    at least one alive node holds. Without ``needs`` nothing says what "all" is: not complete.
    """
    by_iteration: dict[int, list[MemPart]] = {}
    for part in parts:
        by_iteration.setdefault(part.iteration, []).append(part)
    out = []
    for iteration in sorted(by_iteration, reverse=True):
        group = sorted(by_iteration[iteration], key=lambda p: p.node)
        needs = next((p.needs for p in group if p.needs), None)
        if not needs:
            continue
        sources: dict[str, FileSource] = {}
        for part in group:
            holders = [(h, part.addresses.get(h, part.address if h == part.node else ""))
                       for h in part.holders if h in alive]
            holders = [(h, a) for h, a in holders if a]
            for name, (size, crc) in part.files.items():
                if holders and name not in sources:
                    sources[name] = FileSource(name, part.node, size, crc, holders)
        if all(name in sources for name in needs):
            out.append(CompleteIteration(iteration, {name: sources[name] for name in needs}))
    return out


def restorable_iterations(parts: list[MemPart], alive: set[str]) -> list[int]:
    """Complete iterations whose every part has all its replicas in place, newest first.

    A part's replicas are in place when at least ``1 + part.replicas`` alive nodes hold it (the
    origin and the other nodes it pushes to). Such an iteration stays complete when any
    ``replicas`` nodes are lost, so a node may drop an older iteration once it has seen a newer
    one restorable: whatever happens next, there is one to go back to.
    """
    by_iteration: dict[int, list[MemPart]] = {}
    for part in parts:
        by_iteration.setdefault(part.iteration, []).append(part)
    return [c.iteration for c in complete_iterations(parts, alive)
            if all(sum(h in alive for h in set(p.holders)) >= 1 + p.replicas for p in by_iteration[c.iteration])]


def lost_share(parts: list[MemPart], alive: set[str], newer_than: int | None) -> tuple[int, str] | None:
    """The newest iteration above ``newer_than`` that some node published but no live node holds
    a copy of: (iteration, why). A share never published (its node died before its agent could
    tell etcd) is not counted: that iteration was never restorable, so nothing was lost."""
    for part in sorted(parts, key=lambda p: (-p.iteration, p.node)):
        if newer_than is not None and part.iteration <= newer_than:
            break
        if not any(h in alive for h in part.holders):
            return part.iteration, (f"{part.node}'s share has no live copy "
                                    f"(held by {', '.join(part.holders) or 'nobody'})")
    return None


def memory_summary(parts: list[MemPart], alive: set[str]) -> dict | None:
    """What a person wants to know (``eft top``, ``eft ckpt status``): the newest iteration the
    live nodes can restore, and who holds each node's part of it; the newest with every replica in
    place, and the replication lag: how many snapshots were written after it; None without any part."""
    if not parts:
        return None
    complete = complete_iterations(parts, alive)
    newest = complete[0].iteration if complete else None
    restorable = next(iter(restorable_iterations(parts, alive)), None)
    written = {p.iteration for p in parts}
    of_newest = sorted((p for p in parts if p.iteration == newest), key=lambda p: p.node)
    return {
        "iteration": newest,
        "newest_written": max(written),
        "restorable": restorable,
        "lag": sum(1 for k in written if restorable is None or k > restorable),
        "holders": {p.node: list(p.holders) for p in of_newest},
        "time": max((p.time for p in of_newest), default=None),
        "bytes": sum(p.size for p in of_newest),
    }


class MemIndex:
    """The run's ``mem/parts/`` keys (one a node), ``mem/restorable`` and ``mem/plan``, through the EtcdClient only."""

    def __init__(self, client: EtcdClient, keys: RunKeys):
        self.client = client
        self.prefix = keys.mem_parts
        self.restorable_key = keys.mem_restorable
        self.plan_key = keys.mem_plan

    def key(self, node: str) -> str:
        return node_parts_key(self.prefix, node)

    def write(self, node: str, parts: list[MemPart]) -> None:
        """This node's record: the one write a snapshot costs (the key goes when it keeps nothing)."""
        if parts:
            self.client.put(self.key(node), NodeParts(node, sorted(parts, key=lambda p: p.iteration)).to_json())
        else:
            self.client.delete(self.key(node))

    def parts(self) -> list[MemPart]:
        items, _ = self.client.get_prefix(self.prefix)
        return parts_of(self.prefix, ((kv.key, kv.value) for kv in items))

    def drop_above(self, iteration: int | None) -> list[str]:
        """Parts newer than ``iteration`` (None: all) out of every node's record: the workers resumed
        before them. Each record is changed by compare-and-swap (its node may be
        writing it); returns the nodes whose record changed."""
        floor = -1 if iteration is None else iteration
        items, _ = self.client.get_prefix(self.prefix)
        changed = []
        for kv in items:
            node = node_of_key(self.prefix, kv.key)
            if node is None:
                continue
            current = kv
            while current is not None:
                record = NodeParts.from_json(current.value)
                kept = [p for p in record.parts if p.iteration <= floor]
                if len(kept) == len(record.parts):
                    break
                swapped, current = self.client.compare_and_swap(current.key, current.mod_revision,
                                                                NodeParts(node, kept).to_json())
                if swapped:
                    changed.append(node)
                    break
        return changed

    def publish_restorable(self, restorable: Restorable) -> None:
        self.client.put(self.restorable_key, restorable.to_json())


def parts_of(prefix: str, items) -> list[MemPart]:
    """Every part of the records among ``(key, value)`` pairs (a range read, or a watched copy of one)."""
    out = []
    for key, value in items:
        if node_of_key(prefix, key) is not None:
            try:
                out.extend(NodeParts.from_json(value).parts)
            except (ValueError, KeyError, TypeError) as exc:  # a foreign or torn value: that node has nothing
                log.warning("memory index: unreadable %s: %s", key, exc)
    return out
