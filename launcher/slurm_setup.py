"""eft-run under SLURM: derive what the job says, warn where its signals will not reach
eft-run, and hand the time limit to the workers (see elasticft/slurm/; the time limit is
asked of squeue by one agent of the job and shared through etcd: slurm_end_time.py)."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable

from elasticft.agent.context import EtcdTarget
from elasticft.config import Settings
from elasticft.contract.run_dir import WorkerEnv
from elasticft.slurm.defaults import derive, parent_process, signal_warning
from elasticft.slurm.job import SlurmJob, end_time
from elasticft.slurm.worker_env import stale_variables
from launcher.slurm_end_time import shared_end_time

log = logging.getLogger("elasticft")


def apply_slurm(args, settings: Settings, etcd: Callable[[], EtcdTarget | None] = lambda: None) -> SlurmJob | None:
    """Under SLURM (and ``--eft-slurm``): set the flags left at torchrun's defaults from the
    job, export the deadline, print what was derived once. The job, or None.

    ``etcd``: the run's etcd, once the flags are derived (None: none to share the time limit
    through, e.g. an embedded one: this agent asks squeue itself)."""
    job = SlurmJob.from_environ(os.environ)
    if job is None or not settings.ft.slurm:
        return None
    warning = signal_warning(job, *parent_process())
    if warning:
        log.warning(warning)
    derived = derive(args, job)
    margin = settings.ckpt.deadline_margin_mins
    if margin > 0:
        end = _end_time(job, etcd(), settings)
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


def _end_time(job: SlurmJob, target: EtcdTarget | None, settings: Settings) -> float | None:
    if target is None:
        return end_time(job)
    return shared_end_time(job, target.store, target.keys, settings.slurm.slurm_end_time_wait)
