"""What each generation of workers spent its time on, recorded once when it stops.

``eft report`` splits a run's wall time into training, saving, loading and recovering.
Workers already keep a heartbeat file with their section totals (``worker/progress.py``);
it outlives the process, so the agent reads local rank 0's after the workers stop (a
restart, the end of the job) and records it as one ``workers_stopped`` event. One event
per node per generation, nothing per step: etcd sees no more traffic as the job trains.

The same event carries the generation's start phases (``contract/phases.py``): when its
rendezvous round formed, its ranks were assigned and its processes spawned (the agent's
steps mark them here), and when its workers' imports, process group and load ended (their
heartbeat's), so ``eft report`` can take each restart apart.
"""

from __future__ import annotations

import logging
import os
import time

from elasticft.contract.events import EventKind
from elasticft.contract.phases import RestartPhase
from elasticft.contract.progress import reached, read_progress

log = logging.getLogger(__name__)


class StopRecorder:
    """Records each generation's summary once (torch may stop the same workers twice).
    ``record`` None (no etcd): marks phases, records nothing."""

    def __init__(self, record, run_dir: str | os.PathLike):
        self._record = record  # AgentContext.record
        self._run_dir = run_dir
        self._done = True  # nothing started yet
        self._phases: dict[str, float] = {}  # the next (or running) generation's agent-side phase ends

    def stamp(self, phase: RestartPhase) -> None:
        """One of the agent's phases of the next generation ended now (a later mark replaces it)."""
        self._phases[str(RestartPhase(phase))] = time.time()

    def started(self) -> None:
        self._done = False

    @property
    def run_dir(self) -> str | os.PathLike:
        return self._run_dir

    @property
    def phases(self) -> dict[RestartPhase, float]:
        """The agent's phase ends of the running (or next) generation, so far."""
        return {RestartPhase(name): when for name, when in dict(self._phases).items()}  # read from a scrape's thread

    def stopped(self, why: str) -> None:
        if self._done or self._record is None:
            return
        self._done = True
        summary = self.summary(why)
        self._phases = {}
        if summary is None:
            log.debug("no heartbeat of local rank 0: no workers_stopped event")
            return
        self._record(EventKind.WORKERS_STOPPED, **summary)

    def summary(self, why: str) -> dict | None:
        """The running generation's ``workers_stopped`` fields as of now (None: local rank 0 has not beaten)."""
        beats = read_progress(self._run_dir)
        beat = beats.get(0)
        if beat is None or beat.started is None:
            return None
        return dict(why=why, rank=beat.rank, iteration=reached(beats), first_iteration=beat.first_iteration,
                    started=beat.started, first_step=beat.first_step, last_beat=beat.time, steps=beat.steps,
                    totals=beat.totals, stalls=beat.stalls, stall_buckets={t: list(c) for t, c in beat.stall_buckets.items()},
                    phases={**self._phases, **beat.phases},
                    loaded_from=beat.loaded_from, loaded_bytes=beat.loaded_bytes)
