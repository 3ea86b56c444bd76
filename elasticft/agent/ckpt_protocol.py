"""Emergency-checkpoint protocol: one request key, a gap rule, acknowledgements.

Any agent (or ``eft ckpt``) asks the whole job to save by writing
``/eft/<run>/ckpt/request`` with a compare-and-swap. While a request is open (neither
acknowledged nor skipped by the gap rule, and younger than the request timeout) later
requests join it instead of starting another save, so many agents seeing the same
trouble produce one checkpoint. Two kinds never join: a save-and-exit request does
not join a plain save, and a request that must save (manual, signal, watchdog) does
not join a risk request, which the gap rule may still skip.

Rank 0's agent acknowledges with ``ckpt/ack/<id>`` and moves ``ckpt/latest`` only
after the checkpoint is complete on storage. The gap rule, which decides whether a
risk-driven request is worth a save, is the pure ``gap_filter`` the workers apply.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict

from elasticft.agent.events import EventLog
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import CheckpointRequest, RequestReason
from elasticft.store import EtcdClient


class CheckpointProtocol:
    """The etcd side: request, acknowledge, report. One per agent or CLI call."""

    def __init__(self, client: EtcdClient, keys: RunKeys, source: str, request_timeout: float = 300.0,
                 events: EventLog | None = None):
        self._client = client
        self._keys = keys
        self._timeout = request_timeout
        # the agent's own log (its notifier and metrics see these events too); a command's: one of its own
        self.events = events or EventLog(client, keys, source)

    def current(self) -> CheckpointRequest | None:
        found = self._client.get(self._keys.ckpt_request)
        return CheckpointRequest.from_json(found.value) if found else None

    def is_open(self, request: CheckpointRequest) -> bool:
        if time.time() - request.time > self._timeout:
            return False
        for key in (self._keys.ckpt_ack(request.id), self._keys.ckpt_filtered(request.id)):
            if self._client.get(key) is not None:
                return False
        return True

    @staticmethod
    def _joins(pending: CheckpointRequest, reason: str, exit: bool) -> bool:
        if exit and not pending.exit:
            return False
        return not (pending.reason == RequestReason.RISK and reason != RequestReason.RISK)

    def request(
        self, reason: str, requester: str, *, exit: bool = False, risk: float | None = None
    ) -> tuple[CheckpointRequest, bool]:
        """Ask every rank to save; returns (the request in force, whether this call made it)."""
        try:
            reason = RequestReason(reason)
        except ValueError:
            raise ValueError(f"reason must be one of {', '.join(RequestReason)}, got {reason!r}") from None
        while True:
            found = self._client.get(self._keys.ckpt_request)
            if found is not None:
                pending = CheckpointRequest.from_json(found.value)
                if self._joins(pending, reason, exit) and self.is_open(pending):
                    self.events.record(EventKind.CKPT_REQUEST_JOINED, request_id=pending.id, reason=reason, requester=requester)
                    return pending, False
            new = CheckpointRequest(uuid.uuid4().hex[:12], reason, requester, exit, risk)
            swapped, _ = self._client.compare_and_swap(
                self._keys.ckpt_request, found.mod_revision if found else None, new.to_json()
            )
            if swapped:
                self.events.record(
                    EventKind.CKPT_REQUEST, request_id=new.id, reason=reason, requester=requester, exit=exit, risk=risk
                )
                return new, True
            # Another requester won the race: go round and join its request.

    def acknowledge(self, request_id: str | None, iteration: int, path: str, seconds: float, exit: bool = False) -> None:
        """Record a complete checkpoint: its ack (when it answered a request) and ``latest``."""
        record = {"request_id": request_id, "iteration": iteration, "path": path, "seconds": seconds,
                  "exit": exit, "time": time.time()}
        if request_id:
            self._client.put(self._keys.ckpt_ack(request_id), json.dumps(record))
        self._client.put(self._keys.ckpt_latest, json.dumps(record))
        self.events.record(EventKind.CKPT_SAVED, **record)

    def filtered(self, request_id: str, iteration: int, last_saved_iteration: int | None, why: str) -> None:
        """The workers skipped a risk request: close it, and say why in the event log."""
        self._client.put(self._keys.ckpt_filtered(request_id), json.dumps({"iteration": iteration, "why": why}))
        self.events.record(
            EventKind.CKPT_FILTERED, request_id=request_id, iteration=iteration,
            last_saved_iteration=last_saved_iteration, why=why,
        )

    def status(self) -> dict:
        """The last request, every ack, and the latest complete checkpoint."""
        request = self.current()
        acks, _ = self._client.get_prefix(self._keys.ckpt_acks)
        latest = self._client.get(self._keys.ckpt_latest)
        return {
            "request": asdict(request) if request else None,
            "acks": sorted((json.loads(a.value) for a in acks), key=lambda a: a["time"]),
            "latest": json.loads(latest.value) if latest else None,
        }
