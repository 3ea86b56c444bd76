"""Progress heartbeats: what each rank is doing, for its node agent to read locally.

Every rank keeps one small JSON file, ``<run dir>/progress/<local rank>.json``, replaced
(tmp + rename, no fsync) whenever it enters a section and at every iteration. No etcd,
no socket: the agent reads the files of its own workers, so a job of thousands of ranks
costs etcd nothing per step. The agent uses them for section timeouts (hang detection),
straggler scores and the silent-worker watchdog.

Sections: a rank is always in exactly one of

* ``setup``: from the process's start to the hook's first ``step()``;
* ``step``: from one ``step()`` to the next (time in a nested section excluded);
* ``checkpointing``: a save, opened by ``section("checkpointing")`` or automatically by
  a ``step()`` that decided to save, closed by ``saved()``;
* ``other``: ``section("other")`` (evaluation, say) and everything after ``close()``.

A step's *work time* is the time spent inside ``compute()`` blocks during it. In
synchronous training every rank's wall step time is the same (the slow rank makes the
others wait in the next collective), so straggler scores compare work time when the loop
marks it and fall back to the wall step time when it does not.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque

from elasticft.contract.progress import SECTIONS, STALL_BUCKETS, progress_dir, stall_bucket
from elasticft.contract.run_dir import WorkerEnv, write_atomically
from elasticft.worker import phases

log = logging.getLogger(__name__)

RECENT_STEPS = 32  # step times a record carries: enough for a median, small to rewrite
# A step() rewrites the file only if the last write is this old: a job of 5 ms steps must
# not spend a tenth of its time on heartbeats, and the agent's timeouts (>= 5 s) and
# straggler checks (every few minutes) cannot tell 50 ms of staleness apart.
STEP_WRITE_INTERVAL = 0.05


_became_worker_at: float | None = None  # set when a warm interpreter became this worker


def became_worker_at(when: float) -> None:
    """A warm interpreter (``warm_interpreter.py``) became this worker at ``when``: the worker's
    life starts there. The process itself started before the failure it replaces a worker for,
    and a start before the previous generation's last heartbeat would merge the two in ``eft report``."""
    global _became_worker_at
    _became_worker_at = when


def _became_worker_in_place() -> float | None:
    """The handoff time a warm interpreter left for the command it exec'd in its place (its
    children, which inherit the variable, are not that worker: the pid tells)."""
    pid, _, when = os.environ.get(WorkerEnv.BECAME_WORKER, "").partition(":")
    try:
        return float(when) if int(pid) == os.getpid() else None
    except ValueError:
        return None


def process_started_at() -> float:
    """When this worker started, on the wall clock: a warm interpreter's handoff; else the process's
    age on the boot clock, subtracted from now.

    psutil's ``create_time`` adds the process's start tick to the boot time the kernel noted at
    boot, which drifts from the wall clock as NTP adjusts it (0.8 s on a test VM): a restart
    quicker than that drift would seem to start before its predecessor's last heartbeat, and
    ``eft report`` would merge the two generations."""
    if _became_worker_at is not None:
        return _became_worker_at
    became = _became_worker_in_place()
    if became is not None:
        return became
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):  # not Linux
        import psutil

        return psutil.Process().create_time()


class ProgressWriter:
    """The rank's side: keeps the section state and rewrites the heartbeat file.

    Pure bookkeeping plus one small file write per call; the hook owns the when.
    ``clock`` is injectable so the section arithmetic can be tested without sleeping.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, local_rank: int,
                 dump_signal: int | None = None, clock=time.time, started: float | None = None):
        self.path = progress_dir(run_dir) / f"{local_rank}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.local_rank = local_rank
        self.dump_signal = dump_signal
        self._clock = clock
        self.iteration: int | None = None
        self.section = "setup"
        self.since = clock() if started is None else started  # setup counts from the process's start
        self.started = self.since
        # For `eft report`: what this process's time went to (closed sections, nested time
        # counted once, in the nested section), and where its training began.
        self.totals: dict[str, float] = dict.fromkeys(SECTIONS, 0.0)
        self.first_step: float | None = None
        self.first_iteration: int | None = None
        self.steps = 0
        self.stop_reason: str | None = None  # why the job agreed to save and exit (then the rank ends)
        self.stalls: dict[str, float] = {}  # tier -> seconds a step waited for a background save
        self.stall_buckets: dict[str, list[int]] = {}  # tier -> how many waits fell in each of STALL_BUCKETS
        self.longest: dict[str, float] = {}
        self.step_times: deque[float] = deque(maxlen=RECENT_STEPS)
        self._stack: list[tuple[str, float]] = []  # sections a nested section interrupted
        self._work = 0.0  # time the open step spent in compute()
        self._worked = False
        self._written = float("-inf")
        self.write()

    def _close_current(self, now: float) -> float:
        """Close the open section; its duration (a step's without its nested sections: ``leave``)."""
        took = now - self.since
        self.totals[self.section] += took
        if took > self.longest.get(self.section, 0.0):
            self.longest[self.section] = took
        return took

    def step(self, iteration: int) -> None:
        """An iteration ended: close the open section (a step or setup) and open the next step."""
        now = self._clock()
        while self._stack:  # a nested section left open (an exception skipped its exit)
            self.leave()
        was_step = self.section == "step"
        took = self._close_current(now)
        if was_step:
            self.step_times.append(self._work if self._worked else took)
            self.steps += 1
        first = not was_step and self.first_step is None
        if first:
            self.first_step, self.first_iteration = now, iteration
        self.iteration = iteration
        self.section, self.since = "step", now
        self._work = 0.0
        self._worked = False
        if first or now - self._written >= STEP_WRITE_INTERVAL:  # the first: the end of the start's phases
            self.write()

    def enter(self, section: str) -> None:
        """Open a nested section; ``leave()`` returns to the one it interrupted."""
        if section not in SECTIONS:
            raise ValueError(f"unknown section {section!r}: expected one of {', '.join(SECTIONS)}")
        now = self._clock()
        self._stack.append((self.section, self.since))
        self.section, self.since = section, now
        self.write()

    def leave(self) -> None:
        if not self._stack:
            return
        now = self._clock()
        took = self._close_current(now)
        self.section, self.since = self._stack.pop()
        if self.section == "step":
            # The step's clock stood still while the nested section (a save) ran: its time and its
            # timeout are the step's own, so a long save inside a step is not a hung step.
            self.since += took
        self.write()

    def add_work(self, seconds: float) -> None:
        self._work += seconds
        self._worked = True

    def add_stall(self, tier: str, seconds: float) -> None:
        self.stalls[tier] = self.stalls.get(tier, 0.0) + seconds
        self.stall_buckets.setdefault(tier, [0] * (len(STALL_BUCKETS) + 1))[stall_bucket(seconds)] += 1

    def stopping(self, reason: str) -> None:
        """The job agreed to save and exit for ``reason``: say so before the process ends."""
        self.stop_reason = reason
        self.write()

    def close(self) -> None:
        """Training is over: the rest of the process's life is ``other``."""
        now = self._clock()
        while self._stack:
            self.leave()
        self._close_current(now)
        self.section, self.since = "other", now
        self.write()

    def record(self) -> dict:
        tier, nbytes = phases.load_facts()
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "pid": os.getpid(),
            "iteration": self.iteration,
            "section": self.section,
            "since": self.since,
            "time": self._clock(),
            "longest": self.longest,
            "step_times": list(self.step_times),
            "dump_signal": self.dump_signal,
            "started": self.started,
            "first_step": self.first_step,
            "first_iteration": self.first_iteration,
            "steps": self.steps,
            "totals": self.totals,
            "stalls": self.stalls,
            "stall_buckets": self.stall_buckets,
            "stop_reason": self.stop_reason,
            "phases": phases.stamps(),
            "loaded_from": tier,
            "loaded_bytes": nbytes,
        }

    def write(self) -> None:
        self._written = self._clock()
        try:
            write_atomically(self.path, json.dumps(self.record()))
        except OSError as exc:  # a full /tmp must not stop training; the agent sees silence
            log.debug("could not write heartbeat %s: %s", self.path, exc)
