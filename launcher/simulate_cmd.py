"""``eft simulate``: the goodput of a job of any size under failures, policy by policy.

Draws one failure trace (Llama 3's rate and causes, or Titan's GPU lifetimes), runs every
policy over it (``elasticft/goodput/simulate.py``) and prints goodput and lost GPU-hours,
``--json`` as one object, ``--plot`` the picture. Bad input: one line, exit status 2.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import NoReturn, Optional

import numpy as np
import typer

from elasticft.goodput.costs import JobCosts
from elasticft.goodput.failures import DAY, LLAMA3_GPU_MTBF_HOURS, Prediction, TitanLifetimes, \
    default_titan_csv, draw_trace
from elasticft.goodput.policies import LOSSES, PRESET_HELP, PRESETS, Cluster, default_spare_nodes
from elasticft.goodput.restart_measured import measured_curve
from elasticft.goodput.sim_plot import picture
from elasticft.goodput.simulate import simulate_job
from elasticft.goodput.svg import SvgError
from launcher.one_line import OneLineErrors, fail

REPO_ROOT = Path(__file__).resolve().parent.parent
# Costs when neither --costs nor the flag gives one: assumptions for a large model on H100s
# (docs/goodput.md gives each one's source). The restart's is not one number: it is the measured
# curve's at the job's node count (elasticft/goodput/restart_measured.py, bench/restart_scale.py).
DEFAULT_COSTS = {
    "iteration_seconds": 10.0, "save_seconds": 60.0, "save_interval_seconds": 0.0,
    "detection_seconds": 5.0, "load_seconds": 60.0,
    "memory_save_seconds": 1.0, "memory_interval_seconds": 0.0, "memory_load_seconds": 10.0,
    "reshard_seconds": 30.0,
}


def _fail(message: str) -> NoReturn:
    fail("simulate", message)


def _cost_option(name: str, help_text: str):
    flag = "--" + name.replace("_", "-")
    default = f"{DEFAULT_COSTS[name]:g}" if name in DEFAULT_COSTS else "the measured curve's at --gpus"
    return typer.Option(None, flag, help=f"{help_text} (default {default}, or --costs)")


def _read_costs(path: Optional[Path]) -> dict:
    if path is None:
        return dict(DEFAULT_COSTS)
    try:
        record = json.loads(path.read_text())
    except OSError as exc:
        _fail(f"--costs {path}: cannot read it ({exc.strerror or exc})")
    except ValueError as exc:
        _fail(f"--costs {path}: not valid JSON ({exc})")
    if isinstance(record, dict) and isinstance(record.get("costs"), dict):
        record = record["costs"]  # the whole of `eft report --json`
    if not isinstance(record, dict):
        _fail(f"--costs {path}: expected a JSON object of costs")
    return {**DEFAULT_COSTS, **record}


def _check(name: str, value: float, low: float = 0.0, strict: bool = False) -> None:
    if not np.isfinite(value) or value < low or (strict and value == low):
        _fail(f"{name} must be {'>' if strict else '>='} {low:g}, got {value:g}")


def _table(results, used, trace, cluster, job_mtbf) -> str:
    lines = [f"{cluster.gpus:,} GPUs ({cluster.nodes:,} nodes of {cluster.gpus_per_node}) for "
             f"{trace.seconds / DAY:g} days: {len(trace.times)} failures (job MTBF "
             f"{job_mtbf / 3600:.2f} h), {np.sum(trace.leads == trace.leads)} predicted, "
             f"{len(trace.alarms)} false alarms; {cluster.spare_nodes} spare nodes, "
             f"repair {cluster.repair_seconds / 3600:g} h"]
    heads = ["policy", "goodput", "save every", "memory every", *LOSSES, "recoveries mem/disk", "proactive"]
    rows = [heads]
    for result in results:
        costs = used[result.policy]
        lost = result.lost_gpu_hours()
        memory = f"{costs.memory_interval_seconds:.0f} s" if PRESETS.get(result.policy, None) and \
            PRESETS[result.policy].memory else "-"
        rows.append([result.policy, f"{result.goodput:.2%}", f"{costs.save_interval_seconds:.0f} s", memory,
                     *(f"{lost[name]:,.0f}" for name in LOSSES),
                     f"{result.memory_recoveries}/{result.disk_recoveries}", str(result.proactive_saves)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(heads))]
    lines += ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
              for row in rows]
    lines.append("lost columns: GPU-hours; goodput = productive GPU-time / paid GPU-time (spares included)")
    return "\n".join(lines)


def simulate_command(
    gpus: int = typer.Option(16384, "--gpus", help="GPUs of the job (a multiple of --gpus-per-node)"),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node; a failure takes a node down"),
    days: float = typer.Option(54.0, "--days", help="wall-clock days simulated"),
    failure_model: str = typer.Option("llama3", "--failure-model",
                                      help="llama3: Poisson per GPU at Llama 3's rate and causes; titan: "
                                      "GPU lifetimes of Titan (--titan)"),
    gpu_mtbf_hours: float = typer.Option(LLAMA3_GPU_MTBF_HOURS, "--gpu-mtbf-hours",
                                         help="llama3 model: one GPU's MTBF (default Llama 3's: 54 d x "
                                         "16,384 GPUs / 419 failures)"),
    titan: Optional[Path] = typer.Option(None, "--titan", help="Titan's gc_summary_loc.csv (default "
                                         "../shared/data/titan/ next to the repository)"),
    predictable: float = typer.Option(0.25, "--predictable", help="share of failures the health model "
                                      "announces ahead, in [0, 1]"),
    lead_time_seconds: float = typer.Option(300.0, "--lead-time-seconds",
                                            help="mean (exponential) lead time of an announced failure"),
    false_alarms: float = typer.Option(1e-4, "--false-alarms-per-gpu-day",
                                       help="health alarms on GPUs that do not fail, per GPU-day"),
    costs_file: Optional[Path] = typer.Option(None, "--costs", help="JobCosts JSON (or `eft report "
                                              "--json` output); the flags below override it"),
    iteration_seconds: Optional[float] = _cost_option("iteration_seconds", "one training iteration, s"),
    save_seconds: Optional[float] = _cost_option("save_seconds", "stall of one disk checkpoint, s"),
    save_interval_seconds: Optional[float] = _cost_option(
        "save_interval_seconds", "training between disk saves, s; 0: Young-Daly"),
    detection_seconds: Optional[float] = _cost_option("detection_seconds", "eft: failure to detection, s"),
    restart_seconds: Optional[float] = _cost_option("restart_seconds", "eft: a restart's control path "
                                                    "(stop to first step, the state's load apart), s"),
    load_seconds: Optional[float] = _cost_option("load_seconds", "load of a disk checkpoint, s"),
    memory_save_seconds: Optional[float] = _cost_option("memory_save_seconds", "stall of a memory checkpoint, s"),
    memory_interval_seconds: Optional[float] = _cost_option(
        "memory_interval_seconds", "training between memory saves, s; 0: Young-Daly"),
    memory_load_seconds: Optional[float] = _cost_option("memory_load_seconds", "load from memory, s"),
    reshard_seconds: Optional[float] = _cost_option("reshard_seconds", "extra load on a new GPU count, s"),
    keep_intervals: bool = typer.Option(False, "--keep-intervals", help="use the --costs file's save "
                                        "intervals instead of Young-Daly's"),
    torchrun_detection: float = typer.Option(600.0, "--torchrun-detection-seconds",
                                             help="periodic policy: failure to detection (NCCL's timeout)"),
    torchrun_restart: float = typer.Option(77.0, "--torchrun-restart-seconds",
                                           help="periodic policy: detection to new workers (bench/node_loss.py)"),
    spare_nodes: int = typer.Option(-1, "--spare-nodes", help="hot spare nodes; -1: nodes in repair, "
                                    "mean + 3 sd + 1"),
    repair_hours: float = typer.Option(24.0, "--repair-hours", help="how long a failed node is away"),
    replica_gpus: int = typer.Option(0, "--replica-gpus", help="GPUs of one model replica (TP x PP): "
                                     "re-planning drops whole replicas; 0: one node"),
    policies: str = typer.Option(",".join(PRESETS), "--policies",
                                 help="comma-separated: " + "; ".join(f"{k}: {v}" for k, v in PRESET_HELP.items())),
    seed: int = typer.Option(0, "--seed", help="seed of the failure trace"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write the picture of the run: .svg or .html"),
) -> None:
    """Simulate a job's goodput under failures for each policy, over one failure trace."""
    started = time.perf_counter()
    _check("--gpus", gpus, 1)
    _check("--gpus-per-node", gpus_per_node, 1)
    _check("--days", days, 0, strict=True)
    _check("--gpu-mtbf-hours", gpu_mtbf_hours, 0, strict=True)
    for name, value in (("--lead-time-seconds", lead_time_seconds), ("--false-alarms-per-gpu-day", false_alarms),
                        ("--torchrun-detection-seconds", torchrun_detection),
                        ("--torchrun-restart-seconds", torchrun_restart), ("--repair-hours", repair_hours),
                        ("--replica-gpus", replica_gpus)):
        _check(name, value)
    if not 0 <= predictable <= 1:
        _fail(f"--predictable must be in [0, 1], got {predictable:g}")
    if failure_model not in ("llama3", "titan"):
        _fail(f"--failure-model: unknown model {failure_model!r}; use llama3 or titan")
    chosen = [name.strip() for name in policies.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in PRESETS]
    if unknown or not chosen:
        _fail(f"--policies: unknown {', '.join(unknown) or '(none given)'}; use {', '.join(PRESETS)}")
    if plot is not None and plot.suffix.lower() not in (".svg", ".html", ".htm"):
        _fail(f"--plot {plot}: PNG needs matplotlib, which eft does not depend on; write .svg or .html"
              if plot.suffix.lower() == ".png" else f"--plot {plot}: use a .svg or .html file")
    values = _read_costs(costs_file)
    given = {"iteration_seconds": iteration_seconds, "save_seconds": save_seconds,
             "save_interval_seconds": save_interval_seconds, "detection_seconds": detection_seconds,
             "restart_seconds": restart_seconds, "load_seconds": load_seconds,
             "memory_save_seconds": memory_save_seconds, "memory_interval_seconds": memory_interval_seconds,
             "memory_load_seconds": memory_load_seconds, "reshard_seconds": reshard_seconds}
    values.update({name: value for name, value in given.items() if value is not None})
    curve, nodes = None, max(1, gpus // gpus_per_node)
    if "restart_seconds" not in values:  # neither the flag nor --costs: what a restart costs at this size
        curve = measured_curve()
        values["restart_seconds"] = curve.seconds(nodes)
    try:
        costs = JobCosts.from_json(values)
    except (TypeError, ValueError) as exc:
        _fail(f"costs{f' ({costs_file})' if costs_file else ''}: {exc}")
    try:
        model = None
        if failure_model == "titan":
            model = TitanLifetimes.from_csv(titan or default_titan_csv(REPO_ROOT))
    except (OSError, ValueError) as exc:
        _fail(f"--titan: {exc}")
    seconds = days * DAY
    rng = np.random.default_rng(seed)
    try:
        trace = draw_trace(gpus, gpus_per_node, seconds, rng, Prediction(predictable, lead_time_seconds,
                           false_alarms), gpu_mtbf_hours, model)
    except ValueError as exc:
        _fail(str(exc))
    if model is not None and not len(trace.times):
        _fail(f"--failure-model titan: no failure in {days:g} days on {gpus} GPUs; simulate more of either")
    job_mtbf = seconds / len(trace.times) if model is not None else gpu_mtbf_hours * 3600.0 / gpus
    repair = repair_hours * 3600.0
    try:
        cluster = Cluster(gpus, gpus_per_node, spare_nodes if spare_nodes >= 0 else default_spare_nodes(job_mtbf, repair),
                          repair, replica_gpus, torchrun_detection, torchrun_restart)
    except ValueError as exc:
        _fail(str(exc))
    keep = keep_intervals and costs_file is not None
    used, results = simulate_job(costs, cluster, trace, [PRESETS[name] for name in chosen], job_mtbf,
                                 young_daly_disk=not (keep or save_interval_seconds),
                                 young_daly_memory=not (keep or memory_interval_seconds),
                                 record=plot is not None)
    if plot is not None:
        try:
            picture(results, trace, f"eft simulate: {gpus:,} GPUs, {days:g} days, {failure_model} failures "
                    f"(seed {seed})").save(plot, "eft simulate")
        except (OSError, SvgError) as exc:
            _fail(f"--plot {plot}: {exc}")
    elapsed = time.perf_counter() - started
    if as_json:
        typer.echo(json.dumps({
            "gpus": gpus, "gpus_per_node": gpus_per_node, "days": days, "failure_model": failure_model,
            "seed": seed, "job_mtbf_hours": job_mtbf / 3600.0, "failures": len(trace.times),
            "causes": trace.cause_counts(), "false_alarms": len(trace.alarms),
            "spare_nodes": cluster.spare_nodes, "repair_hours": repair_hours,
            "costs": {name: c.to_json() for name, c in used.items()},
            "restart_curve": curve.describe(nodes) if curve else None,
            "policies": [r.to_json() for r in results], "seconds": elapsed}, indent=2))
    else:
        typer.echo(_table(results, used, trace, cluster, job_mtbf))
        if curve is not None:
            typer.echo(f"eft's {curve.describe(nodes)}")
        typer.echo(f"simulated in {elapsed:.2f} s")


def register(app: typer.Typer) -> None:
    app.command("simulate", cls=OneLineErrors)(simulate_command)
