"""``eft health replay TRACE.csv`` and ``eft health eval TRACES...``.

``replay`` prints, per GPU, the highest risk, when it first crossed the threshold,
and the factor that dominated. ``eval`` measures the model on labelled traces
(recall, precision, false triggers, lead time; ``health_eval.py`` formats it).
``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import typer

from elasticft.config import ConfigError, RiskConfig, from_env
from elasticft.health.evaluate import (
    LabelError,
    calibration_grid,
    evaluate,
    lead_stats,
    propose_threshold,
    score_trace,
)
from elasticft.health.labels import read_labels
from elasticft.health.risk import RiskModel
from elasticft.health.summary import GpuSummary, summarize
from elasticft.health.trace import TraceError, read_trace
from launcher.health_eval import DEFAULT_THRESHOLDS, eval_json, eval_tables, parse_thresholds

health_app = typer.Typer(
    help="GPU health: score telemetry traces offline.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _fail(message: str, command: str = "replay") -> typer.Exit:
    typer.echo(f"eft health {command}: error: {message}", err=True)
    return typer.Exit(2)


def _table(summaries: list[GpuSummary], threshold: float) -> str:
    lines = [f"{'node':<16} {'gpu':>3}  {'max_risk':>8}  {'first_trigger':<32}  dominant"]
    for s in summaries:
        data = s.to_dict()
        dominant = data["dominant_factor"] or "-"
        if data["critical"]:
            dominant += f" ({data['critical']})"
        first = data["first_trigger"] or "-"
        lines.append(f"{s.node:<16} {s.gpu:>3}  {s.max_risk:>8.3f}  {first:<32}  {dominant}")
    crossed = sum(1 for s in summaries if s.first_trigger)
    lines.append(f"{crossed} of {len(summaries)} GPUs crossed the threshold {threshold:g}")
    return "\n".join(lines)


@health_app.command("replay")
def replay(
    trace: Path = typer.Argument(..., help="CSV trace: eft's format or nvidia-smi --format=csv output"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of a table"),
    threshold: Optional[float] = typer.Option(
        None, "--threshold", help="risk threshold (default: --eft-risk-threshold / EFT_RISK_THRESHOLD, 0.8)"
    ),
    node: Optional[str] = typer.Option(None, "--node", help="node name for every row (default: the trace's)"),
) -> None:
    """Score TRACE as fast as possible and report, per GPU, its highest risk and first trigger."""
    try:
        config = from_env(RiskConfig)
        if threshold is not None:
            config = dataclasses.replace(config, risk_threshold=threshold)
    except ConfigError as exc:
        if threshold is not None and "threshold" in str(exc):
            raise _fail(f"--threshold: expected a number in (0, 1], got {threshold}") from None
        raise _fail(str(exc)) from None
    try:
        summaries = summarize(read_trace(trace, node), RiskModel(config))
    except TraceError as exc:
        raise _fail(str(exc)) from None
    if as_json:
        payload = {"threshold": config.risk_threshold, "gpus": [s.to_dict() for s in summaries]}
        typer.echo(json.dumps(payload, indent=2))
    else:
        typer.echo(_table(summaries, config.risk_threshold))


@health_app.command("eval")
def evaluate_cmd(
    traces: list[Path] = typer.Argument(..., help="CSV traces; <trace>.labels.json beside one adds labels"),
    thresholds: str = typer.Option(
        DEFAULT_THRESHOLDS, "--thresholds", help="comma-separated risk thresholds in (0, 1] to measure"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of tables"),
) -> None:
    """Measure the risk model on TRACES: recall, precision, false triggers per GPU-day, lead time."""
    try:
        levels = parse_thresholds(thresholds)
        model_config = from_env(RiskConfig)
    except (ValueError, ConfigError) as exc:
        raise _fail(str(exc), "eval") from None
    scored = _score_all(traces, model_config, "eval")
    results = evaluate(scored, levels)
    if as_json:
        typer.echo(json.dumps(eval_json(results, [str(p) for p in traces]), indent=2))
    else:
        typer.echo(eval_tables(results))


def _score_all(traces: list[Path], config: RiskConfig, command: str) -> list:
    """Each trace replayed through a fresh model, with its sidecar's labels."""
    try:
        return [score_trace(p.stem, read_trace(p), RiskModel(config), read_labels(p)) for p in traces]
    except (TraceError, LabelError) as exc:
        raise _fail(str(exc), command) from None


@health_app.command("calibrate")
def calibrate_cmd(
    traces: list[Path] = typer.Argument(..., help="CSV traces of your fleet; GPUs that did not fail count as healthy"),
    target_text: str = typer.Option("1", "--target", help="false triggers per 100 healthy GPU-days you accept"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of text"),
) -> None:
    """Propose the lowest risk threshold whose false triggers on TRACES stay within --target."""
    try:
        target = float(target_text)
    except ValueError:
        target = float("nan")
    if not 0 <= target < float("inf"):  # NaN fails this too
        raise _fail(f"--target: expected false triggers per 100 GPU-days >= 0, got {target_text!r}", "calibrate")
    try:
        config = from_env(RiskConfig)
    except ConfigError as exc:
        raise _fail(str(exc), "calibrate") from None
    results = evaluate(_score_all(traces, config, "calibrate"), calibration_grid())
    best = propose_threshold(results, target)
    days = results[0].healthy_gpu_days
    enough = days * target >= 100 if target > 0 else False
    payload = {
        "target_per_100_gpu_days": target, "healthy_gpu_days": round(days, 3),
        "threshold": None if best is None else best.threshold,
        "false_triggers": None if best is None else best.false_triggers,
        "failures": None if best is None else len(best.outcomes),
        "caught": None if best is None else sum(o.first_trigger is not None for o in best.outcomes),
        "worst_lead_s": None if best is None else lead_stats(best.outcomes)[1],
        "enough_data": enough,
    }
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    if best is None:
        typer.echo(f"no threshold up to 1.0 keeps false triggers within {target:g} per 100 GPU-days "
                   f"over {days:.1f} healthy GPU-days")
        return
    lines = [f"proposed --eft-risk-threshold {best.threshold:g}: {best.false_triggers} false trigger(s) over "
             f"{days:.1f} healthy GPU-days (target {target:g} per 100)"]
    if best.outcomes:
        lead = payload["worst_lead_s"]
        shortest = "" if lead is None else f", shortest lead {lead / 60:.1f} min"
        lines.append(f"labelled failures caught at it: {payload['caught']}/{payload['failures']}{shortest}")
    if not enough:
        lines.append(f"note: {days:.1f} GPU-days cannot show a rate of {target:g} per 100; "
                     f"replay at least {100 / target if target else float('inf'):.0f} GPU-days")
    typer.echo("\n".join(lines))


def register(app: typer.Typer) -> None:
    app.add_typer(health_app, name="health")
