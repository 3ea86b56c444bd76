"""The picture of a real run (``eft report --plot``): one lane per node, what it did when.

Lanes are coloured by what the node's GPUs were doing: loading (process start and
checkpoint load), training, failing (a failure not yet acted on), restarting (between
two generations of workers), finishing (after the last step), lost (from the failure
that took the node). Persistent saves
are dark ticks; each failure is a red line across every lane at its last heartbeat.

Below the nodes, one lane takes the job's first start and each restart apart: a band per
phase (``phases.py``: detection, stop, rendezvous, re-plan, spawn, imports, process group,
load, first step), from the failure's last heartbeat to the next first step.
"""

from __future__ import annotations

from elasticft.contract.phases import ORDER, PHASE_HELP
from elasticft.goodput.breakdown import Breakdown
from elasticft.goodput.svg import Axes, Canvas, ticks

COLOURS = {
    "load": "#9ecae1",
    "training": "#31a354",
    "failing": "#fd8d3c",
    "restarting": "#fee391",
    "finishing": "#bcbddc",
    "idle": "#d9d9d9",
    "lost": "#969696",
}
SAVE, FAILURE = "#08306b", "#d62728"
LANE, GAP = 26, 8
PHASE_COLOURS = dict(zip([str(p) for p in ORDER] + ["unfinished"], [
    "#fd8d3c", "#e6550d", "#fee391", "#fec44f", "#d9f0a3", "#d4b9da", "#6baed6", "#2171b5", "#9e9ac8", "#bdbdbd"]))


def picture(report: Breakdown, title: str) -> Canvas:
    nodes = sorted(report.nodes)
    height = 155 + (len(nodes) + 1) * (LANE + GAP)
    canvas = Canvas(980, height)
    canvas.text(20, 26, title, size=15, bold=True)
    canvas.text(20, 46, f"goodput {report.goodput:.1%} of {report.wall:.1f} s x {report.gpus} GPUs; "
                f"{len(report.failures)} failure(s), {report.iterations_redone} iteration(s) re-done", size=12)
    axes = Axes(canvas, 150, 70, 800, (len(nodes) + 1) * (LANE + GAP), (0.0, report.wall), (0.0, 1.0))
    at = lambda t: axes.x(min(max(t - report.start, 0.0), report.wall))  # noqa: E731 - unix time -> pixels
    for row, node in enumerate(nodes):
        top = axes.top + row * (LANE + GAP)
        canvas.text(axes.left - 8, top + LANE * 0.65, node, size=11, anchor="end")
        lost_at = report.lost.get(node)
        # A node killed outright recorded nothing of its last generation: it took part in every
        # generation that started while it was there.
        lost_from = max((f.time for f in report.failures if lost_at and f.time <= lost_at), default=lost_at)
        canvas.rect(at(report.start), top, at(report.end) - at(report.start), LANE, COLOURS["idle"],
                    title=f"{node}: no workers of its own")
        for index, gen in enumerate(report.generations):
            killed_in_it = lost_at is not None and report.joined.get(node, gen.started) <= gen.started < lost_at
            if node not in gen.nodes and not killed_in_it:
                continue
            first = gen.first_step or gen.last_beat
            _span(canvas, at, top, gen.started, first, "load", f"{node}: start and load")
            _span(canvas, at, top, first, gen.accounted_until, "training",
                  f"{node}: training, iterations {gen.first_iteration}-{gen.iteration}")
            ended_by_failure = gen.why != "finished" and index < len(report.failures)
            _span(canvas, at, top, gen.accounted_until, gen.stopped, "failing" if ended_by_failure else "finishing",
                  f"{node}: failure to restart" if ended_by_failure else f"{node}: after the last step")
            following = report.generations[index + 1] if index + 1 < len(report.generations) else None
            if following is not None and (lost_from is None or lost_from > gen.stopped):
                _span(canvas, at, top, gen.stopped, following.started, "restarting", f"{node}: restarting")
        if lost_from is not None:
            _span(canvas, at, top, lost_from, report.end, "lost", f"{node}: lost")
        for save in report.saves:
            done = float(save.get("time", 0.0))
            if lost_from is not None and done > lost_from:
                continue
            seconds = save.get("seconds") if isinstance(save.get("seconds"), (int, float)) else 0.0
            canvas.rect(at(done - seconds), top, max(at(done) - at(done - seconds), 1.5), LANE, SAVE,
                        title=f"checkpoint of iteration {save.get('iteration')}")
    _phase_lane(canvas, at, axes.top + len(nodes) * (LANE + GAP), report)
    bottom = axes.top + axes.height
    for failure in report.failures:
        x = at(failure.time)
        canvas.line(x, axes.top - 4, x, bottom, stroke=FAILURE, width=2)
        canvas.text(x + 3, axes.top - 6, failure.cause, size=10, fill=FAILURE)
    axes.frame("seconds since the job started", "", ticks(0, report.wall, 8), [])
    for row, legend in enumerate(([*COLOURS.items(), ("save", SAVE), ("failure", FAILURE)],
                                  list(PHASE_COLOURS.items()))):
        x = axes.left
        if row:
            canvas.text(x - 8, bottom + 58 + 22 * row, "phases", size=11, anchor="end")
        for name, colour in legend:
            canvas.rect(x, bottom + 48 + 22 * row, 12, 12, colour)
            canvas.text(x + 16, bottom + 58 + 22 * row, name, size=11)
            x += 22 + 6 * len(name) + (20 if not row else 6)
    return canvas


def _phase_lane(canvas: Canvas, at, top: float, report: Breakdown) -> None:
    """The job's start and each restart, phase by phase, on one lane."""
    canvas.text(150 - 8, top + LANE * 0.65, "restart phases", size=11, anchor="end")
    restarts = [("job start", report.start, report.start_phases)]
    restarts += [(f"restart #{i} ({f.cause})", f.time, f.phases) for i, f in enumerate(report.failures, 1)]
    for name, begin, spans in restarts:
        for span in spans:
            merged = f" (with {', '.join(map(str, span.merged))}, not recorded)" if span.merged else ""
            help_text = PHASE_HELP[span.phase] if span.phase else "no first step followed"
            _span(canvas, at, top, begin, begin + span.seconds, span.name,
                  f"{name}: {span.name} {span.seconds:.2f} s{merged}: {help_text}", PHASE_COLOURS)
            begin += span.seconds


def _span(canvas: Canvas, at, top: float, begin: float, end: float, kind: str, title: str, colours=COLOURS) -> None:
    if end > begin:
        canvas.rect(at(begin), top, at(end) - at(begin), LANE, colours[kind], title=title)
