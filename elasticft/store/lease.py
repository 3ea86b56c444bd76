"""etcd leases, all of one client's kept alive by one thread and one stream per period.

A node agent holds a few leases (its node record, its rendezvous keys) and a scale
bench holds hundreds per process. A thread and a fresh keep-alive stream per lease
per period would cost one gRPC stream each, every ``ttl / 3`` seconds; here one
thread sends the keep-alives of every lease of the client in one stream.
"""

from __future__ import annotations

import logging
import threading
import time

from elasticft.store import etcd_api_pb2 as api
from elasticft.store.etcd_rpc import LEASE_GRANT, LEASE_KEEP_ALIVE, LEASE_REVOKE
from elasticft.store.errors import StoreError
from elasticft.store.outage import is_unavailable

log = logging.getLogger(__name__)


class Lease:
    """An etcd lease kept alive by its client's ``LeaseKeeper`` every ``ttl / 3`` seconds.

    If etcd answers that the lease is gone (it expired while refreshes could not
    reach etcd), ``lost`` is set so the owner can react; ``regrant`` replaces it.
    """

    def __init__(self, client, ttl: float):
        self._client = client
        self.ttl = max(1, int(round(ttl)))
        self.lost = threading.Event()
        self.regrant()

    def regrant(self) -> None:
        """A new lease of the same TTL in this object, e.g. after ``lost``: whoever holds the
        object writes under the new one from now on. Raises StoreError."""
        old = getattr(self, "id", None)
        granted = self._client._call(lambda rpc: rpc.call(LEASE_GRANT, api.LeaseGrantRequest(TTL=self.ttl)))
        if old is not None:
            self._client._keeper.forget(old)  # if it still lives, it ends on its own
        self.id: int = granted.ID
        self.refreshed_at = time.monotonic()  # when etcd last confirmed the lease (monotonic)
        self.lost.clear()
        self._client._keeper.add(self)

    def confirm(self, timeout: float) -> bool:
        """One keep-alive of this lease now, on its own (not the keeper's stream, which may be
        waiting on a member that died or an election): True when etcd confirmed it, and then
        ``refreshed_at`` says so. A request that finds its member down goes to the next one."""
        sent = time.monotonic()
        per_member = timeout / max(1, self._client._members)  # a request may try every member in turn
        try:
            granted = self._client._call(lambda rpc: _keep_alive(rpc, [self.id], per_member))
        except StoreError:
            return False
        if granted.get(self.id, 0) <= 0:
            return False
        self.refreshed_at = max(self.refreshed_at, sent)
        return True

    def revoke(self) -> None:
        self._client._keeper.remove(self)
        try:
            self._client._call(lambda rpc: rpc.call(LEASE_REVOKE, api.LeaseRevokeRequest(ID=self.id)))
        except StoreError as exc:  # the TTL ends it anyway
            log.warning("could not revoke etcd lease %x: %s", self.id, exc)


def _keep_alive(rpc, ids: list[int], timeout: float | None = None) -> dict[int, int]:
    """One LeaseKeepAlive stream carrying every id; lease id -> TTL etcd granted (<= 0: gone)."""
    requests = [api.LeaseKeepAliveRequest(ID=i) for i in ids]
    answers = rpc.stream(LEASE_KEEP_ALIVE, iter(requests), timeout or rpc.timeout)
    return {answer.ID: answer.TTL for answer in answers}


class LeaseKeeper:
    """The one thread that refreshes every live lease of a client."""

    def __init__(self, client):
        self._client = client
        self._leases: dict[int, Lease] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases[lease.id] = lease
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="eft-leases", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def remove(self, lease: Lease) -> None:
        self.forget(lease.id)

    def forget(self, lease_id: int) -> None:
        with self._lock:
            self._leases.pop(lease_id, None)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._changed.notify_all()

    def _period(self) -> float | None:
        return min(lease.ttl for lease in self._leases.values()) / 3.0 if self._leases else None

    def _run(self) -> None:
        last = time.monotonic()
        with self._lock:
            while not self._stopped:
                period, now = self._period(), time.monotonic()
                if period is None or now < last + period:
                    # a lease added or removed only changes when the next refresh is due
                    self._changed.wait(None if period is None else last + period - now)
                    continue
                last = now
                leases = dict(self._leases)
                self._lock.release()
                try:
                    self._refresh(leases)
                finally:
                    self._lock.acquire()

    def _refresh(self, leases: dict[int, Lease]) -> None:
        sent = time.monotonic()
        try:
            granted = self._client._call(lambda rpc: _keep_alive(rpc, list(leases)))
        except StoreError as exc:  # etcd away: its Outage says so, once
            log.log(logging.DEBUG if is_unavailable(exc) else logging.WARNING,
                    "could not refresh %d etcd lease(s): %s", len(leases), exc)
            return
        for lease_id, lease in leases.items():
            ttl = granted.get(lease_id)
            if ttl is not None and ttl > 0:
                lease.refreshed_at = sent  # etcd counts the TTL from no later than this
            elif ttl is not None:
                log.warning("etcd lease %x expired on the server", lease_id)
                self.forget(lease_id)
                if lease.id == lease_id:  # not regranted meanwhile
                    lease.lost.set()
