"""A live local copy of the keys in one etcd key range: one range read, then a watch.

The rendezvous (and the memory tier) wait on these instead of polling: a waiting node learns that a round
closed, that its closer died or that a participant's lease expired from a watch
event, and answers ``num_nodes_waiting`` from memory, with no request to etcd.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elasticft.store import EtcdClient, StoreError, WatchEvent
from elasticft.store.records import KeyValue
from elasticft.store.client import prefix_end
from elasticft.store.outage import is_unavailable

log = logging.getLogger(__name__)


class KeySet:
    """Keys in [start, end) (key -> create revision, and their values), kept current by a watch.

    ``end`` None means every key under the prefix ``start``; ``exact`` only ``start`` itself.
    With ``after`` (a revision) nothing is read: the copy starts with ``items`` (the range as
    the caller read it at that revision, in a request of its own; none: empty) and holds what
    changed after it; a key deleted that it never held is in ``vanished``.
    ``changed`` is called, from the watch thread, after every change.
    """

    def __init__(self, client: EtcdClient, start: str, changed: Callable[[], None], end: str | None = None,
                 exact: bool = False, after: int | None = None, items: list[KeyValue] | None = None):
        self._start = start
        self._exact = exact
        self._changed = changed
        self._lock = threading.Lock()
        self._closed = False
        self.broken = False  # the watch failed: the copy is stale, make a new one
        self.keys: dict[str, int] = {}
        self.values: dict[str, bytes] = {}
        self.vanished: list[str] = []  # keys deleted that this copy never held (``after`` copies)
        end = end or (start + "\0" if exact else prefix_end(start))
        if after is None:
            items, after = client.get_range(start, end)
        for item in items or ():
            self.keys[item.key] = item.create_revision
            self.values[item.key] = item.value
        self._cancel = client.watch_range(start, end, self._on_events, start_revision=after + 1,
                                          on_error=self._on_error)

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for event in events:
                if event.deleted:
                    if self.keys.pop(event.key, None) is None:
                        self.vanished.append(event.key)
                    self.values.pop(event.key, None)
                else:
                    # a watch event carries the mod revision; for a key new to this copy
                    # that is its create revision (the rendezvous never rewrites its keys)
                    self.keys.setdefault(event.key, event.revision)
                    self.values[event.key] = event.value
        self._changed()

    def _on_error(self, exc: Exception) -> None:
        if not self._closed:
            log.log(logging.DEBUG if is_unavailable(exc) else logging.WARNING,
                    "watch on %s broke: %s", self._start, exc)
            self.broken = True
            self._changed()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self.values.get(key)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.keys

    def snapshot(self) -> dict[str, bytes]:
        with self._lock:
            return dict(self.values)

    def created_after(self, prefix: str, revision: int) -> int:
        """How many keys under ``prefix`` were created after ``revision``."""
        with self._lock:
            return sum(1 for key, created in self.keys.items() if created > revision and key.startswith(prefix))

    def __len__(self) -> int:
        with self._lock:
            return len(self.keys)

    def close(self) -> None:
        self._closed = True
        try:
            self._cancel()
        except StoreError:
            pass
