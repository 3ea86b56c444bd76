"""``eft ckpt save|stop|status``: ask a running job to save, to save and stop, or report.

They talk to the run's etcd like any agent does (``elasticft.agent.ckpt_protocol``); no etcd
or a malformed option gives one line and exit 2.
"""

from __future__ import annotations

import json
import sys
import time
from typing import NoReturn

import typer

from elasticft.agent.ckpt_protocol import CheckpointProtocol
from elasticft.contract.keys import RunKeys
from elasticft.memckpt.index import MemIndex, memory_summary
from elasticft.rendezvous.membership import running_nodes
from elasticft.store import StoreError
from elasticft.tui.text import lag_text, memory_text
from launcher.run_lookup import ENDPOINT, ETCD_TIMEOUT, PREFIX, RUN_ID, RUNS_DIR, RunTarget, connect_run, resolve

ckpt_app = typer.Typer(help="Emergency checkpoints of a running job.", no_args_is_help=True)



def _fail(message: str) -> NoReturn:
    typer.echo(f"eft ckpt: {message}", err=True)
    raise typer.Exit(2)


def _target(endpoint: str | None, run_id: str | None, prefix: str | None, runs_dir: str) -> RunTarget:
    return resolve(_fail, endpoint, run_id, prefix, runs_dir)


def _request(target: RunTarget, exit: bool, etcd_timeout: float) -> None:
    protocol = CheckpointProtocol(connect_run(_fail, target.endpoint, etcd_timeout), target.keys, source="eft-ckpt")
    try:
        request, created = protocol.request("manual", requester=f"eft ckpt ({_user()})", exit=exit)
    except StoreError as exc:
        _fail(str(exc))
    verb = "requested" if created else "joined the open request"
    typer.echo(f"{verb} {request.id}: every rank saves{' and exits' if request.exit else ''} at its next iteration")


def _user() -> str:
    import getpass

    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name in some containers
        return "unknown"


@ckpt_app.command()
def save(endpoint: str | None = ENDPOINT, run_id: str | None = RUN_ID, key_prefix: str | None = PREFIX,
         runs_dir: str = RUNS_DIR, etcd_timeout: float = ETCD_TIMEOUT) -> None:
    """Every rank saves the same iteration, then training goes on."""
    _request(_target(endpoint, run_id, key_prefix, runs_dir), exit=False, etcd_timeout=etcd_timeout)


@ckpt_app.command()
def stop(endpoint: str | None = ENDPOINT, run_id: str | None = RUN_ID, key_prefix: str | None = PREFIX,
         runs_dir: str = RUNS_DIR, etcd_timeout: float = ETCD_TIMEOUT) -> None:
    """Every rank saves, then the job exits cleanly (the agents do not restart it)."""
    _request(_target(endpoint, run_id, key_prefix, runs_dir), exit=True, etcd_timeout=etcd_timeout)


@ckpt_app.command()
def status(
    endpoint: str | None = ENDPOINT,
    run_id: str | None = RUN_ID,
    key_prefix: str | None = PREFIX,
    runs_dir: str = RUNS_DIR,
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    etcd_timeout: float = ETCD_TIMEOUT,
) -> None:
    """The last request, the acknowledgements, the latest complete checkpoint and the newest in memory."""
    target = _target(endpoint, run_id, key_prefix, runs_dir)
    try:
        client, keys = connect_run(_fail, target.endpoint, etcd_timeout), target.keys
        report = CheckpointProtocol(client, keys, source="eft-ckpt").status()
        report["memory"] = _memory(client, keys)
    except StoreError as exc:
        _fail(str(exc))
    if as_json:
        json.dump(report, sys.stdout)
        sys.stdout.write("\n")
        return
    request = report["request"]
    typer.echo("request: " + (f"{request['id']} {request['reason']} from {request['requester']}"
                              f"{' (exit)' if request['exit'] else ''}" if request else "none"))
    for ack in report["acks"]:
        typer.echo(f"ack:     {ack['request_id']} iteration {ack['iteration']} in {ack['seconds']:.2f} s at {ack['path']}")
    latest = report["latest"]
    typer.echo("latest:  " + (f"iteration {latest['iteration']} at {latest['path']}" if latest else "none"))
    if report["memory"] is not None:
        typer.echo("memory:  " + memory_text(report["memory"]))
        typer.echo("mem lag: " + lag_text(report["memory"]))


def _memory(client, keys: RunKeys) -> dict | None:
    """The memory tier's newest iteration that the live nodes (spares too) can restore (None: tier off)."""
    summary = memory_summary(MemIndex(client, keys).parts(), set(running_nodes(client, keys, spares=True)))
    if summary is not None:
        summary["age_s"] = time.time() - summary.pop("time") if summary.get("time") else None
    return summary


def register(app: typer.Typer) -> None:
    app.add_typer(ckpt_app, name="ckpt")
