"""Emergency-checkpoint protocol: one request key, a gap rule, acknowledgements.

Any agent (or ``eft ckpt``) asks the whole job to save by writing
``/eft/<run>/ckpt/request`` with a compare-and-swap. While a request is open (not yet
acknowledged and younger than the request timeout) later requests join it instead
of starting another save, so many agents seeing the same trouble produce one
checkpoint. A save-and-exit request is never swallowed by an open plain save.

Rank 0's agent acknowledges with ``ckpt/ack/<id>`` and moves ``ckpt/latest`` only
after the checkpoint is complete on storage. The gap rule, which decides whether a
risk-driven request is worth a save, is a pure function used by the workers.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field

from .events import EventLog
from .store import EtcdClient, RunKeys

REASONS = ("risk", "manual", "signal", "watchdog")


@dataclass(frozen=True)
class CheckpointRequest:
    """The value of ``ckpt/request``; ``exit`` asks the ranks to stop after saving."""

    id: str
    reason: str
    requester: str
    exit: bool = False
    risk: float | None = None
    time: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes | str) -> "CheckpointRequest":
        raw = json.loads(data)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def gap_allows(
    reason: str,
    iteration: int,
    last_saved_iteration: int | None,
    save_interval: int | None,
    gap_fraction: float,
) -> tuple[bool, str]:
    """Whether a request is worth a save now, and why (pure).

    A risk-driven save right after a periodic one buys nothing; it runs only when at
    least ``gap_fraction * save_interval`` iterations have passed since the last
    save. Manual, preemption and watchdog requests always run: someone asked.
    """
    if reason != "risk":
        return True, f"{reason} requests always save"
    if last_saved_iteration is None or not save_interval:
        return True, "no previous save to compare with"
    since = iteration - last_saved_iteration
    needed = gap_fraction * save_interval
    if since >= needed:
        return True, f"{since} iterations since the last save (gap {needed:g})"
    return False, f"only {since} iterations since the save at {last_saved_iteration} (gap {needed:g})"


class CheckpointProtocol:
    """The etcd side: request, acknowledge, report. One per agent or CLI call."""

    def __init__(self, client: EtcdClient, keys: RunKeys, source: str, request_timeout: float = 300.0):
        self._client = client
        self._keys = keys
        self._timeout = request_timeout
        self.events = EventLog(client, keys, source)

    def current(self) -> CheckpointRequest | None:
        found = self._client.get(self._keys.ckpt_request)
        return CheckpointRequest.from_json(found.value) if found else None

    def is_open(self, request: CheckpointRequest) -> bool:
        if time.time() - request.time > self._timeout:
            return False
        return self._client.get(self._keys.ckpt_ack(request.id)) is None

    def request(
        self, reason: str, requester: str, *, exit: bool = False, risk: float | None = None
    ) -> tuple[CheckpointRequest, bool]:
        """Ask every rank to save; returns (the request in force, whether this call made it)."""
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {', '.join(REASONS)}, got {reason!r}")
        while True:
            found = self._client.get(self._keys.ckpt_request)
            if found is not None:
                pending = CheckpointRequest.from_json(found.value)
                if self.is_open(pending) and (pending.exit or not exit):
                    self.events.record("ckpt_request_joined", request_id=pending.id, reason=reason, requester=requester)
                    return pending, False
            new = CheckpointRequest(uuid.uuid4().hex[:12], reason, requester, exit, risk)
            swapped, _ = self._client.compare_and_swap(
                self._keys.ckpt_request, found.mod_revision if found else None, new.to_json()
            )
            if swapped:
                self.events.record(
                    "ckpt_request", request_id=new.id, reason=reason, requester=requester, exit=exit, risk=risk
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
        self.events.record("ckpt_saved", **record)

    def filtered(self, request_id: str, iteration: int, last_saved_iteration: int | None, why: str) -> None:
        self.events.record(
            "ckpt_filtered", request_id=request_id, iteration=iteration,
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
