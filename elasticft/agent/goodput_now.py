"""The job's GPU-seconds by ``eft report``'s causes so far, for the metrics endpoint.

``eft report`` takes a finished run's event log apart (``goodput/breakdown.py``); this asks it
the same of a running job: the log in etcd, plus the running generation as its lowest rank's
heartbeat tells it now (the ``workers_stopped`` event it would record if it stopped). Only the
node holding global rank 0 computes it, whose local rank 0 is the rank the report takes for
each generation: one reader of the log per job, every ``--eft-metrics-goodput-interval``.

The figures are the job's, so exactly one node may export them: a node that no longer holds
rank 0 stops at its next scrape, and the node that now holds it computes them at its next look
(every second at most): a re-plan moves them in about a second, never shown by two nodes.
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

HANDOVER_LOOK = 1.0  # seconds between two looks at whether this node holds rank 0 (a computation: each interval)


class GoodputNow:
    def __init__(self, ctx: AgentContext, holds_rank0: Callable[[], bool], stops: Callable[[], StopRecorder],
                 interval: float):
        self._ctx = ctx
        self._holds_rank0 = holds_rank0
        self._stops = stops
        self._lock = threading.Lock()
        self._latest: tuple[dict[str, float], float | None] = ({}, None)
        self._interval = interval
        self._computed: float | None = None  # monotonic time of the newest computation as rank 0's node
        self._periodic = Periodic("eft-metrics-goodput", self.look, min(interval, HANDOVER_LOOK), run_first=False)

    def start(self) -> GoodputNow:
        self._periodic.start()
        return self

    def look(self) -> None:
        """Compute if this node holds rank 0 and has not computed for an interval (or ever, since it
        took rank 0); elsewhere, forget what an earlier round computed."""
        if not self._holds_rank0():
            with self._lock:
                self._latest, self._computed = ({}, None), None
            return
        if self._computed is None or time.monotonic() - self._computed >= self._interval:
            self._computed = time.monotonic()
            self.compute()

    def compute(self) -> None:
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
        """The newest figures, none where this node does not hold rank 0 now (whatever it computed)."""
        if not self._holds_rank0():
            return {}, None
        with self._lock:
            return self._latest

    def stop(self) -> None:
        self._periodic.stop()
