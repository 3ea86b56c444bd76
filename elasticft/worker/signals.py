"""Preemption signals: remember that one arrived, so the next step can save and exit; the
other times a rank must stop (the exit duration, the job's time limit) and the signal that
asks it for its stacks."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time

from elasticft.config import CheckpointConfig, ConfigError, HangConfig, convert, from_env
from elasticft.contract.run_dir import WorkerEnv

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


def register_stack_dump() -> int | None:
    """Let the agent ask for this rank's Python stacks with a signal (hang reports); the signal."""
    try:
        signum = from_env(HangConfig).stack_signum()
    except ConfigError as exc:
        log.warning("no stack dumps on request: %s", exc)
        return None
    faulthandler.register(signum, file=sys.stderr, all_threads=True, chain=False)
    return signum


def exit_deadline(config: CheckpointConfig) -> float | None:
    """When --eft-exit-duration-in-mins has passed since the job's start (None: not set)."""
    minutes = config.exit_duration_mins
    if not minutes:
        return None
    raw = os.environ.get(WorkerEnv.START_TIME, "")
    start = convert("start_time", raw, 0.0, WorkerEnv.START_TIME.value) if raw else time.time()
    return start + minutes * 60


def time_limit() -> float | None:
    """When to save and exit ahead of the job's time limit (SLURM), if the agent set one."""
    raw = os.environ.get(WorkerEnv.DEADLINE, "")
    return convert("deadline", raw, 0.0, WorkerEnv.DEADLINE.value) if raw else None
