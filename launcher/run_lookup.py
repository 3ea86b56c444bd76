"""Which run an ``eft`` command means: the one named, else the one running on this host.

``eft top``, ``eft status``, ``eft ckpt`` and ``eft report`` take the run's etcd and id
(``--endpoint``/``--run-id``, or the launch line's ``--rdzv-endpoint``/``--rdzv-id``). On a
node of a running job neither is needed: every eft-run notes its run in the host's runs
directory (``elasticft.contract.local_runs``), and a command given less than both picks the
one run that matches what it was given (inside a SLURM job: that job's run first). A run is
its etcd endpoint, key prefix and run id: several agents of one run on this host (two eft-run
per node, the README's demo) are one run, whichever of them noted it. Several runs are listed
in one line, each once with its agents, never guessed between.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NoReturn

import typer

from elasticft.contract.keys import RunKeys
from elasticft.contract.local_runs import RUNS_DIR_VARIABLE, LocalRun, LocalRuns
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
    found = [r for r in runs.live() if (not run_id or r.run_id == run_id) and (not key_prefix or r.key_prefix == key_prefix)
             and (not endpoint or _endpoints(r.endpoint) == _endpoints(endpoint))]
    job = SlurmJob.from_environ(os.environ)
    if job is not None and not run_id and len(_by_run(found)) > 1:
        found = [r for r in found if r.slurm_job == job.job_id] or found  # this SLURM job's own first
    grouped = _by_run(found)
    if len(grouped) == 1:
        (run, *_), = grouped.values()
        return RunTarget(run.endpoint, RunKeys(run.run_id, run.key_prefix))
    if grouped:
        listed = "; ".join(_describe(agents) for agents in grouped.values())
        apart = ("--run-id" if len({k[2] for k in grouped}) == len(grouped) else
                 "--run-id and --endpoint" if len({k[0] for k in grouped}) > 1 else "--run-id and --key-prefix")
        fail(f"{len(grouped)} eft-run jobs on this host: {listed}. Pick one with {apart}")
    if endpoint and job is not None:  # the SLURM job's own run id, as eft-run derives it
        return RunTarget(endpoint, RunKeys(job.run_id, key_prefix or DEFAULT_PREFIX))
    given = " and ".join(f"{flag} {value}" for flag, value in (("--endpoint", endpoint), ("--run-id", run_id)) if value)
    fail(f"no eft-run{' with ' + given if given else ''} is running on this host (runs dir {runs.directory}): "
         f"give --endpoint and --run-id (the launch line's --rdzv-endpoint and --rdzv-id)")


def _by_run(found: list[LocalRun]) -> dict[tuple[str, str, str], list[LocalRun]]:
    """The agents noted on this host, by run: (endpoint, key prefix, run id), in the order found."""
    runs: dict[tuple[str, str, str], list[LocalRun]] = {}
    for agent in found:
        runs.setdefault((_endpoints(agent.endpoint), agent.key_prefix, agent.run_id), []).append(agent)
    return runs


def _endpoints(endpoint: str) -> str:
    """One spelling of an etcd endpoint list: agents given the same endpoints in another order, or with
    a scheme, reach the same etcd."""
    hosts = (e.strip().removeprefix("http://").removeprefix("https://").rstrip("/") for e in endpoint.split(","))
    return ",".join(sorted(h for h in hosts if h))


def _describe(agents: list[LocalRun]) -> str:
    """One run in one phrase: its id, etcd, prefix, SLURM job, and its agents' pids."""
    first = agents[0]
    job = f", SLURM job {first.slurm_job}" if first.slurm_job else ""
    prefix = f", key prefix {first.key_prefix}" if first.key_prefix != DEFAULT_PREFIX else ""
    pids = ", ".join(str(a.pid) for a in agents)
    return (f"{first.run_id} (etcd {first.endpoint}{prefix}{job}, {len(agents)} agent{'s' if len(agents) > 1 else ''}"
            f": eft-run pid{'s' if len(agents) > 1 else ''} {pids})")
