"""A read-only mirror of one run's keys in etcd, kept current by one watch on the run root.

``read()`` lists the keys ``eft top`` shows (nodes/, health/, ckpt/, events/,
layout, started); ``watch()`` then follows every change under the run root from
the revision after the reads, so nothing written in between is missed (a change
seen twice is applied twice, which converges to the same state). The rendezvous'
own keys (rdzv/, c10d/) change every few seconds and are ignored.

The mirror never writes. It also remembers what only a watcher can know: nodes
whose lease vanished (with their GPUs' last health records), recent temperatures
for the trend, and Xids seen since it started.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque

from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord, apply_node_events
from elasticft.store import EtcdClient, StoreError, WatchEvent
from elasticft.store.errors import StoreClosed
from elasticft.tui.state import LostNode, Record, RunState

log = logging.getLogger(__name__)

TREND_SAMPLES = 6  # temperatures kept per GPU for the trend
RESUBSCRIBE_PAUSE = 1.0  # seconds between attempts to re-establish a broken watch


def _parse(value: bytes):
    try:
        return json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None


class RunMirror:
    def __init__(self, client: EtcdClient, keys: RunKeys):
        self._client = client
        self._keys = keys
        self._lock = threading.Lock()
        self._nodes: dict[str, NodeRecord] = {}
        self._health: dict[tuple[str, int], dict] = {}
        self._departed: dict[str, dict[int, dict]] = {}  # node -> gpu -> last health record
        self._lost: dict[str, LostNode] = {}
        self._ckpt: dict[str, Record] = {}  # key relative to ckpt/ -> record
        self._mem: dict[str, Record] = {}  # key relative to mem/parts/ -> a memory checkpoint part
        self._events: dict[str, Record] = {}  # event name -> record
        self._layout: Record | None = None
        self._started: float | None = None
        self._restarts: Record | None = None
        self._temperatures: dict[tuple[str, int], deque] = {}
        self._xids: dict[tuple[str, int], set[int]] = {}
        self._watch_error: str | None = None
        self._resubscribing = False
        self._cancel = None
        self._closed = threading.Event()
        self.changed = threading.Event()  # set after every change that affects the view

    # -- reading -----------------------------------------------------------------

    def read(self) -> int:
        """List the run's keys into the mirror; return the lowest revision read at."""
        keys = self._keys
        revisions = []
        listed = []
        for prefix in (keys.nodes, keys.all_health, keys.checkpoints, keys.events, keys.mem_parts):
            items, revision = self._client.get_prefix(prefix)
            listed.extend(items)
            revisions.append(revision)
        singles = []
        for key in (keys.layout, keys.started, keys.restarts):
            item, revision = self._client.get_with_revision(key)
            revisions.append(revision)
            if item is not None:
                singles.append(item)
        with self._lock:
            old_nodes, old_health = self._nodes, self._health
            self._nodes, self._health, self._ckpt, self._events, self._mem = {}, {}, {}, {}, {}
            self._layout, self._started, self._restarts = None, None, None
            for item in listed + singles:
                self._apply(WatchEvent(item.key, item.value, False, item.mod_revision))
            # A node that vanished while the watch was down is judged by the same rule.
            for node_id, record in old_nodes.items():
                if node_id not in self._nodes:
                    self._departed[node_id] = {g: h for (n, g), h in old_health.items() if n == node_id}
                    self._nodes[node_id] = record
                    self._apply(WatchEvent(keys.node(node_id), b"", True, max(revisions)))
        self.changed.set()
        return min(revisions)

    def watch(self, revision: int) -> None:
        """Follow changes under the run root from ``revision`` (one etcd watch)."""
        self._cancel = self._client.watch_prefix(
            self._keys.root, self._on_events, start_revision=revision + 1, on_error=self._on_error
        )

    def start(self) -> "RunMirror":
        self.watch(self.read())
        return self

    def close(self) -> None:
        self._closed.set()
        if self._cancel is not None:
            try:
                self._cancel()
            except StoreError:
                pass

    # -- applying changes --------------------------------------------------------

    def _on_events(self, events: list[WatchEvent]) -> None:
        with self._lock:
            relevant = [self._apply(event) for event in events]
            if self._watch_error is not None:
                self._watch_error = None
                relevant.append(True)
        if any(relevant):
            self.changed.set()

    def _apply(self, event: WatchEvent) -> bool:
        """Apply one put or delete; False for keys the view does not show."""
        keys, key = self._keys, event.key
        if key.startswith(keys.nodes):
            node_id = key[len(keys.nodes):]
            for record in apply_node_events(self._nodes, keys.nodes, [event]):
                self._lost[record.node_id] = LostNode(
                    record, time.time(), event.revision, self._departed.get(record.node_id, {})
                )
            if event.deleted:
                self._departed.pop(node_id, None)
            else:
                self._lost.pop(node_id, None)  # back under the same name
            return True
        if key.startswith(keys.all_health):
            return self._apply_health(key[len(keys.all_health):], event)
        for table, prefix in ((self._ckpt, keys.checkpoints), (self._events, keys.events),
                              (self._mem, keys.mem_parts)):
            if key.startswith(prefix):
                if event.deleted:
                    table.pop(key[len(prefix):], None)
                else:
                    table[key[len(prefix):]] = Record(_parse(event.value), event.revision)
                return True
        if key == keys.layout:
            self._layout = None if event.deleted else Record(_parse(event.value), event.revision)
            return True
        if key == keys.started:
            value = None if event.deleted else _parse(event.value)
            self._started = float(value) if isinstance(value, (int, float)) else None
            return True
        if key == keys.restarts:
            self._restarts = None if event.deleted else Record(_parse(event.value), event.revision)
            return True
        return False

    def _apply_health(self, rest: str, event: WatchEvent) -> bool:
        node, _, gpu_text = rest.rpartition("/")
        if not node or not gpu_text.isdigit():
            return False
        key = (node, int(gpu_text))
        if event.deleted:
            # The lease's keys vanish together; health/ sorts before nodes/, so keep
            # the last record until the node's own delete says whether it was lost.
            last = self._health.pop(key, None)
            if last is not None:
                lost = self._lost.get(node)
                if lost is not None and node not in self._nodes:
                    lost.last_health[key[1]] = last  # the node's own delete came first
                else:
                    self._departed.setdefault(node, {})[key[1]] = last
            return True
        record = _parse(event.value)
        if not isinstance(record, dict):
            return False
        self._health[key] = record
        self._departed.pop(node, None)
        self._remember(key, record)
        return True

    def _remember(self, key: tuple[str, int], record: dict) -> None:
        sample = record.get("sample") if isinstance(record.get("sample"), dict) else {}
        temperature, timestamp = sample.get("temperature_c"), record.get("timestamp")
        if isinstance(temperature, (int, float)) and isinstance(timestamp, (int, float)):
            seen = self._temperatures.setdefault(key, deque(maxlen=TREND_SAMPLES))
            # A watch started before the read replays older values: keep time moving forward.
            if not seen or timestamp > seen[-1][0]:
                seen.append((timestamp, temperature))
        xids = sample.get("xids") or []
        if xids:
            self._xids.setdefault(key, set()).update(int(x) for x in xids if isinstance(x, int))

    def _on_error(self, exc: Exception) -> None:
        if self._closed.is_set():
            return
        with self._lock:
            self._watch_error = str(exc) or type(exc).__name__
            already, self._resubscribing = self._resubscribing, True
        self.changed.set()
        if already:  # a broken stream may report more than once
            return
        log.debug("watch on %s broke (%s); resubscribing", self._keys.root, exc)
        threading.Thread(target=self._resubscribe, name="eft-top-resubscribe", daemon=True).start()

    def _resubscribe(self) -> None:
        try:
            if self._cancel is not None:
                self._cancel()
        except StoreError:
            pass  # the old stream is gone with the connection
        while not self._closed.is_set():
            try:
                self.start()
                with self._lock:
                    self._watch_error = None
                    self._resubscribing = False
                self.changed.set()
                return
            except StoreClosed:  # eft top is ending
                return
            except StoreError as exc:
                with self._lock:
                    self._watch_error = str(exc)
                self.changed.set()
                self._closed.wait(RESUBSCRIBE_PAUSE)

    # -- the view's input ----------------------------------------------------------

    def snapshot(self) -> RunState:
        with self._lock:
            acks = {k[len("ack/"):]: r.value for k, r in self._ckpt.items() if k.startswith("ack/")}
            filtered = {k[len("filtered/"):]: r.value for k, r in self._ckpt.items() if k.startswith("filtered/")}
            latest = self._ckpt.get("latest")
            restarts = self._restarts.value if self._restarts is not None else None
            return RunState(
                run_id=self._keys.run_id,
                nodes=dict(self._nodes),
                health=dict(self._health),
                layout=self._layout,
                started=self._started,
                ckpt_request=self._ckpt.get("request"),
                acks={k: v for k, v in acks.items() if isinstance(v, dict)},
                filtered={k: v for k, v in filtered.items() if isinstance(v, dict)},
                latest=latest.value if latest is not None and isinstance(latest.value, dict) else None,
                restarts=restarts if isinstance(restarts, dict) else None,
                memory_parts=[r.value for r in self._mem.values() if isinstance(r.value, dict)],
                events=[self._events[name] for name in sorted(self._events)],
                lost_seen={n: lost for n, lost in self._lost.items() if n not in self._nodes},
                temperatures={k: list(v) for k, v in self._temperatures.items()},
                xids_seen={k: set(v) for k, v in self._xids.items()},
                watch_error=self._watch_error,
            )


def read_state(client: EtcdClient, keys: RunKeys) -> RunState:
    """One consistent-enough read of the run, without a watch (``--once``, ``eft status``)."""
    mirror = RunMirror(client, keys)
    mirror.read()
    return mirror.snapshot()
