"""Which run an ``eft`` command means: the one named, else the one running on this host.

``eft top``, ``eft status``, ``eft ckpt`` and ``eft report`` take the run's etcd and id
(``--endpoint``/``--run-id``, or the launch line's ``--rdzv-endpoint``/``--rdzv-id``). On a
node of a running job neither is needed: every eft-run notes its run in the host's runs
directory (``elasticft.contract.local_runs``), and a command given less than both picks the
one run that matches what it was given (inside a SLURM job: that job's run first). Several
candidates are listed in one line, never guessed between.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NoReturn

import typer

from elasticft.contract.keys import RunKeys
from elasticft.contract.local_runs import RUNS_DIR_VARIABLE, LocalRuns
from elasticft.slurm.job import SlurmJob
from elasticft.store import EtcdClient, StoreError, StoreOptions, connect

DEFAULT_PREFIX = "/eft"

ENDPOINT = typer.Option(None, "--endpoint", "--rdzv-endpoint", envvar="EFT_ENDPOINT",
                        help="etcd HOST:PORT of the run (default: the run of an eft-run on this host)")
RUN_ID = typer.Option(None, "--run-id", "--rdzv-id", envvar="EFT_RUN_ID",
                      help="the run's --rdzv-id (default: the run of an eft-run on this host)")
PREFIX = typer.Option(None, "--key-prefix", envvar="EFT_KEY_PREFIX",
                      help="key_prefix given in --rdzv-conf (default: the run's, else /eft)")
RUNS_DIR = typer.Option("", "--runs-dir", envvar=RUNS_DIR_VARIABLE,
                        help="where this host's eft-run launchers note their runs (eft-run's --eft-runs-dir)")
ETCD_TIMEOUT = typer.Option(30.0, "--etcd-timeout", envvar="EFT_ETCD_TIMEOUT",
                            help="seconds one request to the run's etcd may take (a busy etcd answers late)")


@dataclass(frozen=True)
class RunTarget:
    endpoint: str
    keys: RunKeys


def connect_run(fail: Callable[[str], NoReturn], endpoint: str, timeout: float) -> EtcdClient:
    """A client of the run's etcd, or ``fail`` with one line.

    The timeout is per request, and for the connection's first answer, and generous by
    default: the etcd of a loaded job can take seconds to answer, and an operator's
    ``eft ckpt save`` must not report a busy etcd as a dead one. A refused connection
    still fails at once.
    """
    if not timeout > 0:
        fail(f"--etcd-timeout: expected seconds > 0, got {timeout:g}")
    try:
        return connect(StoreOptions(endpoint, timeout=timeout, connect_timeout=timeout))
    except ValueError as exc:
        fail(f"--endpoint: {exc}")
    except StoreError as exc:
        fail(str(exc))


def resolve(fail: Callable[[str], NoReturn], endpoint: str | None, run_id: str | None, key_prefix: str | None,
            runs_dir: str = "") -> RunTarget:
    """The run meant, or ``fail`` with one line that says what to give."""
    if endpoint and run_id:
        return RunTarget(endpoint, RunKeys(run_id, key_prefix or DEFAULT_PREFIX))
    runs = LocalRuns(runs_dir or None)
    found = [r for r in runs.live() if (not run_id or r.run_id == run_id) and (not endpoint or r.endpoint == endpoint)
             and (not key_prefix or r.key_prefix == key_prefix)]
    job = SlurmJob.from_environ(os.environ)
    if job is not None and not run_id and len(found) > 1:
        found = [r for r in found if r.slurm_job == job.job_id] or found  # this SLURM job's own first
    if len(found) == 1:
        run = found[0]
        return RunTarget(run.endpoint, RunKeys(run.run_id, run.key_prefix))
    if found:
        fail(f"{len(found)} eft-run jobs on this host: {'; '.join(r.describe() for r in found)}. "
             f"Pick one with --run-id")
    if endpoint and job is not None:  # the SLURM job's own run id, as eft-run derives it
        return RunTarget(endpoint, RunKeys(job.run_id, key_prefix or DEFAULT_PREFIX))
    given = " and ".join(f"{flag} {value}" for flag, value in (("--endpoint", endpoint), ("--run-id", run_id)) if value)
    fail(f"no eft-run{' with ' + given if given else ''} is running on this host (runs dir {runs.directory}): "
         f"give --endpoint and --run-id (the launch line's --rdzv-endpoint and --rdzv-id)")
