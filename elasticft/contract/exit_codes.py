"""eft-run's exit status, as a job script sees it: "done", "requeue me", or "stop".

The agent decides why the job ends; the launcher turns that into the status. A SLURM
requeue script branches on it (examples/slurm/train.sbatch, docs/slurm.md):

    eft-run ... ; status=$?
    case $status in
      0) ;;                                   # finished (or stopped on request)
      4|1) scontrol requeue $SLURM_JOB_ID ;;  # saved before preemption / failed: go on
      *) ;;                                   # 2 bad input, 3 gave up: a person must look
    esac

A value never changes once released: scripts compare against the number.
"""

from __future__ import annotations

import enum

# Save-and-exit reasons (elasticft.worker.vote.SAVE_REASONS) that stop a job which wants to
# go on: a preemption signal, --eft-exit-duration-mins, SLURM's time limit, a watchdog's
# "host memory is running out". A kill switch or `eft ckpt stop` is a person's: status 0.
REQUEUE_REASONS = frozenset({"signal", "exit_duration", "deadline", "watchdog"})

class ExitCode(enum.IntEnum):
    """eft-run's exit statuses (a signal that stops eft-run before any save gives 128 + its number)."""

    OK = 0  # the workers finished (or stopped because a person asked: kill switch, `eft ckpt stop`)
    FAILED = 1  # torchrun's: workers failed after the restarts allowed (or the job-wide budget) ran out
    USAGE = 2  # a mistake in the command line, an EFT_* variable, the etcd options, or a run id in use
    NO_PROGRESS = 3  # gave up: restart cycles made no progress (--eft-max-no-progress-restarts): do not requeue
    REQUEUE = 4  # saved and stopped for a preemption, a time limit or a memory watchdog: requeue

    @classmethod
    def after_stop(cls, reason: str | None) -> "ExitCode":
        """The status of workers that all exited 0 after the job agreed to save and exit for
        ``reason`` (a save-and-exit reason of the worker hook's vote; None: they just finished)."""
        return cls.REQUEUE if reason in REQUEUE_REASONS else cls.OK

    @classmethod
    def describe(cls) -> str:
        """One line per status, for ``eft-run --help``."""
        return ("exit status: 0 finished; 1 failed after the restarts allowed (requeue may help); "
                "2 bad input or run id in use; 3 no progress (do not requeue); "
                "4 saved and stopped for a preemption or time limit (requeue)")
