"""eft-run's exit status, as a job script sees it: "done", "try again", or "stop".

The agent decides why the job ends; the launcher turns that into the status. A SLURM
requeue script reads it (README, "No endless loops"):

    eft-run ... ; status=$?
    [ $status -eq 3 ] && exit 3      # NO_PROGRESS: requeueing would loop; stop
    [ $status -ne 0 ] && scontrol requeue $SLURM_JOB_ID

A value never changes once released: scripts compare against the number.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """eft-run's exit statuses (a signal that stops eft-run gives 128 + its number)."""

    OK = 0  # the workers finished
    FAILED = 1  # torchrun's: workers failed after the restarts allowed (or the job-wide budget) ran out
    USAGE = 2  # a mistake in the command line, an EFT_* variable, or the etcd options
    NO_PROGRESS = 3  # restart cycles made no progress (--eft-max-no-progress-restarts): do not requeue
