"""What ``eft health eval`` prints: the threshold list it reads, its tables and JSON."""

from __future__ import annotations

from elasticft.health.evaluate import Outcome, ThresholdResult, caught, lead_stats
from elasticft.health.sample import iso_time

DEFAULT_THRESHOLDS = "0.5,0.6,0.7,0.8,0.9,0.95"


def parse_thresholds(text: str) -> list[float]:
    """``0.5,0.6`` -> [0.5, 0.6]; ValueError naming --thresholds on anything else."""
    levels = []
    for part in text.split(","):
        try:
            level = float(part)
        except ValueError:
            level = float("nan")
        if not 0 < level <= 1:  # NaN fails this too
            raise ValueError(f"--thresholds: expected numbers in (0, 1] separated by commas, got {text!r}")
        levels.append(level)
    return levels


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def eval_tables(results: list[ThresholdResult]) -> str:
    """One row per threshold, then, per threshold, its failures by mode."""
    header = (
        f"{'threshold':>9}  {'recall':>11}  {'precision':>15}  {'false/GPU-day':>13}  "
        f"{'median lead':>11}  {'worst lead':>10}"
    )
    lines = [header]
    for r in results:
        hits = caught(r.outcomes)
        triggers = r.true_triggers + r.false_triggers
        median, worst = lead_stats(r.outcomes)
        per_day = "-" if r.false_per_gpu_day is None else f"{r.false_per_gpu_day:.2f}"
        lines.append(
            f"{r.threshold:>9g}  {f'{hits}/{len(r.outcomes)} {_percent(r.recall)}':>11}  "
            f"{f'{r.true_triggers}/{triggers} {_percent(r.precision)}':>15}  {per_day:>13}  "
            f"{_duration(median):>11}  {_duration(worst):>10}"
        )
    if results:
        days = results[0].healthy_gpu_days
        lines.append(f"(healthy GPUs: {days:.2f} GPU-days; worst lead: the shortest over the caught failures)")
    for r in results:
        lines.append("")
        lines.append(f"threshold {r.threshold:g}, by failure mode:")
        lines.append(f"  {'mode':<24} {'caught':>7}  {'median lead':>11}  {'worst lead':>10}")
        for mode, outcomes in r.by_mode().items():
            hits = caught(outcomes)
            median, worst = lead_stats(outcomes)
            lines.append(
                f"  {mode:<24} {f'{hits}/{len(outcomes)}':>7}  {_duration(median):>11}  {_duration(worst):>10}"
            )
    return "\n".join(lines)


def _outcome_json(o: Outcome) -> dict:
    return {
        "trace": o.trace,
        "node": o.node,
        "gpu": o.gpu,
        "mode": o.mode,
        "failed_at": iso_time(o.failed_at),
        "caught": o.first_trigger is not None,
        "first_trigger": None if o.first_trigger is None else iso_time(o.first_trigger),
        "lead_s": _round(o.lead_s, 1),
    }


def eval_json(results: list[ThresholdResult], traces: list[str]) -> dict:
    thresholds = []
    for r in results:
        median, worst = lead_stats(r.outcomes)
        modes = {}
        for mode, outcomes in r.by_mode().items():
            mode_median, mode_worst = lead_stats(outcomes)
            hits = caught(outcomes)
            modes[mode] = {
                "failures": len(outcomes), "caught": hits, "recall": _round(hits / len(outcomes)),
                "median_lead_s": _round(mode_median, 1), "worst_lead_s": _round(mode_worst, 1),
            }
        thresholds.append({
            "threshold": r.threshold,
            "failures": len(r.outcomes),
            "caught": caught(r.outcomes),
            "recall": _round(r.recall),
            "triggers": r.true_triggers + r.false_triggers,
            "true_triggers": r.true_triggers,
            "precision": _round(r.precision),
            "false_triggers": r.false_triggers,
            "healthy_gpu_days": _round(r.healthy_gpu_days, 4),
            "false_triggers_per_gpu_day": _round(r.false_per_gpu_day),
            "median_lead_s": _round(median, 1),
            "worst_lead_s": _round(worst, 1),
            "modes": modes,
            "outcomes": [_outcome_json(o) for o in r.outcomes],
        })
    return {"traces": traces, "thresholds": thresholds}
