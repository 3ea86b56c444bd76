"""Which memory iterations are restorable, computed by one agent and read by all from one key.

Every agent needs the restorable iterations (complete across nodes, every replica in place):
they decide what it may prune and how far its replication lags. Computing them takes every
node's record; at 2,048 nodes, each agent reading all of them at every snapshot would be
millions of reads a second, and each watching them all would be millions of watch events.
So one agent (the first alive node in sorted order: every agent knows the members, no
election) watches ``mem/parts/`` and writes ``mem/restorable`` when the answer changes; every
agent watches that one key. A snapshot then costs etcd one write per node, one for the job,
and one small event per node.

When the computing agent is lost, the next one in order takes over at the membership change
(one range read); until then the key keeps its last answer, which a loss can only make
stale in the safe direction: an iteration said restorable was so, with its replicas in place.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from elasticft.contract.memory import MemPart, NodeParts, Restorable, node_of_key
from elasticft.memckpt.index import MemIndex, restorable_iterations
from elasticft.memckpt.lag import KEEP
from elasticft.store import StoreError
from elasticft.store.keyset import KeySet

log = logging.getLogger(__name__)

SHOWN = KEEP  # restorable iterations published: what every agent keeps (fewer would change with every prune)


class RestorableView:
    """This agent's copy of ``mem/restorable``; when it is the computing agent, also of ``mem/parts/``.

    ``changed`` is called from a watch thread when either copy changed; ``refresh`` (any thread but
    the watch's) recomputes where this agent computes and returns the iterations, newest first.
    """

    def __init__(self, index: MemIndex, node_id: str, members: Callable[[], dict[str, str]],
                 changed: Callable[[], None], spare: Callable[[], bool] = lambda: False):
        self.index = index
        self.node_id = node_id
        self.members = members
        self.spare = spare  # a spare never computes for the job: it only follows the key
        self.changed = changed
        self._lock = threading.Lock()
        self._key: KeySet | None = None
        self._parts: KeySet | None = None
        self._parsed: dict[str, tuple[bytes, list[MemPart]]] = {}  # key -> (value, its parts): parse once
        self._published: list[int] | None = None
        # Where this agent computes, it does so on a thread of its own, as soon as a record changes:
        # not behind its own replicator's pushes, which under load take longer than an iteration.
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def computing(self) -> bool:
        """True where this agent computes for all: the first alive member in sorted order (no spare)."""
        return not self.spare() and min(set(self.members()) | {self.node_id}) == self.node_id

    def refresh(self) -> list[int]:
        """The restorable iterations, newest first (computed and published first, on the computing agent)."""
        with self._lock:
            try:
                if self.computing:
                    self._start_computing()
                    return self._published if self._published is not None else self._compute()
                self._close_parts()
                key = self._watch_key()
                raw = key.get(self.index.restorable_key)
            except StoreError as exc:
                log.warning("memory tier: cannot read %s: %s", self.index.restorable_key, exc)
                return []
        if raw is None:
            return []
        try:
            return Restorable.from_json(raw).iterations
        except (ValueError, TypeError) as exc:
            log.warning("memory tier: unreadable %s: %s", self.index.restorable_key, exc)
            return []

    def _watch_key(self) -> KeySet:
        if self._key is None or self._key.broken:
            if self._key is not None:
                self._key.close()
            self._key = KeySet(self.index.client, self.index.restorable_key, self.changed, exact=True)
        return self._key

    def _start_computing(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._compute_loop, name="eft-mem-restorable", daemon=True)
            self._thread.start()
        if self._parts is None or self._parts.broken:
            self._close_parts()
            self._parts = KeySet(self.index.client, self.index.prefix, self._wake.set)
            self._published = None  # a new computing agent says what it sees once, whatever was there

    def _compute_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            with self._lock:
                if self._parts is None:  # no longer the computing agent
                    continue
                before = self._published
                try:
                    if self._parts.broken:
                        self._start_computing()
                    now = self._compute()
                except StoreError as exc:
                    log.warning("memory tier: cannot publish %s: %s", self.index.restorable_key, exc)
                    continue
            if now != before:
                self.changed()  # this agent's replicator prunes and measures its lag from it

    def _compute(self) -> list[int]:
        alive = set(self.members()) | {self.node_id}
        restorable = restorable_iterations(self._all_parts(), alive)[:SHOWN]
        if restorable != self._published:
            self.index.publish_restorable(Restorable(restorable, self.node_id, len(alive), time.time()))
            self._published = restorable
            if len(restorable) == SHOWN:
                self._forget_lost(alive, restorable[-1])
        return restorable

    def _forget_lost(self, alive: set[str], keep_from: int) -> None:
        """Remove the records of lost nodes whose every part is older than what every agent keeps: no
        restore can use them any more, and a job that loses nodes for weeks must not pile them up."""
        for key, (_, parts) in list(self._parsed.items()):
            node = node_of_key(self.index.prefix, key)
            if node in alive or any(p.iteration >= keep_from for p in parts):
                continue
            current = self.index.client.get(key)
            if current is None or current.value != self._parsed[key][0]:
                continue  # written again meanwhile (the node is back): look at it at the next change
            if self.index.client.delete_if_unchanged(key, current.mod_revision):
                log.info("memory index: removed lost node %s's record (all of it older than iteration %d)",
                         node, keep_from)

    def _all_parts(self) -> list[MemPart]:
        values = self._parts.snapshot()
        out: list[MemPart] = []
        for key in [k for k in self._parsed if k not in values]:
            del self._parsed[key]
        for key, value in values.items():
            if node_of_key(self.index.prefix, key) is None:
                continue
            cached = self._parsed.get(key)
            if cached is None or cached[0] != value:
                try:
                    cached = (value, NodeParts.from_json(value).parts)
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("memory index: unreadable %s: %s", key, exc)
                    cached = (value, [])
                self._parsed[key] = cached
            out.extend(cached[1])
        return out

    def _close_parts(self) -> None:
        if self._parts is not None:
            self._parts.close()
            self._parts = None
            self._parsed.clear()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        with self._lock:
            self._close_parts()
            if self._key is not None:
                self._key.close()
                self._key = None
