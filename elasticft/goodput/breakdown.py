"""Where a real run's paid GPU time went, from its event log alone (``eft report``).

The log holds, per generation of workers (from a start to the restart or end that stops
them), one ``workers_stopped`` event per node: its local rank 0's section totals. Training
is synchronous, so one rank's clock is the job's; the lowest rank's record stands for its
generation. Wall time is cut into consecutive pieces, each charged to one category:

    job start ─ rendezvous ─┬─ generation 0: load | steps, saves | failure→detected ─┬─ restart ─ generation 1 ...
                            └ first workers start                 last heartbeat ┘   └ stop, rendezvous

A piece inside a generation is paid by every GPU of the job but advances training only on
the GPUs the layout uses: spare ranks are ``idle_spares``, GPUs of nodes gone are
``reduced_capacity``. So the categories add up to wall time x all GPUs, and goodput is
productive GPU-seconds over that.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from elasticft.contract.events import EventKind
from elasticft.contract.phases import LoadTier
from elasticft.goodput import phases
from elasticft.goodput.costs import JobCosts

# Wall-time categories, in the order a report lists them.
CATEGORIES = ("productive", "rework", "save_disk", "save_memory", "rendezvous_load", "detection", "hung",
              "restart", "other", "shutdown", "idle_spares", "reduced_capacity")
CATEGORY_HELP = {
    "productive": "training steps that advanced the model",
    "rework": "training steps re-done after a failure (lost work)",
    "save_disk": "training stalled by persistent checkpoints",
    "save_memory": "training stalled by memory checkpoints",
    "rendezvous_load": "rendezvous, process start and checkpoint load, up to each first step",
    "detection": "from a failure (the last heartbeat) to the job acting on it",
    "hung": "from a hung rank's last heartbeat to the job acting on it",
    "restart": "stopping the workers, the new rendezvous and re-plan",
    "other": "time the loop marked as other (evaluation)",
    "shutdown": "after the last step: the final save, exit barrier, agent exit",
    "idle_spares": "GPUs of spare ranks while the others trained",
    "reduced_capacity": "GPUs of nodes gone while the job went on without them",
}


class ReportError(ValueError):
    """An event log that cannot be reported on (empty, not eft's, no workers ever ran)."""


@dataclass
class Generation:
    """One generation of workers, as its lowest rank saw it (unix times)."""

    started: float
    first_step: float | None
    last_beat: float
    stopped: float  # when the agent recorded the stop
    why: str  # restart, finished or failed
    first_iteration: int | None
    iteration: int | None
    steps: int
    totals: dict[str, float]
    stalls: dict[str, float]
    nodes: list[str]  # every node that reported this generation
    records: list[dict] = field(default_factory=list)  # its workers_stopped events, one per node
    used_gpus: int = 0
    world_gpus: int = 0

    @property
    def accounted_until(self) -> float:
        """The end of the last section the rank closed: what follows is the failure's."""
        return self.started + sum(self.totals.values())


@dataclass
class Failure:
    """One interruption: the generation it ended and what it cost."""

    time: float  # the last heartbeat before it (unix)
    cause: str
    detection_seconds: float
    downtime_seconds: float  # last heartbeat to the next first step (None-safe: to the job's end)
    iterations_lost: int
    phases: list[phases.PhaseSpan] = field(default_factory=list)  # the downtime, phase by phase (phases.py)
    loaded_from: str | None = None  # the tier the next generation loaded from (memory, disk, none)
    loaded_bytes: int | None = None  # the size of the checkpoint it loaded


@dataclass
class Breakdown:
    start: float
    end: float
    gpus: int  # every GPU the job had (the allocation)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))  # GPU-seconds
    generations: list[Generation] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    saves: list[dict] = field(default_factory=list)  # ckpt_saved events
    lost: dict[str, float] = field(default_factory=dict)  # node -> when it was reported lost
    nodes: dict[str, int] = field(default_factory=dict)  # node -> GPUs
    joined: dict[str, float] = field(default_factory=dict)  # node -> when it first joined
    start_phases: list[phases.PhaseSpan] = field(default_factory=list)  # job start to the first step
    costs: JobCosts | None = None
    finished: bool = False

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def paid(self) -> float:
        return self.wall * self.gpus

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.paid if self.paid > 0 else 0.0

    def training_window(self) -> tuple[float, float]:
        """From the first step to the end of the last: the span a simulator that starts
        training at once and stops at the last step (``eft simulate``'s replay) models."""
        return self.generations[0].first_step or self.generations[0].started, self.generations[-1].accounted_until

    def window_goodput(self) -> float:
        begin, end = self.training_window()
        return self.seconds["productive"] / ((end - begin) * self.gpus) if end > begin else 0.0

    @property
    def iterations_redone(self) -> int:
        return sum(f.iterations_lost for f in self.failures)


def _num(value, default=0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _generations(events: list[dict]) -> list[Generation]:
    """Group the nodes' workers_stopped records into generations: one generation's records
    overlap in time (their workers ran together), two generations never do."""
    records = sorted((e for e in events if e.get("kind") == EventKind.WORKERS_STOPPED
                      and isinstance(e.get("started"), (int, float))), key=lambda e: e["started"])
    groups: list[list[dict]] = []
    for record in records:
        if groups and record["started"] <= max(_num(r.get("last_beat"), r["started"]) for r in groups[-1]):
            groups[-1].append(record)
        else:
            groups.append([record])
    generations = []
    for group in groups:
        lead = min(group, key=lambda r: _num(r.get("rank"), math.inf))
        first = lead.get("first_step")
        generations.append(Generation(
            started=float(lead["started"]), first_step=float(first) if isinstance(first, (int, float)) else None,
            last_beat=_num(lead.get("last_beat"), float(lead["started"])), stopped=_num(lead.get("time")),
            why=str(lead.get("why", "")), first_iteration=lead.get("first_iteration"),
            iteration=lead.get("iteration"), steps=int(_num(lead.get("steps"))),
            totals={k: _num(v) for k, v in dict(lead.get("totals") or {}).items()},
            stalls={k: _num(v) for k, v in dict(lead.get("stalls") or {}).items()},
            nodes=sorted({str(r.get("source")) for r in group}), records=group))
    return generations


def _first_after(events: list[dict], kinds: set, after: float, until: float) -> dict | None:
    return next((e for e in events if e.get("kind") in kinds and after <= _num(e.get("time")) <= until), None)


def breakdown(events: list[dict]) -> Breakdown:
    """The report of a run from its events (any order). Raises ReportError."""
    events = sorted((e for e in events if isinstance(e, dict) and isinstance(e.get("time"), (int, float))),
                    key=lambda e: e["time"])
    nodes: dict[str, int] = {}
    joined: dict[str, float] = {}
    for e in events:
        if e.get("kind") == EventKind.NODE_JOINED:
            nodes[str(e.get("source"))] = max(nodes.get(str(e.get("source")), 0), int(_num(e.get("gpus"), 1)))
            joined.setdefault(str(e.get("source")), e["time"])
    if not nodes:
        raise ReportError("no node_joined event: not the event log of an eft-run job")
    generations = _generations(events)
    if not generations:
        raise ReportError("no workers_stopped event: no workers ever stopped in this run (still running, "
                          "or recorded by an eft older than eft report)")
    ends = [e for e in events if e.get("kind") in (EventKind.JOB_FINISHED, EventKind.JOB_FAILED)]
    report = Breakdown(start=events[0]["time"], end=(ends[-1] if ends else events[-1])["time"],
                       gpus=sum(nodes.values()), generations=generations, nodes=nodes, joined=joined,
                       finished=any(e.get("kind") == EventKind.JOB_FINISHED for e in ends))
    report.end = max(report.end, generations[-1].stopped)
    report.saves = [e for e in events if e.get("kind") == EventKind.CKPT_SAVED]
    report.lost = {str(n): e["time"] for e in events if e.get("kind") == EventKind.NODE_LOST
                   for n in (e.get("nodes") or [])}
    _account(report, events)
    first = generations[0]
    report.start_phases = phases.start_spans(report.start, first.first_step or report.end, first.first_step is not None,
                                             first.records)
    report.costs = _costs(report)
    return report


def _layout_at(events: list[dict], when: float, default: int) -> tuple[int, int]:
    """(used, world) GPUs of the newest layout event at ``when``; no planner: all in use."""
    layouts = [e for e in events if e.get("kind") == EventKind.LAYOUT and e["time"] <= when]
    if not layouts:
        return default, default
    last = layouts[-1]
    return int(_num(last.get("used"), default)), int(_num(last.get("world_size"), default))


def _account(report: Breakdown, events: list[dict]) -> None:
    seconds, gpus = report.seconds, report.gpus
    _clamp_starts(report)
    first = report.generations[0]
    seconds["rendezvous_load"] += (first.started - report.start) * gpus
    reached = 0  # the highest iteration any generation stepped
    for index, gen in enumerate(report.generations):
        gen.used_gpus, gen.world_gpus = _layout_at(events, gen.first_step or gen.started, gpus)
        used, unused = min(gen.used_gpus, gpus), gpus - min(gen.world_gpus, gpus)
        spare = max(gpus - used - unused, 0)
        duration = max(gen.stopped, gen.accounted_until) - gen.started
        seconds["idle_spares"] += duration * spare
        seconds["reduced_capacity"] += duration * unused
        stall_disk = gen.totals.get("checkpointing", 0.0) + gen.stalls.get("disk", 0.0)
        stall_memory = gen.stalls.get("memory", 0.0)
        work = max(gen.totals.get("step", 0.0) - gen.stalls.get("disk", 0.0) - stall_memory, 0.0)
        per_step = work / gen.steps if gen.steps else 0.0
        first_it = gen.first_iteration if isinstance(gen.first_iteration, int) else reached + 1
        last_it = gen.iteration if isinstance(gen.iteration, int) else first_it
        # Iterations first_it .. last_it ran here (first_it inside setup, before the first
        # step() call); those at or below `reached` had run before: re-done work.
        redone = max(min(reached, last_it) - first_it + 1, 0)
        in_steps = min(max(redone - 1, 0) * per_step, work)
        in_setup = min(per_step, gen.totals.get("setup", 0.0)) if redone else 0.0
        seconds["productive"] += (work - in_steps) * used
        seconds["rework"] += (in_steps + in_setup) * used
        seconds["save_disk"] += stall_disk * used
        seconds["save_memory"] += stall_memory * used
        seconds["other"] += gen.totals.get("other", 0.0) * used
        seconds["rendezvous_load"] += (gen.totals.get("setup", 0.0) - in_setup) * used
        tail_from = gen.accounted_until
        following = report.generations[index + 1] if index + 1 < len(report.generations) else None
        if gen.why == "finished" or (following is None and report.finished):
            seconds["shutdown"] += max(gen.stopped - tail_from, 0.0) * used
        else:
            acted = _first_after(events, {EventKind.RESTART, EventKind.NODE_LOST, EventKind.HANG,
                                          EventKind.JOB_FAILED}, gen.last_beat, gen.stopped + 60.0)
            acted_at = min(max(_num(acted.get("time"), gen.stopped) if acted else gen.stopped, tail_from),
                           max(gen.stopped, tail_from))
            hung = acted is not None and acted.get("kind") == EventKind.HANG
            seconds["hung" if hung else "detection"] += (acted_at - tail_from) * used
            seconds["restart"] += max(gen.stopped - acted_at, 0.0) * used
            next_first = following.first_step if following and following.first_step else report.end
            records = following.records if following else []
            tier, size = phases.load_facts(records)
            report.failures.append(Failure(
                time=gen.last_beat, cause=_cause(events, gen, acted, following), detection_seconds=acted_at - tail_from,
                downtime_seconds=next_first - gen.last_beat,
                iterations_lost=max(last_it - ((following.first_iteration or 1) - 1), 0) if following
                and isinstance(following.first_iteration, int) else 0,
                phases=phases.restart_spans(gen.last_beat, next_first, bool(following and following.first_step),
                                            _num(acted.get("time"), None) if acted else None, gen.records, records),
                loaded_from=tier, loaded_bytes=size))
        end_of_gen = max(gen.stopped, tail_from)
        if following is not None:
            seconds["restart"] += max(following.started - end_of_gen, 0.0) * gpus
        else:
            seconds["shutdown"] += max(report.end - end_of_gen, 0.0) * gpus
        reached = max(reached, last_it)


def _clamp_starts(report: Breakdown) -> None:
    """A process's start time comes from the kernel's boot time in whole seconds (psutil), so it
    can read up to a second early: never before the job's start or the previous generation's
    stop. The difference comes off the generation's setup."""
    floor = report.start
    for gen in report.generations:
        shift = max(floor - gen.started, 0.0)
        gen.started += shift
        gen.totals["setup"] = max(gen.totals.get("setup", 0.0) - shift, 0.0)
        floor = max(gen.stopped, gen.accounted_until)


def _cause(events: list[dict], gen: Generation, acted: dict | None, following: Generation | None) -> str:
    # Up to the next workers' start at most: a node lost after a quick restart is the next failure's.
    until = min(gen.stopped + 60.0, following.started) if following is not None else gen.stopped + 60.0
    lost = _first_after(events, {EventKind.NODE_LOST}, gen.last_beat, until)
    if lost is not None:
        spares = [str(e.get("source")) for e in events if e.get("kind") == EventKind.SPARE_PROMOTED
                  and gen.last_beat <= _num(e.get("time"), 0.0) <= until]  # a swap: a spare took the place
        return "node lost: " + ", ".join(map(str, lost.get("nodes") or ["?"])) + (
            f" (spare {', '.join(spares)} took its place)" if spares else "")
    if acted is not None and acted.get("kind") == EventKind.HANG:
        return f"hang: rank {acted.get('rank')} in {acted.get('section')}"
    restart = _first_after(events, {EventKind.RESTART}, gen.last_beat, until)
    if restart is not None:
        return str(restart.get("reason") or "restart").replace("_", " ")
    return "workers failed"


def _costs(report: Breakdown) -> JobCosts:
    """What this run's saves and recoveries cost, as ``eft simulate`` takes them."""
    gens = report.generations
    steps = sum(g.steps for g in gens)
    work = sum(max(g.totals.get("step", 0.0) - g.stalls.get("disk", 0.0) - g.stalls.get("memory", 0.0), 0.0)
               for g in gens)
    iteration = work / steps if steps and work > 0 else 1.0
    saves = [s for s in report.saves if isinstance(s.get("iteration"), int)]
    stall = sum(g.totals.get("checkpointing", 0.0) + g.stalls.get("disk", 0.0) for g in gens)
    save_seconds = stall / len(saves) if saves else 0.0
    # The interval in use: the commonest gap between periodic saves (the larger on a tie), so
    # that an emergency save or the one at the end does not pass for it.
    periodic = sorted({s["iteration"] for s in saves if s.get("request_id") is None})
    gaps = Counter(b - a for a, b in zip(periodic, periodic[1:]))
    every = max(gaps, key=lambda gap: (gaps[gap], gap)) if gaps else (periodic[0] if periodic else steps)
    interval = every * iteration
    mean = lambda values: sum(values) / len(values) if values else 0.0  # noqa: E731
    # From the restarts' phases (phases.py): detection; restart = stop, rendezvous, re-plan and
    # spawn; load = imports, process group, load and first step, apart for the memory tier.
    parts = [(phases.cost_parts(f.phases), f) for f in report.failures]
    recovered = [(p, f.loaded_from) for p, f in parts if f.phases and f.phases[-1].phase is not None]
    memory = [p["load"] for p, tier in recovered if tier == LoadTier.MEMORY]
    loads = [p["load"] for p, tier in recovered if tier != LoadTier.MEMORY] or memory \
        or [phases.cost_parts(report.start_phases)["load"]]
    return JobCosts(iteration_seconds=iteration, save_seconds=save_seconds, save_interval_seconds=max(interval, 0.0),
                    detection_seconds=max(mean([p["detection"] for p, _ in parts]), 0.0),
                    restart_seconds=max(mean([p["restart"] for p, _ in recovered]), 0.0),
                    load_seconds=max(mean(loads), 0.0), memory_load_seconds=max(mean(memory), 0.0))
