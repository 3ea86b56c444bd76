"""A live local copy of the keys under one etcd prefix: one range read, then a watch.

The rendezvous waits on these instead of polling: a waiting node learns that a round
closed, that its closer died or that a participant's lease expired from a watch
event, and answers ``num_nodes_waiting`` from memory, with no request to etcd.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from elasticft.store import EtcdClient, StoreError, WatchEvent

log = logging.getLogger(__name__)


class KeySet:
    """Keys under ``prefix`` (key -> create revision), kept current by a watch.

    ``exact`` limits it to the one key equal to ``prefix`` (etcd watches prefixes).
    ``changed`` is called, from the watch thread, after every change.
    """

    def __init__(self, client: EtcdClient, prefix: str, changed: Callable[[], None], exact: bool = False):
        self._prefix = prefix
        self._exact = exact
        self._changed = changed
        self._lock = threading.Lock()
        self._closed = False
        self.keys: dict[str, int] = {}
        self.values: dict[str, bytes] = {}
        self.deleted: set[str] = set()  # keys seen to vanish since this copy was made
        items, revision = client.get_prefix(prefix)
        for item in items:
            if self._wanted(item.key):
                self.keys[item.key] = item.create_revision
                self.values[item.key] = item.value
        self._cancel = client.watch_prefix(prefix, self._on_events, start_revision=revision + 1,
                                           on_error=self._on_error)

    def _wanted(self, key: str) -> bool:
        return key == self._prefix or not self._exact

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            for event in events:
                if not self._wanted(event.key):
                    continue
                if event.deleted:
                    if self.keys.pop(event.key, None) is not None:
                        self.deleted.add(event.key)
                    self.values.pop(event.key, None)
                else:
                    # a watch event carries the mod revision; for a key new to this copy
                    # that is its create revision (eft never rewrites a participant key)
                    self.keys.setdefault(event.key, event.revision)
                    self.values[event.key] = event.value
        self._changed()

    def _on_error(self, exc: Exception) -> None:
        if not self._closed:
            log.warning("rendezvous watch on %s broke: %s", self._prefix, exc)
            self.broken = True
            self._changed()

    broken = False

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self.keys)

    def close(self) -> None:
        self._closed = True
        try:
            self._cancel()
        except StoreError:
            pass
