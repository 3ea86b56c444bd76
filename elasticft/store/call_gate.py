"""Closing an etcd client safely: no request starts after ``close``, none is cut off.

gRPC's Python channel is not safe to close while another thread starts a call on it or
is inside one: a call racing the close has crashed a test process with a segfault (a
store waiter left behind by a failed case). An agent closes its client while its
services' threads may still be mid-request (a sampler publishing, a relay re-watching,
a membership watch resubscribing after the stream ended). So every request passes this
gate: once closed it refuses new ones (``StoreClosed``, a ``StoreError`` every caller
already handles), and ``close`` waits for the ones in flight before the channel goes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from elasticft.store.errors import StoreClosed


class CallGate:
    def __init__(self, what: str):
        self._what = what
        self._changed = threading.Condition()
        self._in_flight = 0
        self.closed = False

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Around one request; raises StoreClosed once the gate is closed."""
        with self._changed:
            if self.closed:
                raise StoreClosed(f"{self._what}: client closed")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._in_flight -= 1
                self._changed.notify_all()

    def close(self, timeout: float) -> bool:
        """Refuse new requests; True once none is in flight, False if one still is after
        ``timeout`` seconds (every request has a deadline: only a stuck library call stays)."""
        with self._changed:
            self.closed = True
            return self._changed.wait_for(lambda: self._in_flight == 0, timeout)
