"""The run's event log: ``/eft/<run>/events/<time_ns>-<suffix>``, JSON, read by ``eft top``.

The kinds and their fields are listed in ``elasticft.contract.events``.

Keys sort by time, so a prefix read returns the log in order; no counter is shared
between writers, so writing an event never contends with anyone.

The log in etcd is bounded (``--eft-max-events``): one agent moves the oldest events to
an archive file (``move_oldest``), and ``export`` joins that file, where it can read it,
to what etcd still holds.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import uuid
from typing import Callable

from elasticft.contract.keys import RunKeys
from elasticft.contract.run_dir import write_atomically
from elasticft.store import EtcdClient, StoreError
from elasticft.store.outage import is_unavailable

log = logging.getLogger(__name__)

# Events held while etcd is out of reach, written when it answers again; beyond this the
# oldest are dropped (and counted): an outage of hours must not grow the agent without bound.
HELD_EVENTS = 1000


class EventLog:
    def __init__(self, client: EtcdClient, keys: RunKeys, source: str, notifier=None):
        self._client = client
        self._keys = keys
        self._source = source
        # An elasticft.agent.notify.Notifier: every recorded event is also offered to it (it
        # picks the kinds worth a notification); how events are stored does not change.
        self.notifier = notifier
        # Called with every recorded event, in the recording thread (the metrics board: keep it short).
        self.observers: list[Callable[[dict], None]] = []
        self._held: collections.deque[tuple[str, str]] = collections.deque(maxlen=HELD_EVENTS)
        self._lock = threading.Lock()
        self.dropped = 0  # events lost to the bound on held events
        self._flushes_on_recovery = False

    def record(self, kind: str, **fields) -> None:
        """Append one event of ``kind`` (an ``EventKind``: its value is what the log stores);
        a failure is logged, never raised (events are advisory)."""
        now = time.time()
        event = {"kind": kind, "time": now, "source": self._source, **fields}
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:6]}"
        self._put(self._keys.event(name), json.dumps(event), kind)
        if self.notifier is not None:
            self.notifier.send(event)
        for observe in self.observers:
            try:
                observe(event)
            except Exception:  # noqa: BLE001 - an observer's bug must not lose the next observer's view
                log.exception("an observer of event %s failed", kind)

    def _put(self, key: str, value: str, kind: str) -> None:
        try:
            self._client.put(key, value)
        except StoreError as exc:
            if not is_unavailable(exc):
                log.warning("could not record event %s: %s", kind, exc)
                return
            with self._lock:  # etcd away (its Outage said so): keep it for when etcd is back
                if len(self._held) == self._held.maxlen:
                    self.dropped += 1
                self._held.append((key, value))
                listen, self._flushes_on_recovery = not self._flushes_on_recovery, True
            if listen:
                self._client.outage.on_recovered(lambda *_: self.flush())

    def flush(self) -> None:
        """Write the events held during an outage (their keys keep the time they happened)."""
        with self._lock:
            held, dropped = list(self._held), self.dropped
            self._held.clear()
        for key, value in held:
            self._put(key, value, json.loads(value)["kind"])
        if held:
            log.info("recorded %d event(s) held while etcd was away%s", len(held),
                     f"; {dropped} older one(s) dropped" if dropped else "")

    def read(self, limit: int | None = None) -> list[dict]:
        """The events, oldest first (the newest ``limit`` when given)."""
        items, _ = self._client.get_prefix(self._keys.events)
        events = [json.loads(item.value) for item in sorted(items, key=lambda i: i.key)]
        return events[-limit:] if limit else events

    def move_oldest(self, archive: str, keep: int) -> int:
        """Append the oldest events beyond the newest ``keep`` to ``archive`` (JSON lines), then
        delete them from etcd; the number moved. Appended and synced before the delete: a crash
        in between leaves an event in both places (``export`` drops the copy), never in neither."""
        excess = self._client.count_prefix(self._keys.events) - keep
        if excess <= 0:
            return 0
        items = self._client.oldest(self._keys.events, excess)  # key order is time order
        lines = "".join(json.dumps(json.loads(item.value)) + "\n" for item in items)
        with open(archive, "a") as out:
            out.write(lines)
            out.flush()
            os.fsync(out.fileno())
        # the exact keys read, not a range: an event a skewed clock named older may have come since
        self._client.delete_keys([item.key for item in items])
        return len(items)

    def export(self, path: str, archive: str | None = None) -> None:
        """The whole log as JSON lines at ``path`` (written whole or not at all): the events moved
        to ``archive`` (when this node can read it) and those in etcd, by time. A failure is
        logged, never raised: the job's end must not fail for its report."""
        try:
            lines = [json.dumps(event) + "\n" for event in self.read()]
            moved = _read_lines(archive)
            if moved:
                unique = set(lines)
                lines = [line for line in moved if line not in unique] + lines
                lines.sort(key=lambda line: json.loads(line).get("time", 0))
            write_atomically(path, "".join(lines))
        except (StoreError, OSError, ValueError) as exc:
            log.warning("could not write the event log to %s: %s", path, exc)
        else:
            log.info("event log written to %s (eft report --events %s)%s", path, path,
                     f", with {len(moved)} events moved earlier to {archive}" if moved else "")


def _read_lines(path: str | None) -> list[str]:
    """The archive's lines, each once (a crash between append and delete can repeat one)."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as archive:
        return list(dict.fromkeys(line if line.endswith("\n") else line + "\n"
                                  for line in archive if line.strip()))
