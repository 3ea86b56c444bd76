"""The runs this host's eft-run launchers are in: how ``eft top``, ``eft status`` and
``eft ckpt`` find a running job without being told its etcd and run id.

A job's etcd endpoint is on its launch line, or nowhere a person can see: ``--standalone``
starts an embedded etcd on a random port, printed once in the log. So each eft-run writes
one file, ``<runs dir>/<pid>.json``, once it knows its etcd, and removes it when it ends.
A launcher killed with SIGKILL leaves its file behind; readers know it by the process it
names being gone (its pid and the kernel's start time of that pid, so a reused pid does not
count) and remove it. The directory is per user (mode 0700): another user's jobs are not
this user's to save or stop.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from elasticft.contract.run_dir import write_atomically

RUNS_DIR_VARIABLE = "EFT_RUNS_DIR"  # eft-run's --eft-runs-dir and the commands' --runs-dir


def default_runs_dir() -> Path:
    """/tmp, not $TMPDIR: SLURM and job containers often give each job a TMPDIR of its own, and a
    person who logs in to the node to look at the job has another."""
    return Path("/tmp") / f"eft-runs-{os.getuid()}"


def process_start(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name before ')' may hold spaces


@dataclass(frozen=True)
class LocalRun:
    """One launcher's run: what a command needs to reach it."""

    run_id: str
    endpoint: str
    key_prefix: str
    pid: int
    started: int  # process_start(pid) when it registered
    slurm_job: str = ""  # SLURM_JOB_ID of the job it runs in, if any

    def alive(self) -> bool:
        return process_start(self.pid) == self.started


class LocalRuns:
    """The runs directory of this user on this host."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory) if directory else default_runs_dir()

    def register(self, run_id: str, endpoint: str, key_prefix: str, slurm_job: str = "") -> Path:
        """Note this process's run; the path to remove when it ends."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        pid = os.getpid()
        run = LocalRun(run_id, endpoint, key_prefix, pid, process_start(pid) or 0, slurm_job)
        path = self.directory / f"{pid}.json"
        write_atomically(path, json.dumps(asdict(run)))
        return path

    def live(self) -> list[LocalRun]:
        """The runs whose launcher still runs, oldest first; files of dead launchers are removed."""
        runs = []
        for path in sorted(self.directory.glob("*.json")) if self.directory.is_dir() else []:
            try:
                run = LocalRun(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # being written (it appears whole) or not ours: not a run to offer
            if run.alive():
                runs.append(run)
            else:
                path.unlink(missing_ok=True)
        return sorted(runs, key=lambda run: run.started)
