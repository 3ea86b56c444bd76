"""The SLURM job eft-run runs in, read from the environment SLURM gives a task.

Pure: a ``SlurmJob`` is made from a mapping (``os.environ``), and the one question that
needs the controller (the job's end time) is answered by ``end_time`` with the command
runner injected, so every rule here is testable without a cluster.
"""

from __future__ import annotations

import logging
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Mapping

log = logging.getLogger(__name__)

# What squeue and scontrol print for a job without a time limit (or not yet known).
_NO_END = {"", "N/A", "NONE", "Unknown", "UNLIMITED", "INVALID"}


@dataclass(frozen=True)
class SlurmJob:
    """One attempt of a SLURM job, as the variables of this process describe it."""

    job_id: str  # SLURM_JOB_ID: the same for every attempt of a requeued job
    restart_count: int  # SLURM_RESTART_COUNT: 0 on the first attempt, +1 per requeue
    array_job_id: str | None = None  # SLURM_ARRAY_JOB_ID: the array's id, shared by its tasks
    array_task_id: str | None = None  # SLURM_ARRAY_TASK_ID
    num_nodes: int | None = None  # SLURM_JOB_NUM_NODES: nodes in the allocation
    step_id: str | None = None  # SLURM_STEP_ID: set in a task srun started, not in the batch script
    step_num_nodes: int | None = None  # SLURM_STEP_NUM_NODES: nodes of this srun step
    step_num_tasks: int | None = None  # SLURM_STEP_NUM_TASKS: tasks of this srun step
    node_id: int | None = None  # SLURM_NODEID: this node's index in the step
    node_name: str | None = None  # SLURMD_NODENAME
    # SLURM_JOB_END_TIME (unix seconds), where SLURM sets it: the time limit without asking the
    # controller (at 2,048 nodes, one squeue per agent at start is a burst on slurmctld).
    end_time: float | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "SlurmJob | None":
        """The job of this process, or None outside SLURM (no ``SLURM_JOB_ID``)."""
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        if not job_id:
            return None
        return cls(
            job_id=job_id,
            restart_count=_int(environ.get("SLURM_RESTART_COUNT")) or 0,
            array_job_id=environ.get("SLURM_ARRAY_JOB_ID") or None,
            array_task_id=environ.get("SLURM_ARRAY_TASK_ID") or None,
            num_nodes=_int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")),
            step_id=environ.get("SLURM_STEP_ID") or None,
            step_num_nodes=_int(environ.get("SLURM_STEP_NUM_NODES")),
            step_num_tasks=_int(environ.get("SLURM_STEP_NUM_TASKS")),
            node_id=_int(environ.get("SLURM_NODEID")),
            node_name=environ.get("SLURMD_NODENAME") or None,
            end_time=float(_int(environ.get("SLURM_JOB_END_TIME")) or 0) or None,
        )

    @property
    def name(self) -> str:
        """The job as SLURM users write it: ``123``, or ``120_3`` for task 3 of array 120."""
        if self.array_job_id and self.array_task_id is not None:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    @property
    def attempt(self) -> str:
        """This attempt of the job: its name and restart count (``123.r0``, ``123.r1``...)."""
        return f"{self.name}.r{self.restart_count}"

    @property
    def run_id(self) -> str:
        """The default ``--rdzv-id``: one per attempt, so a requeued job never meets the
        keys of the attempt before it, and two jobs never share one."""
        return f"slurm-{self.name}-r{self.restart_count}"

    @property
    def in_step(self) -> bool:
        """Whether srun started this process (a job step), not the batch script itself."""
        return self.step_id is not None and self.step_id not in ("batch", "extern")

    def agents(self) -> int | None:
        """How many eft-run agents this step starts: srun's tasks (one per node is the
        norm); the batch script is one agent on one node."""
        if not self.in_step:
            return 1
        return self.step_num_tasks or self.step_num_nodes


def parse_end_time(text: str) -> float | None:
    """squeue's ``%e`` / scontrol's ``EndTime`` (local time, ``2026-11-24T01:23:45``) as
    unix seconds; None for a job with no time limit."""
    text = text.strip()
    if text in _NO_END:
        return None
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def end_time(job: SlurmJob, run: Callable[[list[str]], str] | None = None) -> float | None:
    """When SLURM will stop this job (unix seconds), or None: no limit, or no answer.

    ``SLURM_JOB_END_TIME`` where SLURM sets it; else asks ``squeue`` (it answers from the
    controller); a controller that does not answer costs a warning, not the job.
    """
    if job.end_time is not None:
        return job.end_time
    run = run or _run
    try:
        return parse_end_time(run(["squeue", "-h", "-o", "%e", "-j", job.job_id]).splitlines()[0])
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        log.warning("could not read the end time of SLURM job %s from squeue: %s", job.job_id, exc)
        return None


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text not in (None, "") else None
    except ValueError:
        return None


def slurm_attempt(environ: Mapping[str, str]) -> str:
    """This process's SLURM attempt (``SlurmJob.attempt``), or "" outside SLURM."""
    job = SlurmJob.from_environ(environ)
    return job.attempt if job is not None else ""
