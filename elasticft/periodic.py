"""One daemon thread that runs a task every few seconds: the agent's samplers and checks.

The health sampler, the watchdogs and the straggler monitor all need the same loop:
run now or after the first interval, wait on an event so that ``stop()`` (and
``wake()``) cut the wait short, and never let a failure of the task end the thread or
the agent. A failure is logged once per new message, not once per round.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, task: Callable[[], object], interval: float, *, run_first: bool = True):
        if not interval > 0:
            raise ValueError(f"{name}: the interval must be positive, got {interval}")
        self.name = name
        self.task = task
        self.interval = interval
        self.run_first = run_first  # False: the first run is one interval after start()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error: str | None = None

    def start(self) -> "Periodic":
        if self._thread is not None:
            raise RuntimeError(f"{self.name} is already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Run now instead of at the end of the current interval."""
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop; returns as soon as a run in progress has finished (at most ``timeout``)."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        if not self.run_first:
            self._pause()
        while not self._stop.is_set():
            try:
                self.task()
                self._last_error = None
            except Exception as exc:  # noqa: BLE001 - a check must not take the agent down
                if str(exc) != self._last_error:
                    self._last_error = str(exc)
                    log.warning("%s: %s: %s", self.name, type(exc).__name__, exc, exc_info=True)
            self._pause()

    def _pause(self) -> None:
        self._wake.wait(self.interval)
        self._wake.clear()


class PeriodicTask:
    """Base of the agent's periodic monitors (health sampler, watchdogs, stragglers).

    A subclass sets ``name`` and ``interval`` and implements ``check_once`` (one round,
    which tests call directly); this base owns the thread. ``run_first`` False makes
    the first round come one interval after ``start()``.
    """

    name = "eft-periodic"
    interval: float = 1.0
    run_first = True
    _thread: Periodic | None = None

    def check_once(self) -> object:
        raise NotImplementedError

    @property
    def enabled(self) -> bool:
        """False: nothing to check with this configuration; the agent does not start it."""
        return True

    def start(self):
        self._thread = Periodic(self.name, self.check_once, self.interval, run_first=self.run_first).start()
        return self

    def wake(self) -> None:
        """Run a round now instead of at the end of the current interval."""
        if self._thread is not None:
            self._thread.wake()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop; returns as soon as a round in progress has finished (at most ``timeout``)."""
        if self._thread is not None:
            self._thread.stop(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.running
