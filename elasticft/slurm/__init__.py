"""SLURM as eft-run's host: what the allocation says (job.py), the defaults eft-run
derives from it (defaults.py), and the SLURM variables a worker sees (worker_env.py)."""
