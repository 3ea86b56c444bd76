"""The run's event log: ``/eft/<run>/events/<time_ns>-<suffix>``, JSON, read by ``eft top``.

The kinds and their fields are listed in ``elasticft.contract.events``.

Keys sort by time, so a prefix read returns the log in order; no counter is shared
between writers, so writing an event never contends with anyone.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from elasticft.contract.keys import RunKeys
from elasticft.contract.run_dir import write_atomically
from elasticft.store import EtcdClient, StoreError

log = logging.getLogger(__name__)


class EventLog:
    def __init__(self, client: EtcdClient, keys: RunKeys, source: str, notifier=None):
        self._client = client
        self._keys = keys
        self._source = source
        # An elasticft.agent.notify.Notifier: every recorded event is also offered to it (it
        # picks the kinds worth a notification); how events are stored does not change.
        self.notifier = notifier

    def record(self, kind: str, **fields) -> None:
        """Append one event of ``kind`` (an ``EventKind``: its value is what the log stores);
        a failure is logged, never raised (events are advisory)."""
        now = time.time()
        event = {"kind": kind, "time": now, "source": self._source, **fields}
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:6]}"
        try:
            self._client.put(self._keys.event(name), json.dumps(event))
        except StoreError as exc:
            log.warning("could not record event %s: %s", kind, exc)
        if self.notifier is not None:
            self.notifier.send(event)

    def read(self, limit: int | None = None) -> list[dict]:
        """The events, oldest first (the newest ``limit`` when given)."""
        items, _ = self._client.get_prefix(self._keys.events)
        events = [json.loads(item.value) for item in sorted(items, key=lambda i: i.key)]
        return events[-limit:] if limit else events

    def export(self, path: str) -> None:
        """The whole log as JSON lines at ``path`` (written whole or not at all); a failure is
        logged, never raised: the job's end must not fail for its report."""
        try:
            lines = "".join(json.dumps(event) + "\n" for event in self.read())
            write_atomically(path, lines)
        except (StoreError, OSError) as exc:
            log.warning("could not write the event log to %s: %s", path, exc)
        else:
            log.info("event log written to %s (eft report --events %s)", path, path)
