"""The SLURM variables a worker sees: its own rank, not its agent's.

srun starts one eft-run per node; each one's ``SLURM_PROCID`` is the *agent's* task
index and ``SLURM_NTASKS`` the number of agents. A worker that inherits them is told
it is rank 0 of 1 (or of the node count), and libraries that trust SLURM over torch's
variables (Megatron's and Lightning's SLURM helpers, submitit) then pick the wrong
rank, the wrong world size or the wrong GPU. Each worker gets them rewritten from
torch's own (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``...), so SLURM and torch agree.
"""

from __future__ import annotations

from typing import Mapping

# SLURM variable -> the torch worker variable it must equal in a worker.
FROM_TORCH = {
    "SLURM_PROCID": "RANK",
    "SLURM_LOCALID": "LOCAL_RANK",
    "SLURM_NODEID": "GROUP_RANK",
    "SLURM_NTASKS": "WORLD_SIZE",
    "SLURM_NPROCS": "WORLD_SIZE",
    "SLURM_STEP_NUM_TASKS": "WORLD_SIZE",
    "SLURM_NNODES": "GROUP_WORLD_SIZE",
    "SLURM_STEP_NUM_NODES": "GROUP_WORLD_SIZE",
    "SLURM_NTASKS_PER_NODE": "LOCAL_WORLD_SIZE",
}
# Lists of the agents' tasks that describe no worker: the agent drops them from the
# environment its workers inherit (torch merges a worker's variables over it; it cannot unset).
STALE = ("SLURM_GTIDS", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASK_PID")


def under_slurm(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"))


def slurm_worker_env(worker_env: Mapping[str, str | None], environ: Mapping[str, str]) -> dict[str, str]:
    """The SLURM variables of one worker (none outside SLURM).

    ``worker_env``: the variables torch gives this worker (RANK, LOCAL_RANK, ...);
    ``environ``: the agent's.
    """
    if not under_slurm(environ):
        return {}
    return {slurm_name: str(worker_env[torch_name]) for slurm_name, torch_name in FROM_TORCH.items()
            if worker_env.get(torch_name) is not None}


def stale_variables(environ: Mapping[str, str]) -> list[str]:
    """The agent's SLURM variables that must not reach a worker at all."""
    return [name for name in STALE if name in environ] if under_slurm(environ) else []
