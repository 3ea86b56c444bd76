"""The memory checkpoint index in etcd, and which iterations the survivors can complete.

etcd holds one small record per part (``mem/parts/<node>/<iteration>``, a ``MemPart``):
which files, their sizes and crc32s, and which nodes hold a verified copy. The bytes stay
on the nodes. ``complete_iterations`` is pure: given the index and who is alive, it says
which iterations can be assembled in full and where each file can be read from;
``restorable_iterations`` says which of them also have every replica in place, so that they
stay complete when a node is lost: what each node keeps until a newer one is restorable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticft.contract.keys import RunKeys
from elasticft.contract.memory import MemPart, part_key, part_of_key
from elasticft.store import EtcdClient


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
    """The run's ``mem/parts/`` keys, read and written through the EtcdClient only."""

    def __init__(self, client: EtcdClient, keys: RunKeys):
        self.client = client
        self.prefix = keys.mem_parts

    def key(self, node: str, iteration: int) -> str:
        return part_key(self.prefix, node, iteration)

    def publish(self, part: MemPart) -> None:
        self.client.put(self.key(part.node, part.iteration), part.to_json())

    def _change(self, node: str, iteration: int, change) -> bool:
        """Compare-and-swap ``change(part)`` into the part's key; False if the part is gone (dropped meanwhile:
        ``client.update`` would write it back)."""
        key = self.key(node, iteration)
        current = self.client.get(key)
        while current is not None:
            part = MemPart.from_json(current.value)
            change(part)
            swapped, current = self.client.compare_and_swap(key, current.mod_revision, part.to_json())
            if swapped:
                return True
        return False

    def add_holder(self, node: str, iteration: int, holder: str, address: str) -> bool:
        def add(part: MemPart) -> None:
            if holder not in part.holders:
                part.holders.append(holder)
            part.addresses[holder] = address

        return self._change(node, iteration, add)

    def parts(self) -> list[MemPart]:
        items, _ = self.client.get_prefix(self.prefix)
        return [MemPart.from_json(kv.value) for kv in items if part_of_key(kv.key) is not None]

    def _delete_where(self, prefix: str, drop) -> list[int]:
        items, _ = self.client.get_prefix(prefix)
        dropped = []
        for kv in items:
            found = part_of_key(kv.key)
            if found is not None and drop(found[1]):
                self.client.delete(kv.key)
                dropped.append(found[1])
        return dropped

    def drop_above(self, iteration: int | None) -> list[int]:
        """Every node's parts newer than ``iteration`` (None: all): the workers resumed before them."""
        floor = -1 if iteration is None else iteration
        return self._delete_where(self.prefix, lambda k: k > floor)

    def drop_node_below(self, node: str, iteration: int) -> list[int]:
        return self._delete_where(f"{self.prefix}{node}/", lambda k: k < iteration)
