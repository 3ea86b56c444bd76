"""What each generation of workers spent its time on, recorded once when it stops.

``eft report`` splits a run's wall time into training, saving, loading and recovering.
Workers already keep a heartbeat file with their section totals (``worker/progress.py``);
it outlives the process, so the agent reads local rank 0's after the workers stop (a
restart, the end of the job) and records it as one ``workers_stopped`` event. One event
per node per generation, nothing per step: etcd sees no more traffic as the job trains.
"""

from __future__ import annotations

import logging
import os

from elasticft.contract.events import EventKind
from elasticft.contract.progress import read_progress

log = logging.getLogger(__name__)


class StopRecorder:
    """Records each generation's summary once (torch may stop the same workers twice)."""

    def __init__(self, record, run_dir: str | os.PathLike):
        self._record = record  # AgentContext.record
        self._run_dir = run_dir
        self._done = True  # nothing started yet

    def started(self) -> None:
        self._done = False

    def stopped(self, why: str) -> None:
        if self._done:
            return
        self._done = True
        beat = read_progress(self._run_dir).get(0)
        if beat is None or beat.started is None:
            log.debug("no heartbeat of local rank 0: no workers_stopped event")
            return
        self._record(EventKind.WORKERS_STOPPED, why=why, rank=beat.rank, iteration=beat.iteration,
                     first_iteration=beat.first_iteration, started=beat.started, first_step=beat.first_step,
                     last_beat=beat.time, steps=beat.steps, totals=beat.totals, stalls=beat.stalls)
