"""``eft top`` (live dashboard) and ``eft status`` (one plain-text screen) of a run.

Both only read etcd: ``--once`` and ``eft status`` list the run's keys once; the
live dashboard lists them and then follows one watch on the run root. Exit codes:
0, 1 when the run does not exist (``--once``, ``status``), 2 when etcd cannot be
reached or an option is malformed (one line on stderr).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import NoReturn

import typer
from rich.console import Console
from rich.live import Live

from elasticft.config import RiskConfig
from elasticft.store import StoreError
from launcher.run_lookup import ENDPOINT, ETCD_TIMEOUT, PREFIX, RUN_ID, RUNS_DIR, RunTarget, connect_run, resolve
from elasticft.tui import (
    SORTS,
    Dashboard,
    RunMirror,
    View,
    ViewSettings,
    build_view,
    frame,
    read_state,
    rows_that_fit,
    status_text,
)

THRESHOLD = typer.Option(
    RiskConfig().risk_threshold, "--threshold", envvar="EFT_RISK_THRESHOLD",
    help="risk drawn red at or above this (the agents' --eft-risk-threshold)",
)
STALE_AFTER = typer.Option(
    30.0, "--stale-after", envvar="EFT_TOP_STALE_AFTER",
    help="seconds after which a GPU's last sample is dimmed as stale (3 health intervals by default)",
)
REQUEST_TIMEOUT = typer.Option(
    300.0, "--ckpt-request-timeout", envvar="EFT_CKPT_REQUEST_TIMEOUT",
    help="seconds an unanswered checkpoint request stays open (the agents' setting)",
)


def _fail(command: str, message: str, code: int = 2) -> NoReturn:
    typer.echo(f"eft {command}: {message}", err=True)
    raise typer.Exit(code)


def _settings(command: str, threshold: float, stale_after: float, sort: str, timeout: float, events: int) -> ViewSettings:
    if not 0 < threshold <= 1:
        _fail(command, f"--threshold: expected a number in (0, 1], got {threshold:g}")
    if sort not in SORTS:
        _fail(command, f"--sort: expected one of {', '.join(SORTS)}, got {sort!r}")
    for flag, value in (("--stale-after", stale_after), ("--ckpt-request-timeout", timeout), ("--events", events)):
        if value < 0:
            _fail(command, f"{flag}: expected >= 0, got {value:g}")
    return ViewSettings(threshold, stale_after, sort, timeout, events)


def _connect(command: str, endpoint: str, etcd_timeout: float):
    return connect_run(lambda message: _fail(command, message), endpoint, etcd_timeout)


def _target(command: str, endpoint: str | None, run_id: str | None, key_prefix: str | None,
            runs_dir: str) -> RunTarget:
    return resolve(lambda message: _fail(command, message), endpoint, run_id, key_prefix, runs_dir)


def _read_once(command: str, target: RunTarget, settings: ViewSettings, etcd_timeout: float) -> View:
    endpoint, keys = target.endpoint, target.keys
    client = _connect(command, endpoint, etcd_timeout)
    try:
        state = read_state(client, keys)
    except StoreError as exc:
        _fail(command, str(exc))
    finally:
        client.close()
    view = build_view(state, time.time(), settings)
    if not view.exists:
        _fail(command, f"no run {keys.run_id!r} under {keys.root} at {endpoint}", code=1)
    return view


def top(
    endpoint: str | None = ENDPOINT,
    run_id: str | None = RUN_ID,
    key_prefix: str | None = PREFIX,
    runs_dir: str = RUNS_DIR,
    refresh: float = typer.Option(1.0, "--refresh", envvar="EFT_TOP_REFRESH",
                                  help="least seconds between two redraws (data arrive by watch)"),
    once: bool = typer.Option(False, "--once", help="print one frame and exit (1 if the run does not exist)"),
    as_json: bool = typer.Option(False, "--json", help="print the frame's data as JSON (one object per redraw)"),
    sort: str = typer.Option("risk", "--sort", envvar="EFT_TOP_SORT", help="risk: riskiest GPU first; node: grouped by node"),
    threshold: float = THRESHOLD,
    stale_after: float = STALE_AFTER,
    max_rows: int = typer.Option(0, "--max-rows", envvar="EFT_TOP_MAX_ROWS",
                                 help="most GPU and lost-node rows drawn (0: what the terminal holds; all when not a terminal)"),
    events: int = typer.Option(8, "--events", envvar="EFT_TOP_EVENTS", help="newest events shown"),
    request_timeout: float = REQUEST_TIMEOUT,
    etcd_timeout: float = ETCD_TIMEOUT,
) -> None:
    """Live view of a run: state, per-GPU risk, lost nodes, checkpoints, events."""
    settings = _settings("top", threshold, stale_after, sort, request_timeout, events)
    if refresh <= 0:
        _fail("top", f"--refresh: expected seconds > 0, got {refresh:g}")
    if max_rows < 0:
        _fail("top", f"--max-rows: expected >= 0, got {max_rows}")
    target = _target("top", endpoint, run_id, key_prefix, runs_dir)
    console = Console()

    def limit(view: View) -> int | None:
        if max_rows:
            return max_rows
        return rows_that_fit(console, view) if console.is_terminal else None

    if once:
        view = _read_once("top", target, settings, etcd_timeout)
        if as_json:
            typer.echo(json.dumps(view.to_dict(), indent=2))
        else:
            console.print(frame(view, limit(view), console.width))
        return
    client = _connect("top", target.endpoint, etcd_timeout)
    try:
        mirror = RunMirror(client, target.keys).start()
    except StoreError as exc:
        _fail("top", str(exc))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # leave the screen as it was, as Ctrl-C does
    try:
        if as_json:
            def emit(view: View) -> None:
                sys.stdout.write(json.dumps(view.to_dict()) + "\n")
                sys.stdout.flush()

            Dashboard(mirror, settings, emit, refresh).run(stop)
        else:
            with Live(console=console, auto_refresh=False, screen=console.is_terminal,
                      vertical_overflow="crop") as live:
                def draw(view: View) -> None:
                    live.update(frame(view, limit(view), console.width), refresh=True)

                Dashboard(mirror, settings, draw, refresh).run(stop)
    except KeyboardInterrupt:
        pass
    finally:
        mirror.close()
        client.close()


def status(
    endpoint: str | None = ENDPOINT,
    run_id: str | None = RUN_ID,
    key_prefix: str | None = PREFIX,
    runs_dir: str = RUNS_DIR,
    threshold: float = THRESHOLD,
    stale_after: float = STALE_AFTER,
    rows: int = typer.Option(5, "--rows", envvar="EFT_STATUS_ROWS", help="riskiest GPUs listed"),
    events: int = typer.Option(5, "--events", envvar="EFT_STATUS_EVENTS", help="newest events listed"),
    request_timeout: float = REQUEST_TIMEOUT,
    etcd_timeout: float = ETCD_TIMEOUT,
) -> None:
    """One plain-text screen: state, lost nodes, riskiest GPUs, checkpoints, newest events."""
    settings = _settings("status", threshold, stale_after, "risk", request_timeout, events)
    if rows < 0:
        _fail("status", f"--rows: expected >= 0, got {rows}")
    view = _read_once("status", _target("status", endpoint, run_id, key_prefix, runs_dir), settings, etcd_timeout)
    typer.echo(status_text(view, gpu_rows=rows, events=events))


def register(app: typer.Typer) -> None:
    app.command("top")(top)
    app.command("status")(status)
