"""The agent's hang duties, kept out of agent.py: read heartbeats, enforce section
timeouts, learn them (``--eft-auto-timeouts``), and turn an overrun into a worker failure
that torch restarts like any other (charged to ``--max-restarts``).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    WorkerGroup,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elasticft.agent.auto_timeouts import SectionTimeouts
from elasticft.agent.hangs import (
    FAULTHANDLER_GRACE,
    PY_SPY_TIMEOUT,
    Overrun,
    dump_stacks,
    find_overruns,
)
from elasticft.config import HangConfig
from elasticft.contract.events import EventKind
from elasticft.contract.progress import progress_dir, read_progress
from elasticft.torch_seam import write_error_file

log = logging.getLogger(__name__)

CHECK_INTERVAL = 0.5  # seconds between two reads of the heartbeats (torch monitors every 0.1 s)


class HangMonitor:
    def __init__(self, config: HangConfig, timeouts: SectionTimeouts, run_dir: Path,
                 record: Callable[..., None] | None = None):
        self.config = config
        self.timeouts = timeouts
        self.run_dir = Path(run_dir)
        self._record = record
        self._next_check = 0.0
        self._dumps: list[threading.Thread] = []
        timeouts.load()
        log.info("section timeouts: %s%s", timeouts.describe(), " (learning)" if timeouts.auto else "")

    def forget_heartbeats(self) -> None:
        """Before workers (re)start: the previous generation's heartbeats mean nothing now."""
        shutil.rmtree(progress_dir(self.run_dir), ignore_errors=True)

    def check(self, alive: set[int], now: float | None = None) -> list[Overrun]:
        """The live ranks that overran their section's timeout (read at most every CHECK_INTERVAL)."""
        mono = time.monotonic()
        if mono < self._next_check:
            return []
        self._next_check = mono + CHECK_INTERVAL
        records = list(read_progress(self.run_dir).values())
        grown = [self.timeouts.observe(r.longest) for r in records if r.pid in alive]
        if any(grown):
            self.timeouts.persist()  # once per check, however many ranks set a new maximum
        return find_overruns(records, alive, self.timeouts.current, time.time() if now is None else now)

    def failure(self, overruns: list[Overrun], worker_group: WorkerGroup) -> RunResult:
        """The failed result torch restarts from; the stacks are taken on a thread.

        py-spy may take seconds per rank, and the monitor loop must not wait on it: the
        dumps start here, one thread per hung rank, and ``wait_for_stacks`` (called
        before the hung ranks are killed) waits for them. Each rank's ``hang`` event is
        recorded when its stacks are in the log, saying how they got there.
        """
        failures = {}
        for overrun in overruns:
            log.error("hang: %s", overrun.describe())
            worker = worker_group.workers[overrun.local_rank]
            failures[worker.global_rank] = ProcessFailure(
                local_rank=overrun.local_rank, pid=overrun.pid, exitcode=1,
                error_file=self._error_file(overrun))
        self._dumps = [threading.Thread(target=self._dump_and_record, args=(o,), name=f"eft-stacks-{o.rank}",
                                        daemon=True) for o in overruns]
        for thread in self._dumps:
            thread.start()
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _dump_and_record(self, overrun: Overrun) -> None:
        how = dump_stacks(overrun, self.config.stack_dumper)
        if how == "faulthandler":
            time.sleep(FAULTHANDLER_GRACE)  # the rank writes its stacks before it is killed
        if self._record is not None:
            self._record(EventKind.HANG, rank=overrun.rank, local_rank=overrun.local_rank, pid=overrun.pid,
                         section=overrun.section, seconds=round(overrun.seconds, 2), timeout=overrun.timeout,
                         iteration=overrun.iteration, stacks=how)

    def wait_for_stacks(self, timeout: float = PY_SPY_TIMEOUT + FAULTHANDLER_GRACE) -> None:
        """Before the hung ranks are killed: let the stack dumps finish (bounded)."""
        deadline = time.monotonic() + timeout
        for thread in self._dumps:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._dumps = []

    def _error_file(self, overrun: Overrun) -> str:
        """An error file that torch's failure report (printed when restarts run out) shows."""
        return write_error_file(self.run_dir / f"hang-{overrun.local_rank}.json",
                                f"HangDetected: {overrun.describe()}; its stacks are in the agent's log")

    def close(self) -> None:
        self.wait_for_stacks()
        self.timeouts.persist()
