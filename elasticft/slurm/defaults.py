"""eft-run's defaults under SLURM: what a user would otherwise write by hand in every
batch script, derived from the job, and printed once so nothing is a surprise.

Only what the user left at torchrun's default (no flag, no ``PET_*`` variable) is
derived; a flag always wins.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Mapping

from elasticft.contract.argv import user_set
from elasticft.slurm.job import SlurmJob

SHELLS = {"bash", "sh", "dash", "zsh", "ksh", "tcsh", "csh", "fish"}


@dataclass
class Derived:
    """What eft-run took from SLURM: flag -> value, and the job's end (None: no limit)."""

    flags: dict[str, str] = field(default_factory=dict)
    end_time: float | None = None

    def describe(self, job: SlurmJob, margin_mins: float) -> str:
        parts = [f"--{name.replace('_', '-')} {value}" for name, value in self.flags.items()]
        if self.end_time is not None and margin_mins > 0:
            at = time.strftime("%H:%M:%S", time.localtime(self.end_time))
            parts.append(f"time limit at {at}: save and exit {margin_mins:g} min before")
        what = ", ".join(parts) or "nothing to derive (flags given)"
        return f"SLURM job {job.name} attempt {job.restart_count}: {what}"


def derive(args, job: SlurmJob, environ: Mapping[str, str] = os.environ) -> Derived:
    """Set the flags the user left at torchrun's defaults from ``job``; what was set."""
    derived = Derived()
    if not user_set(args, "rdzv_id", environ):
        args.rdzv_id = derived.flags["rdzv_id"] = job.run_id
    agents = job.agents()
    if agents and agents > 1:
        if not user_set(args, "nnodes", environ):
            args.nnodes = derived.flags["nnodes"] = str(agents)
        if job.node_id is not None and args.rdzv_backend == "static" and not user_set(args, "node_rank", environ):
            args.node_rank = job.node_id  # only torchrun's static rendezvous reads it
            derived.flags["node_rank"] = str(job.node_id)
    return derived


def signal_warning(job: SlurmJob, parent_comm: str, parent_args: str) -> str | None:
    """A warning when SLURM's signals will not reach eft-run: it runs as a child of the
    batch shell (no ``exec``), and ``--signal=B:...`` or ``scancel -b`` signals the shell."""
    # SLURM runs the batch script by its path: the kernel names the process after the script
    # ("slurm_script"), its command line is "/bin/bash .../slurm_script".
    interpreter = os.path.basename(parent_args.split(" ", 1)[0])
    if job.in_step or not {parent_comm, interpreter} & SHELLS or "slurm_script" not in parent_args:
        return None
    return ("eft-run runs under the batch shell (no `exec`): SLURM's batch signals "
            "(#SBATCH --signal=B:USR1@..., scancel -b) reach the shell, not eft-run, and the "
            "save before preemption never happens; start it with `exec eft-run ...` "
            "(or `srun eft-run ...`)")


def parent_process() -> tuple[str, str]:
    """The parent's command name and command line (empty where /proc cannot tell)."""
    ppid = os.getppid()
    try:
        comm = open(f"/proc/{ppid}/comm").read().strip()
        cmdline = open(f"/proc/{ppid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "", ""
    return comm, cmdline
