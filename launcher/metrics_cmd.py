"""``eft metrics``: the Prometheus side of a run (docs/metrics.md).

* ``eft metrics targets``: a ``file_sd`` file of the agents' ``/metrics`` addresses, for one run
  or every run under a key prefix; ``--watch`` keeps the file current as nodes come and go.
* ``eft metrics docs``: the metrics reference (docs/metrics.md), written from the catalog.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import NoReturn, Optional

import typer

from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord
from elasticft.contract.run_dir import write_atomically
from elasticft.metrics.targets import file_sd, node_key_parts, render
from elasticft.rendezvous.membership import running_nodes
from elasticft.store import EtcdClient, StoreError, StoreOptions, connect
from launcher.metrics_docs import render as render_docs
from launcher.run_lookup import ENDPOINT, ETCD_TIMEOUT, PREFIX, RUN_ID, RUNS_DIR, DEFAULT_PREFIX, connect_run, resolve

log = logging.getLogger(__name__)

metrics_app = typer.Typer(help="Prometheus: scrape targets and the metrics reference.", no_args_is_help=True)


def _fail(message: str) -> NoReturn:
    typer.echo(f"eft metrics: error: {message}", err=True)
    raise typer.Exit(2)


def _records(client: EtcdClient, prefix: str, run_id: str | None) -> dict[tuple[str, str], NodeRecord]:
    """The running nodes' records of the run (or, run_id None, of every run under ``prefix`` that has nodes)."""
    if run_id:
        runs = {run_id}
    else:  # keys only: a run's events and memory index are no business of this listing
        runs = {parts[0] for key in client.keys_with_prefix(prefix.rstrip("/") + "/")
                if (parts := node_key_parts(key, prefix))}
    return {(run, node): record for run in sorted(runs)
            for node, record in running_nodes(client, RunKeys(run, prefix), spares=True).items()}


@metrics_app.command("targets")
def targets_command(
    endpoint: Optional[str] = ENDPOINT,
    run_id: Optional[str] = RUN_ID,
    key_prefix: Optional[str] = PREFIX,
    runs_dir: str = RUNS_DIR,
    etcd_timeout: float = ETCD_TIMEOUT,
    all_runs: bool = typer.Option(False, "--all-runs", help="every run under the key prefix (needs --endpoint)"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="file to write (replaced whole; default: "
                                          "standard output)"),
    watch: bool = typer.Option(False, "--watch", help="keep --output current until interrupted"),
    interval: float = typer.Option(5.0, "--interval", help="seconds between two looks with --watch"),
) -> None:
    """Print the Prometheus file_sd targets of a run's agents (their --eft-metrics-port endpoints)."""
    if watch and output is None:
        _fail("--watch: expected --output FILE to keep current (Prometheus' file_sd_configs reads it)")
    if not interval > 0:
        _fail(f"--interval: expected seconds > 0, got {interval:g}")
    if output is not None and not output.resolve().parent.is_dir():
        _fail(f"--output {output}: expected a file in an existing directory")
    if all_runs:
        if not endpoint:
            _fail("--all-runs: expected --endpoint (the etcd whose runs to list)")
        prefix, run = key_prefix or DEFAULT_PREFIX, None
    else:
        target = resolve(_fail, endpoint, run_id, key_prefix, runs_dir)
        endpoint, prefix, run = target.endpoint, target.keys.prefix, target.keys.run_id
    if not watch:
        client = connect_run(_fail, endpoint, etcd_timeout)
        try:
            records = _records(client, prefix, run)
            groups = file_sd(records)
            typer.echo(_write(output, render(groups)), nl=False)
            if records and not groups:  # the run is there, its agents serve nothing: say why it is empty
                typer.echo(f"eft metrics targets: {len(records)} running agent(s), none serves /metrics: start "
                           "eft-run with --eft-metrics-port 0 (a free port) or a port of yours", err=True)
        except StoreError as exc:
            _fail(str(exc))
        finally:
            client.close()
        return
    try:
        _watch(endpoint, etcd_timeout, prefix, run, output, interval)
    except KeyboardInterrupt:
        return


def _write(output: Optional[Path], text: str) -> str:
    """Write the file whole (Prometheus never reads half of it); what to print: the text without a file."""
    if output is None:
        return text
    write_atomically(str(output), text)
    return ""


def _watch(endpoint: str, timeout: float, prefix: str, run: str | None, output: Path, interval: float) -> None:
    """Rewrite ``output`` whenever the targets change, looking every ``interval`` seconds. etcd away
    (not up yet in a batch script, or out for a while) leaves the file as it was, and is tried again."""
    written, client = None, None
    while True:
        try:
            client = client or connect(StoreOptions(endpoint, timeout=timeout, connect_timeout=timeout))
            text = render(file_sd(_records(client, prefix, run)))
            if text != written:
                _write(output, text)
                written = text
        except StoreError as exc:
            log.debug("targets not refreshed: %s", exc)
        except ValueError as exc:
            _fail(f"--endpoint: {exc}")
        time.sleep(interval)


@metrics_app.command("docs")
def docs_command() -> None:
    """Print the metrics reference (Markdown), from the catalog itself: eft metrics docs > docs/metrics.md."""
    typer.echo(render_docs(), nl=False)


def register(app: typer.Typer) -> None:
    app.add_typer(metrics_app, name="metrics")
