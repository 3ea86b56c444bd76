"""eft-run under SLURM: derive what the job says, warn where its signals will not reach
eft-run, and hand the time limit to the workers (see elasticft/slurm/)."""

from __future__ import annotations

import logging
import os
import sys
import time

from elasticft.contract.run_dir import WorkerEnv
from elasticft.settings import Settings
from elasticft.slurm.defaults import derive, parent_process, signal_warning
from elasticft.slurm.job import SlurmJob, end_time
from elasticft.slurm.worker_env import stale_variables

log = logging.getLogger("elasticft")


def apply_slurm(args, settings: Settings) -> SlurmJob | None:
    """Under SLURM (and ``--eft-slurm``): set the flags left at torchrun's defaults from the
    job, export the deadline, print what was derived once. The job, or None."""
    job = SlurmJob.from_environ(os.environ)
    if job is None or not settings.ft.slurm:
        return None
    warning = signal_warning(job, *parent_process())
    if warning:
        log.warning(warning)
    derived = derive(args, job)
    margin = settings.ckpt.deadline_margin_mins
    if margin > 0:
        end = end_time(job)
        if end is not None and end - margin * 60 > time.time():
            os.environ[WorkerEnv.DEADLINE] = repr(end - margin * 60)
            derived.end_time = end
        elif end is not None:
            log.warning("SLURM job %s ends in %.0f s, within --eft-deadline-margin-mins %g: no save ahead "
                        "of the time limit", job.name, end - time.time(), margin)
    for name in stale_variables(os.environ):
        del os.environ[name]  # lists of the agents' tasks, not of the workers (slurm/worker_env.py)
    print(f"eft-run: {derived.describe(job, margin)}", file=sys.stderr, flush=True)
    return job
