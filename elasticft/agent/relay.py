"""The agent's half of the checkpoint relay: etcd <-> this node's workers.

Workers never talk to etcd (thousands of them must not each hold a watch). The agent
watches ``ckpt/request`` and hands each new open request to its workers as
``<run_dir>/request.json`` (written atomically: tmp file, then rename), which the
worker hook checks with one ``stat`` per iteration. Rank 0 answers through
``<run_dir>/outbox/``: one JSON file per message (``ack`` after a complete save,
``filtered`` when the gap rule skipped a risk request), which the agent forwards to
etcd and deletes. The contract is written out in docs/checkpoint.md.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Callable

from elasticft.agent.ckpt_protocol import CheckpointProtocol, CheckpointRequest
from elasticft.contract.keys import RunKeys
from elasticft.contract.run_dir import (
    OUTBOX_DIR,
    REQUEST_FILE,
    OutboxKind,
    write_atomically,
)
from elasticft.store import EtcdClient, StoreError, WatchEvent
from elasticft.store.outage import is_unavailable

log = logging.getLogger(__name__)

OUTBOX_POLL_SECONDS = 0.1  # an ack reaches etcd within this; the cost is one listdir


class CheckpointRelay:
    def __init__(
        self,
        client: EtcdClient,
        keys: RunKeys,
        protocol: CheckpointProtocol,
        run_dir: Path,
        on_request: Callable[[CheckpointRequest], None] | None = None,
    ):
        self._client = client
        self._keys = keys
        self._protocol = protocol
        self.run_dir = Path(run_dir)
        self.outbox = self.run_dir / OUTBOX_DIR
        self._on_request = on_request
        self.handlers: dict[str, Callable[[dict], None]] = {}  # other outbox kinds (the memory tier's)
        self.pending: CheckpointRequest | None = None
        self._stop = threading.Event()
        self._cancel = None
        self._thread: threading.Thread | None = None

    def start(self) -> "CheckpointRelay":
        self.outbox.mkdir(parents=True, exist_ok=True)
        found, revision = self._client.get_with_revision(self._keys.ckpt_request)
        if found is not None:
            request = CheckpointRequest.from_json(found.value)
            if self._protocol.is_open(request):  # not one a previous generation already saved
                self._deliver(request)
        self._cancel = self._client.watch_prefix(self._keys.ckpt_request, self._on_events, start_revision=revision + 1)
        self._thread = threading.Thread(target=self._forward_outbox, name="eft-ckpt-relay", daemon=True)
        self._thread.start()
        return self

    def _on_events(self, events: list[WatchEvent]) -> None:
        for event in events:
            if not event.deleted and event.key == self._keys.ckpt_request:
                self._deliver(CheckpointRequest.from_json(event.value))

    def _deliver(self, request: CheckpointRequest) -> None:
        self.pending = request
        write_atomically(self.run_dir / REQUEST_FILE, request.to_json())
        log.info("checkpoint request %s (%s from %s%s)", request.id, request.reason, request.requester,
                 ", then exit" if request.exit else "")
        if self._on_request is not None:
            self._on_request(request)

    def forget_answered_request(self) -> None:
        """Before workers (re)start: remove a request they already saved for.

        New workers cannot tell an old request.json from a new one; an answered one
        would make them save again at their first iteration.
        """
        if self.pending is not None and not self._protocol.is_open(self.pending):
            (self.run_dir / REQUEST_FILE).unlink(missing_ok=True)

    def _forward_outbox(self) -> None:
        while not self._stop.wait(OUTBOX_POLL_SECONDS):
            self.drain()

    def drain(self) -> None:
        """Forward and delete every complete message in the outbox."""
        try:
            names = sorted(n for n in os.listdir(self.outbox) if n.endswith(".json"))
        except FileNotFoundError:
            return
        for name in names:
            path = self.outbox / name
            try:
                message = json.loads(path.read_text())
                self._forward(message)
            except (OSError, ValueError) as exc:
                log.warning("dropping unreadable outbox message %s: %s", name, exc)
            except StoreError as exc:  # kept in the outbox; etcd away is said once, by its Outage
                log.log(logging.DEBUG if is_unavailable(exc) else logging.WARNING,
                        "could not forward %s, will retry: %s", name, exc)
                return
            path.unlink(missing_ok=True)

    def _forward(self, message: dict) -> None:
        kind = message.get("type")
        if kind == OutboxKind.ACK:
            request_id = message.get("request_id")
            if request_id is None and self.pending is not None and self._protocol.is_open(self.pending):
                request_id = self.pending.id  # a save after the request answers it
            self._protocol.acknowledge(
                request_id, int(message["iteration"]), str(message["path"]), float(message["seconds"]),
                exit=bool(message.get("exit", False)),
            )
            log.info("checkpoint of iteration %s complete at %s (%.2f s)", message["iteration"], message["path"],
                     float(message["seconds"]))
        elif kind == OutboxKind.FILTERED:
            self._protocol.filtered(message["request_id"], int(message["iteration"]),
                                    message.get("last_saved_iteration"), str(message["why"]))
            log.info("risk request %s skipped: %s", message["request_id"], message["why"])
        elif kind in self.handlers:
            self.handlers[kind](message)
        else:
            log.warning("ignoring outbox message of unknown type %r", kind)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._cancel is not None:
            try:
                self._cancel()
            except StoreError:
                pass
        self.drain()
