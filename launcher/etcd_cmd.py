"""``eft etcd``: the job's own etcd, started inside its SLURM allocation.

    ENDPOINT=$(eft etcd --slurm --members 3 --endpoint-only)
    srun --nodes 3 --ntasks 3 --overlap eft etcd --slurm --members 3 &
    srun --ntasks-per-node 1 eft-run --rdzv-backend etcd-v3 --rdzv-endpoint $ENDPOINT ...

Each srun task runs member ``SLURM_PROCID`` on its node; every agent computes the same
endpoint from the allocation (elasticft/slurm/etcd_members.py), and eft-run waits for
etcd at start, so the two steps need no ordering.

Signals: the training may still need etcd to record its final save when SLURM signals
the job, so a member ignores the preemption warnings (SIGUSR1, SIGUSR2) and, on SIGTERM
(scancel, the time limit, a requeue: every process of the job gets it at once), keeps
serving for ``--term-grace`` seconds before it stops; SLURM's KillWait ends it anyway.
SIGINT stops it at once: what the batch script sends once its agents are done.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import NoReturn

import typer

from elasticft.slurm.etcd_members import Member, endpoint, initial_cluster, job_port, members
from elasticft.store import EtcdNotFound, find_etcd
from elasticft.store.server import stop_process


def _fail(message: str) -> NoReturn:
    typer.echo(f"eft etcd: {message}", err=True)
    raise typer.Exit(2)


def _chosen(slurm: bool, count: int, port: int, address: str) -> tuple[list[Member], int]:
    """The cluster's members and this task's index in it."""
    if not slurm:
        return [Member(0, "local", address, port, port + 1)], 0
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        _fail("--slurm: SLURM_JOB_NODELIST is not set (run it inside a SLURM job)")
    try:
        chosen = members(nodelist, count, port)
    except (OSError, subprocess.SubprocessError) as exc:
        _fail(f"--slurm: could not read the allocation's nodes from scontrol: {exc}")
    except ValueError as exc:
        _fail(str(exc))
    return chosen, int(os.environ.get("SLURM_PROCID", "0"))


def _serve(binary: str, me: Member, chosen: list[Member], data_dir: str, term_grace: float) -> int:
    stop_at = [float("inf")]  # monotonic time to stop etcd
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, lambda _s, _f: stop_at.__setitem__(0, 0.0))
    signal.signal(signal.SIGTERM, lambda _s, _f: stop_at.__setitem__(0, min(stop_at[0], time.monotonic() + term_grace)))
    listen_client, listen_peer = f"http://{me.address}:{me.client_port}", f"http://{me.address}:{me.peer_port}"
    proc = subprocess.Popen(
        [binary, "--name", me.etcd_name, "--data-dir", data_dir,
         "--listen-client-urls", listen_client, "--advertise-client-urls", me.client_url,
         "--listen-peer-urls", listen_peer, "--initial-advertise-peer-urls", me.peer_url,
         "--initial-cluster", initial_cluster(chosen), "--initial-cluster-state", "new",
         "--initial-cluster-token", f"eft-{os.environ.get('SLURM_JOB_ID', 'local')}", "--log-level", "warn"],
        stdin=subprocess.DEVNULL, start_new_session=True)  # the job's process-group signals are ours to judge
    typer.echo(f"eft etcd: member {me.etcd_name} of {len(chosen)} on {me.name} ({me.client_url}); "
               f"endpoint {endpoint(chosen)}", err=True)
    while proc.poll() is None and time.monotonic() < stop_at[0]:
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        stop_process(proc, timeout=20)
        return 0
    typer.echo(f"eft etcd: etcd exited with status {proc.returncode}", err=True)
    return proc.returncode or 1


def etcd_command(
    slurm: bool = typer.Option(False, "--slurm", help="members on the first nodes of this SLURM allocation; "
                               "this task runs member SLURM_PROCID"),
    count: int = typer.Option(1, "--members", help="members of the etcd cluster (1 or 3; 3 survives a lost node)"),
    port: int = typer.Option(0, "--port", help="client port of member 0; member i uses port+2i, peers port+2i+1 "
                             "(default: 2379; under --slurm one from the job id, so jobs sharing a node differ)"),
    address: str = typer.Option("127.0.0.1", "--address", help="without --slurm: the address to serve on"),
    data_dir: str = typer.Option("", "--data-dir", help="etcd's data directory (default: a temporary one, "
                                 "removed at exit)"),
    endpoint_only: bool = typer.Option(False, "--endpoint-only", help="print the endpoint for --rdzv-endpoint "
                                       "and exit"),
    term_grace: float = typer.Option(60.0, "--term-grace", help="seconds to keep serving after SIGTERM, for the "
                                     "agents' final save (SIGINT stops at once)"),
) -> None:
    """Run one member of the job's etcd (or print its endpoint)."""
    if count not in (1, 3, 5):
        _fail(f"--members: expected 1, 3 or 5, got {count}")
    port = port or (job_port(os.environ.get("SLURM_JOB_ID", "")) if slurm else 2379)
    chosen, index = _chosen(slurm, count, port, address)
    if endpoint_only:
        typer.echo(endpoint(chosen))
        return
    if index >= len(chosen):
        _fail(f"task {index} has no member to run: start it with srun --ntasks {len(chosen)}")
    try:
        binary = find_etcd()
    except EtcdNotFound as exc:
        _fail(str(exc))
    made = not data_dir
    data_dir = data_dir or tempfile.mkdtemp(prefix="eft-etcd-member-")
    try:
        status = _serve(binary, chosen[index], chosen, data_dir, term_grace)
    finally:
        if made:
            shutil.rmtree(data_dir, ignore_errors=True)
    sys.exit(status)


def register(app: typer.Typer) -> None:
    app.command("etcd")(etcd_command)
