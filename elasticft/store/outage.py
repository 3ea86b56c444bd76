"""etcd out of reach: said once when it starts, every 30 s while it lasts, once when it ends.

While etcd is away the workers keep training: nothing they do needs it. What does need
it (lease refreshes, the checkpoint relay's acks, event records, watches) retries, and
every retry fails the same way. Logging each failure buries the one fact that matters
under hundreds of lines a minute; instead every client of one etcd (a process holds a few)
shares one ``Outage`` that speaks for all of them, and callers log their own failures
at debug level when ``is_unavailable(exc)``. When etcd answers again, listeners hear how
long it was away (the agent records an ``etcd_unavailable`` event).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from elasticft.store.errors import StoreClosed, StoreError, StoreUnavailable

log = logging.getLogger(__name__)

REPORT_EVERY = 30.0  # seconds between "still unreachable" lines
SETTLE = 1.0  # seconds etcd must keep answering before an outage counts as over


class Outage:
    """One etcd (an endpoint list) as this process sees it: reachable, or away since when."""

    def __init__(self, endpoints: str, clock: Callable[[], float] = time.monotonic, quiet: bool = False):
        # ``clock`` must be the one EtcdClient stamps its requests with: time.monotonic
        self.endpoints = endpoints
        self.quiet = quiet  # a probe's own: an etcd that is not up yet is no outage to report
        self._clock = clock
        self._lock = threading.Lock()
        self.since: float | None = None  # monotonic time of the first failure of this outage
        self.failed = 0  # requests failed in this outage
        self._reported = 0.0
        self._answered = float("-inf")  # when etcd last answered a request
        self._back: float | None = None  # when etcd first answered again in this outage
        self._announced = False  # the outage was said (a second failure in a row)
        self._listeners: list[Callable[[float, int], None]] = []

    def on_recovered(self, listener: Callable[[float, int], None]) -> None:
        """Call ``listener(seconds, failed_requests)`` at the end of every outage."""
        with self._lock:
            self._listeners.append(listener)

    def failure(self, started: float) -> None:
        """A request sent at ``started`` (this Outage's clock) found etcd out of reach."""
        with self._lock:
            now = self._clock()
            if started <= self._answered:
                return  # sent before etcd last answered: it says nothing about etcd now
            self.failed += 1
            self._back = None  # not back after all
            if self.quiet:
                return
            if self.since is None:
                self.since = now  # one failure is not yet an outage: a one-shot command just fails
            elif not self._announced:
                self._announced, self._reported = True, now
                log.warning("etcd at %s is unreachable: eft waits for it, retrying its requests (running "
                            "workers train on meanwhile)", self.endpoints)
            elif now - self._reported >= REPORT_EVERY:
                self._reported = now
                log.warning("etcd at %s still unreachable after %.0f s (%d request(s) failed)", self.endpoints,
                            now - self.since, self.failed)

    def success(self) -> None:
        """etcd answered a request. An outage ends once it has answered for SETTLE seconds:
        the first moments after a restart bring a few more failures (requests in flight,
        connections still backing off), which are the same outage, not a new one."""
        now = self._clock()
        self._answered = now
        if self.since is None:  # the common case: no lock, nothing more to do
            return
        with self._lock:
            if self.since is None:
                return
            if self._back is None:
                self._back = now
                return
            if now - self._back < SETTLE:
                return
            seconds, failed, announced = self._back - self.since, self.failed, self._announced
            self.since, self.failed, self._back, self._announced = None, 0, None, False
            listeners = list(self._listeners)
        if not announced:
            return  # a single failed request
        log.warning("etcd at %s answers again after %.1f s (%d request(s) failed meanwhile)", self.endpoints,
                    seconds, failed)
        for listener in listeners:
            listener(seconds, failed)


_OUTAGES: dict[str, Outage] = {}
_REGISTRY_LOCK = threading.Lock()


def outage_of(endpoints: str) -> Outage:
    """The one Outage of ``endpoints`` in this process, shared by all its clients."""
    with _REGISTRY_LOCK:
        return _OUTAGES.setdefault(endpoints, Outage(endpoints))


T = TypeVar("T")
OUTAGE_RETRY = 0.5  # seconds between attempts while etcd is out of reach: nothing to await meanwhile


def through_outage(attempt: Callable[[], T], limit: float, what: str) -> T:
    """``attempt()``, again every OUTAGE_RETRY s while etcd is out of reach, up to ``limit`` s.

    For what cannot happen without etcd (a rendezvous, registering again): failing at once
    would let an etcd restart end the job. The wait is said once when it starts; past the
    limit, StoreUnavailable names the flag that sets it.
    """
    started = None
    while True:
        try:
            return attempt()
        except StoreUnavailable as exc:
            now = time.monotonic()
            if started is None:
                started = now
                log.warning("etcd is out of reach: %s waits for it, up to %g s (--eft-etcd-outage-limit)", what, limit)
            if now - started >= limit:
                raise StoreUnavailable(f"{exc}: {what} waited {limit:g} s for it (--eft-etcd-outage-limit)") from None
            time.sleep(OUTAGE_RETRY)


def is_unavailable(exc: StoreError) -> bool:
    """An error that says nothing new: etcd is out of reach (the Outage has said so already),
    or the client was closed (its owner is shutting down)."""
    return isinstance(exc, (StoreUnavailable, StoreClosed))
