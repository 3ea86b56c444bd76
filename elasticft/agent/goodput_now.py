"""The job's GPU-seconds by ``eft report``'s causes so far, for the metrics endpoint.

``eft report`` takes a finished run's event log apart (``goodput/breakdown.py``); this asks it
the same of a running job: the log in etcd, plus the running generation as its lowest rank's
heartbeat tells it now (the ``workers_stopped`` event it would record if it stopped). Only the
node holding global rank 0 computes it, whose local rank 0 is the rank the report takes for
each generation: one reader of the log per job, every ``--eft-metrics-goodput-interval``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from elasticft.agent.context import AgentContext
from elasticft.agent.segments import StopRecorder
from elasticft.contract.events import EventKind
from elasticft.goodput.breakdown import ReportError, breakdown
from elasticft.periodic import Periodic

log = logging.getLogger(__name__)


class GoodputNow:
    def __init__(self, ctx: AgentContext, holds_rank0: Callable[[], bool], stops: Callable[[], StopRecorder],
                 interval: float):
        self._ctx = ctx
        self._holds_rank0 = holds_rank0
        self._stops = stops
        self._lock = threading.Lock()
        self._latest: tuple[dict[str, float], float | None] = ({}, None)
        self._periodic = Periodic("eft-metrics-goodput", self.compute, interval, run_first=False)

    def start(self) -> GoodputNow:
        self._periodic.start()
        return self

    def compute(self) -> None:
        """One computation; elsewhere than on rank 0's node, forget what an earlier round computed."""
        if not self._holds_rank0():
            with self._lock:
                self._latest = ({}, None)
            return
        events = self._ctx.events.read()
        running = self._stops().summary("running")
        if running is not None:
            events.append({"kind": EventKind.WORKERS_STOPPED, "time": time.time(), "source": self._ctx.node_id,
                           **running})
        try:
            report = breakdown(events)
        except ReportError as exc:
            log.debug("no goodput yet: %s", exc)
            return
        with self._lock:
            self._latest = (dict(report.seconds), report.goodput)

    def latest(self) -> tuple[dict[str, float], float | None]:
        with self._lock:
            return self._latest

    def stop(self) -> None:
        self._periodic.stop()
