"""Preemption signals: remember that one arrived, so the next step can save and exit."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


class ExitSignals:
    """Installs a handler for each signal in ``signums`` that only records the signal.

    A handler runs between two bytecodes of the main thread, possibly inside a
    collective or a checkpoint write, so it does no I/O and takes no lock; the
    training loop acts on ``received`` at its next ``Hook.step``. The previous handler
    is replaced, not called: its default for SIGTERM is to die, which is exactly what
    a save-and-exit signal must not do.
    """

    def __init__(self, signums: list[int]):
        self.received: int | None = None
        if not signums:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "eft hook created outside the main thread: Python only lets the main thread "
                "handle signals, so %s will not trigger a save",
                ", ".join(signal.Signals(s).name for s in signums),
            )
            return
        for signum in signums:
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.received = signum
