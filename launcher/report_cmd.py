"""``eft report``: where a run's paid GPU time went, its goodput, and a better save interval.

Reads the run's event log from etcd (``--endpoint``, ``--run-id``) or from the JSON-lines
copy a finished run left (``--events``, written by ``eft-run --eft-events-file``), and
prints the breakdown (``elasticft/goodput/breakdown.py``), the failures, the costs
``eft simulate --costs`` takes, and Young–Daly's save interval next to the one in use.
Bad input: one line, exit status 2.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import NoReturn, Optional

import typer

from elasticft.agent.events import EventLog
from elasticft.contract.keys import RunKeys
from elasticft.contract.phases import ORDER
from elasticft.goodput import phases
from elasticft.goodput.breakdown import CATEGORIES, CATEGORY_HELP, Breakdown, ReportError, breakdown
from elasticft.goodput.costs import young_daly_interval
from elasticft.goodput.svg import SvgError
from elasticft.goodput.timeline import picture
from elasticft.store import StoreError
from launcher.one_line import OneLineErrors, fail
from launcher.run_lookup import ENDPOINT, ETCD_TIMEOUT, PREFIX, RUN_ID, RUNS_DIR, connect_run, resolve


def _fail(message: str) -> NoReturn:
    fail("report", message)


def read_events_file(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError as exc:
        _fail(f"--events {path}: cannot read it ({exc.strerror or exc})")
    events = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            _fail(f"--events {path}: line {number} is not JSON (expected one event per line)")
        if not isinstance(event, dict) or "kind" not in event or not isinstance(event.get("time"), (int, float)):
            _fail(f"--events {path}: line {number} is not an event (expected kind and time)")
        events.append(event)
    if not events:
        _fail(f"--events {path}: no events in it")
    return events


def read_events_etcd(endpoint: str, run_id: str, prefix: str, etcd_timeout: float) -> list[dict]:
    client = connect_run(_fail, endpoint, etcd_timeout)
    try:
        events = EventLog(client, RunKeys(run_id, prefix), "eft-report").read()
    except StoreError as exc:
        _fail(str(exc))
    finally:
        client.close()
    if not events:
        _fail(f"--run-id {run_id}: no events under {prefix}/{run_id} at {endpoint} (unknown run?)")
    return events


def young_daly(report: Breakdown, mtbf_hours: float | None) -> dict:
    """The interval in use and the one Young–Daly recommends, with what it rests on."""
    costs = report.costs
    mtbf = mtbf_hours * 3600.0 if mtbf_hours else (report.wall / len(report.failures) if report.failures else None)
    result = {"interval_seconds": costs.save_interval_seconds, "save_seconds": costs.save_seconds,
              "mtbf_seconds": mtbf, "mtbf_from": "--mtbf-hours" if mtbf_hours else "observed",
              "recommended_seconds": None, "why_none": None}
    if mtbf is None:
        result["why_none"] = "no failure in this run: pass --mtbf-hours for the job's expected MTBF"
    elif costs.save_seconds <= 0:
        result["why_none"] = "no persistent save stalled training in this run"
    else:
        result["recommended_seconds"] = young_daly_interval(mtbf, costs.save_seconds)
    return result


def as_json(report: Breakdown, interval: dict) -> dict:
    return {
        "wall_seconds": report.wall, "gpus": report.gpus, "nodes": report.nodes, "finished": report.finished,
        "goodput": report.goodput,
        "categories": {name: {"gpu_seconds": report.seconds[name],
                              "share": report.seconds[name] / report.paid if report.paid else 0.0}
                       for name in CATEGORIES},
        "failures": [{"time": f.time - report.start, "cause": f.cause, "detection_seconds": f.detection_seconds,
                      "downtime_seconds": f.downtime_seconds, "iterations_lost": f.iterations_lost,
                      "phases": [span.to_json() for span in f.phases], "loaded_from": f.loaded_from,
                      "loaded_bytes": f.loaded_bytes}
                     for f in report.failures],
        "restart_phases": {"start": [span.to_json() for span in report.start_phases],
                           "summed": phases.summed([f.phases for f in report.failures])},
        "iterations_redone": report.iterations_redone,
        "generations": [{"started": g.started - report.start, "first_step": None if g.first_step is None
                         else g.first_step - report.start, "stopped": g.stopped - report.start, "why": g.why,
                         "first_iteration": g.first_iteration, "iteration": g.iteration, "steps": g.steps,
                         "used_gpus": g.used_gpus, "nodes": g.nodes} for g in report.generations],
        "saves": len(report.saves),
        "costs": report.costs.to_json(),
        "save_interval": interval,
    }


def as_text(report: Breakdown, interval: dict, title: str) -> str:
    nodes = len(report.nodes)
    lines = [f"{title}: {report.wall:.1f} s wall on {report.gpus} GPUs ({nodes} node{'s' * (nodes != 1)}), "
             f"{'finished' if report.finished else 'not finished'}",
             f"goodput {report.goodput:.1%}  (productive GPU time / paid GPU time)", ""]
    width = max(map(len, CATEGORIES))
    lines.append(f"{'where the time went':<{width}}  {'GPU-hours':>10}  {'share':>6}")
    for name in CATEGORIES:
        value = report.seconds[name]
        if value or name == "productive":
            lines.append(f"{name:<{width}}  {value / 3600:>10.4f}  {value / report.paid:>6.1%}  {CATEGORY_HELP[name]}")
    lines.append("")
    if report.failures:
        lines.append(f"{len(report.failures)} failure(s), {report.iterations_redone} iteration(s) re-done:")
        lines.append(f"  {'at':>8}  {'detected in':>11}  {'down for':>9}  {'lost':>5}  cause")
        for f in report.failures:
            lines.append(f"  {f.time - report.start:>7.1f}s  {f.detection_seconds:>10.1f}s  "
                         f"{f.downtime_seconds:>8.1f}s  {f.iterations_lost:>5}  {f.cause}")
    else:
        lines.append("no failures")
    lines += ["", *phase_table(report), ""]
    used = interval["interval_seconds"]
    line = f"save interval in use: {used:.1f} s of training ({len(report.saves)} saves, " \
           f"{interval['save_seconds']:.2f} s stall each)"
    if interval["recommended_seconds"] is not None:
        line += (f"; Young-Daly for an MTBF of {interval['mtbf_seconds']:.0f} s ({interval['mtbf_from']}): "
                 f"{interval['recommended_seconds']:.1f} s")
    else:
        line += f"; no recommendation: {interval['why_none']}"
    lines.append(line)
    costs = report.costs
    lines.append(f"measured costs (eft simulate --costs, from --json): iteration {costs.iteration_seconds:.3f} s, "
                 f"detection {costs.detection_seconds:.1f} s, restart {costs.restart_seconds:.1f} s, "
                 f"load {costs.load_seconds:.1f} s" + (f", load from memory {costs.memory_load_seconds:.1f} s"
                                                       if costs.memory_load_seconds else "")
                 + " (the phases: detection | stop to spawn | imports to first step)")
    return "\n".join(lines)


def _bytes(size: int | None) -> str:
    if size is None:
        return ""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f" {size:.0f} {unit}" if unit == "B" else f" {size:.1f} {unit}"
        size /= 1000
    return ""


def _cells(spans: list[phases.PhaseSpan], columns: list[str]) -> list[str]:
    """One restart's cells: seconds (+ : it holds the phases marked - before it), blank: no such phase."""
    by_name = {span.name: span for span in spans}
    merged = {str(p) for span in spans for p in span.merged}
    return [f"{by_name[c].seconds:.2f}" + ("+" if by_name[c].merged else "") if c in by_name
            else "-" if c in merged else "" for c in columns]


def phase_table(report: Breakdown) -> list[str]:
    """The restarts taken apart, one row each, their sum, and the job's first start."""
    restarts = [f.phases for f in report.failures]
    spans = [span for row in [*restarts, report.start_phases] for span in row]
    columns = [str(p) for p in ORDER] + (["unfinished"] if any(s.phase is None for s in spans) else [])
    table = [["restart", *columns, "total", "loaded"]]
    for number, failure in enumerate(report.failures, 1):
        table.append([f"#{number} at {failure.time - report.start:.1f}s", *_cells(failure.phases, columns),
                      f"{sum(s.seconds for s in failure.phases):.2f}",
                      (failure.loaded_from or "") + _bytes(failure.loaded_bytes)])
    if len(restarts) > 1:
        summed = phases.summed(restarts)
        table.append(["summed", *(f"{summed[c]:.2f}" if c in summed else "" for c in columns),
                      f"{sum(summed.values()):.2f}", ""])
    table.append(["job start", *_cells(report.start_phases, columns),
                  f"{sum(s.seconds for s in report.start_phases):.2f}", ""])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["restart phases, seconds (each restart adds up to its downtime, last heartbeat to the next first step):"]
    lines += ["  " + "  ".join(cell.ljust(w) if i in (0, len(line) - 1) else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(line, widths))).rstrip() for line in table]
    if any(span.merged for span in spans):
        lines.append("  +: holds the phases marked - before it, which were not recorded (a worker without eft's "
                     "hook, an older eft)")
    if "unfinished" in columns:
        lines.append("  unfinished: no first step followed; up to the job's end")
    return lines


def report_command(
    endpoint: Optional[str] = ENDPOINT,
    run_id: Optional[str] = RUN_ID,
    prefix: Optional[str] = PREFIX,
    runs_dir: str = RUNS_DIR,
    events_file: Optional[Path] = typer.Option(
        None, "--events", help="the event log as JSON lines (eft-run --eft-events-file), instead of etcd"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object instead of text"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write the timeline picture: .svg or .html"),
    mtbf_hours: Optional[float] = typer.Option(
        None, "--mtbf-hours", help="the job's expected MTBF for the recommended interval (default: observed)"),
    etcd_timeout: float = ETCD_TIMEOUT,
) -> None:
    """Goodput of a run: where its GPU time went, its failures, and a recommended save interval."""
    if mtbf_hours is not None and not (math.isfinite(mtbf_hours) and mtbf_hours > 0):
        _fail(f"--mtbf-hours must be > 0, got {mtbf_hours:g}")
    if plot is not None and plot.suffix.lower() not in (".svg", ".html", ".htm"):
        _fail(f"--plot {plot}: expected a .svg or .html file"
              + (" (PNG needs matplotlib, which eft does not depend on)" if plot.suffix.lower() == ".png" else ""))
    if events_file is not None:
        events, title = read_events_file(events_file), f"run of {events_file.name}"
    else:
        target = resolve(lambda message: _fail(f"{message}; or give --events FILE"), endpoint, run_id, prefix, runs_dir)
        run_id = target.keys.run_id
        events, title = read_events_etcd(target.endpoint, run_id, target.keys.prefix, etcd_timeout), f"run {run_id}"
    try:
        report = breakdown(events)
    except ReportError as exc:
        _fail(f"{events_file or run_id}: {exc}")
    interval = young_daly(report, mtbf_hours)
    typer.echo(json.dumps(as_json(report, interval), indent=1) if json_out else as_text(report, interval, title))
    if plot is not None:
        try:
            picture(report, f"eft report: {title}").save(plot, title)
        except (SvgError, OSError) as exc:
            _fail(f"--plot {plot}: {exc}")


def register(app: typer.Typer) -> None:
    app.command("report", cls=OneLineErrors)(report_command)
