"""The job's outcome (``outcome``): how the training ended, for the batch script that ran it.

Under SLURM a job's exit status is what its batch script exits with, and a requeue script
branches on it. ``srun`` exits with its tasks' highest status: after a lost node (its task
killed: 137) the job would read "failed" though the survivors trained to the end, and a
requeue script would requeue a finished job, or give up on a good one. So the agent that
decides how the training ended writes it once in etcd, and ``eft outcome`` (the batch
script, after srun returns, while its etcd is still up) exits with it.

The rule, exactly:

* who writes (``decide_outcome``): the restart rule's verdict, by any agent it ended
  (3 no progress, 1 the job-wide budget); else the agent of group rank 0, from its own
  workers: all exited 0 (the exit barrier passed): 0, or 4 when they saved and stopped for
  a preemption or a time limit (``ExitCode.after_stop``); not finished, but saved and
  stopped for such a reason (a SIGTERM during the save): 4. Nothing else writes, so 0 is
  only ever written by the node that ran rank 0 to the end;
* one record per attempt (``JobOutcome.attempt``, the SLURM ``<job>.r<restart>``): the
  first end decided in an attempt stands; a record of another attempt (a run id reused
  across requeues) is replaced;
* who reads (``job_status``): the record of this SLURM attempt gives the status; without
  one (etcd gone, every agent killed, a mistake before any agent joined) srun's status.
  A job whose training did not finish is therefore never reported 0: only rank 0's
  finished workers write 0, and srun's 0 means every task exited 0.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from elasticft.contract.exit_codes import REQUEUE_REASONS, ExitCode
from elasticft.contract.json_object import json_object
from elasticft.contract.restarts import Ending

# What the restart rule's verdict makes of the job (docs/restarts.md, "No progress").
ENDING_STATUS = {Ending.NO_PROGRESS: ExitCode.NO_PROGRESS, Ending.BUDGET: ExitCode.FAILED}

_MEANING = {
    ExitCode.OK: "the training finished",
    ExitCode.FAILED: "the workers failed after the restarts allowed",
    ExitCode.USAGE: "bad input",
    ExitCode.NO_PROGRESS: "no progress across restart cycles (a person must look)",
    ExitCode.REQUEUE: "the workers saved and stopped before preemption or the time limit (requeue)",
}


@dataclass(frozen=True)
class JobOutcome:
    """The value of ``outcome``: the job's exit status and who decided it, when."""

    status: ExitCode
    attempt: str  # the launch it ends (NodeRecord.attempt): SLURM "<job>.r<restart>"
    node: str = ""  # the agent's node id that wrote it
    time: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps({"status": int(self.status), "attempt": self.attempt, "node": self.node,
                           "time": self.time})

    @classmethod
    def from_json(cls, raw: bytes | str) -> "JobOutcome":
        """Raises ValueError, TypeError or KeyError on a malformed record."""
        data = json_object(raw)
        return cls(ExitCode(int(data["status"])), str(data["attempt"]), str(data.get("node", "")),
                   float(data.get("time", 0.0)))

    def describe(self) -> str:
        at = time.strftime("%H:%M:%S", time.localtime(self.time))
        return f"{_MEANING.get(self.status, 'status')} (recorded by node {self.node or '?'} at {at})"


def decide_outcome(*, group_rank0: bool, finished: bool, stop_reason: str | None,
                   ending: Ending | None) -> ExitCode | None:
    """What an ending agent writes, or None: this agent does not decide the job's outcome.

    ``group_rank0``: the agent ran group rank 0 in the last round; ``finished``: its workers
    all exited 0 and the agent ended cleanly (not excluded, not signalled); ``stop_reason``:
    why they saved and stopped (the hook's save-and-exit reason), None if they did not;
    ``ending``: the restart rule's verdict in ``restarts``, None without one.
    """
    if ending is not None:
        return ENDING_STATUS[ending]
    if not group_rank0:
        return None
    if finished:
        return ExitCode.after_stop(stop_reason)
    return ExitCode.REQUEUE if stop_reason in REQUEUE_REASONS else None


def job_status(record: JobOutcome | None, attempt: str, srun_status: int) -> tuple[int, str]:
    """The batch job's exit status and one line saying where it comes from.

    ``record``: the run's ``outcome`` (None: none, or unreadable); ``attempt``: this SLURM
    attempt ("" outside SLURM: no record is trusted, it may be an earlier launch's).
    """
    if record is None or not attempt:
        why = "no outcome recorded in etcd" if attempt else "not in a SLURM job"
        return srun_status, f"{why}: exit status {srun_status}, srun's"
    if record.attempt != attempt:
        return srun_status, (f"the recorded outcome is attempt {record.attempt}'s, not {attempt}'s: "
                             f"exit status {srun_status}, srun's")
    line = f"{record.describe()}: exit status {int(record.status)}"
    if int(record.status) != srun_status:
        line += f" (srun's was {srun_status})"
    return int(record.status), line
