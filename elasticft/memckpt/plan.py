"""A restart's view of the memory index: read from etcd once for the job, shared through one key.

Each agent prepares its restore candidates (``restore.py``) from the iterations the live nodes
complete (``index.complete_iterations``), which takes every node's record: N agents each reading
N records is N² keys read at every restart. Instead the planning agent (the first live node in
sorted order, as for ``mem/restorable``: every agent knows the members, no election) reads the
index once and writes to ``mem/plan`` the parts of the iterations the live nodes complete, which
live nodes it planned for, and the revision it read the index at; every other agent reads that
one key. A plan is this restart's when it names the same live nodes and was read at or after the
revision this restart's round counted its members at (``since``, from eft's rendezvous: a plan of
an earlier restart was read before it). Without that revision (another rendezvous backend), at or
after the index's newest change (``last_modified``: one key's name travels, but etcd visits every
node's key to sort them, so N agents asking cost etcd N² key visits: 2.5 ms a request at 1,024
nodes against 0.7 ms for one key). An agent that finds none waits on the key for the planner, at
most ``WAIT`` seconds, then reads the index itself: a lost or slow planner costs time, never a
wrong plan (a holder that pruned a file after the plan was read is a fetch that fails over to the
next holder; every file is checked against the index's crc).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import zlib
from dataclasses import dataclass

from elasticft.contract.memory import MemPart
from elasticft.memckpt.index import MemIndex, complete_iterations, lost_share, parts_of
from elasticft.store import StoreError
from elasticft.store.keyset import KeySet

log = logging.getLogger(__name__)

# Seconds an agent waits for the planner's plan of this restart before it reads the index itself: the
# planner's read, computation and write take well under a second at 1,024 nodes (bench/mem_plan_reads.py).
WAIT = 5.0


@dataclass
class Plan:
    parts: list[MemPart]  # the index's parts of the iterations the live nodes complete
    lost: tuple[int, str] | None  # ``index.lost_share``: a newer iteration lost with every holder of a share


def digest(alive: set[str]) -> str:
    return hashlib.sha1("\n".join(sorted(alive)).encode()).hexdigest()


def from_index(index: MemIndex, alive: set[str]) -> tuple[Plan, int]:
    """The plan from every record (one range read), and the revision it was read at. Raises StoreError."""
    items, revision = index.client.get_prefix(index.prefix)
    parts = parts_of(index.prefix, ((kv.key, kv.value) for kv in items))
    complete = complete_iterations(parts, alive)
    kept = {c.iteration for c in complete}
    lost = lost_share(parts, alive, complete[0].iteration if complete else None)
    return Plan([p for p in parts if p.iteration in kept], lost), revision


def _encode(by: str, alive: set[str], revision: int, plan: Plan) -> bytes:
    return zlib.compress(json.dumps({"by": by, "alive": digest(alive), "revision": revision,
                                     "parts": [p.to_dict() for p in plan.parts],
                                     "lost": list(plan.lost) if plan.lost else None}).encode())


def _decode(raw: bytes | None, alive: str, since: int) -> Plan | None:
    """The plan in ``raw`` when it is for the live nodes ``alive`` and read the index at ``since`` or later."""
    if raw is None:
        return None
    try:
        fields = json.loads(zlib.decompress(raw))
        if fields["alive"] != alive or int(fields["revision"]) < since:
            return None
        lost = fields.get("lost")
        return Plan([MemPart.from_dict(p) for p in fields["parts"]], (int(lost[0]), str(lost[1])) if lost else None)
    except (ValueError, TypeError, KeyError, IndexError, zlib.error) as exc:
        log.warning("memory tier: ignoring an unreadable restart plan: %s", exc)
        return None


def restart_plan(index: MemIndex, node_id: str, alive: set[str], wait: float = WAIT,
                 since: int | None = None) -> Plan:
    """This restart's plan: computed and shared on the planning agent, the shared one elsewhere
    (the index read here only when none came within ``wait``). ``since``: the etcd revision this
    restart's round counted its members at (``rendezvous.backend.rendezvous_revision``), None when
    unknown. Raises StoreError."""
    alive = set(alive) | {node_id}
    if min(alive) == node_id:
        plan, revision = from_index(index, alive)
        try:
            index.client.put(index.plan_key, _encode(node_id, alive, revision, plan))
        except StoreError as exc:  # the others read the index themselves, after their wait
            log.warning("memory tier: could not share the restart plan (%s): %s", index.plan_key, exc)
        return plan
    since, wanted = since if since is not None else index.client.last_modified(index.prefix), digest(alive)
    arrived = threading.Event()
    shared = KeySet(index.client, index.plan_key, arrived.set, exact=True)  # one key read, then its watch
    try:
        deadline = time.monotonic() + wait
        while (plan := _decode(shared.get(index.plan_key), wanted, since)) is None:
            if not arrived.wait(max(0.0, deadline - time.monotonic())):
                log.warning("memory tier: no restart plan from %s within %g s: reading the index", min(alive), wait)
                return from_index(index, alive)[0]
            arrived.clear()
        return plan
    finally:
        shared.close()
