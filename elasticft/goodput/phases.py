"""A restart taken apart (``eft report``): from a failure's last heartbeat to the next first step.

Each phase ends at a moment something recorded (``contract/phases.py``): detection at the
first ``restart``/``node_lost``/``hang`` event, stop at the nodes' ``workers_stopped``
events, and the next generation's rendezvous, re-plan, spawn, imports, process group and
load at the ends its ``workers_stopped`` events carry. A synchronous job moves on when its
last node does, so a phase ends at the latest of its nodes' ends; the first step is the
lowest rank's (where the downtime ends).

The phases must add up to the downtime: ends are taken in order, each clamped between the
previous end and the downtime's end, so the spans telescope. A phase that nobody marked
(a worker without eft's hook, an older eft) is absent, not zero: its time goes to the next
phase that was marked, which says so (``merged``). A worker process's start, which every
generation records, stands in for an agent that did not mark ``spawn``.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticft.contract.phases import ORDER, LoadTier, RestartPhase, stamps_from_json

START_PHASES = ORDER[ORDER.index(RestartPhase.RENDEZVOUS):]  # a job's first start: no failure to detect
# What eft simulate's costs call each phase: detection, restart (to the new processes), load.
COST_OF = {RestartPhase.DETECTION: "detection", RestartPhase.STOP: "restart", RestartPhase.RENDEZVOUS: "restart",
           RestartPhase.REPLAN: "restart", RestartPhase.SPAWN: "restart", RestartPhase.IMPORTS: "load",
           RestartPhase.PROCESS_GROUP: "load", RestartPhase.LOAD: "load", RestartPhase.FIRST_STEP: "load"}


@dataclass(frozen=True)
class PhaseSpan:
    """``seconds`` of one phase; ``phase`` None: the rest, up to the job's end, of a restart that
    never reached a first step."""

    phase: RestartPhase | None
    seconds: float
    merged: tuple[RestartPhase, ...] = ()  # earlier phases nobody marked, whose time is in this one

    @property
    def name(self) -> str:
        return str(self.phase) if self.phase is not None else "unfinished"

    def to_json(self) -> dict:
        return {"phase": self.name, "seconds": self.seconds, "merged": [str(p) for p in self.merged]}


def split(begin: float, end: float, ends: dict[RestartPhase, float], phases=ORDER,
          reached: bool = True) -> list[PhaseSpan]:
    """Cut ``begin``..``end`` at the phases' ends, in order. ``reached``: ``end`` is the first
    step (the last phase ends there); otherwise what follows the last end is ``unfinished``."""
    spans, at, unmarked = [], begin, []
    for phase in phases:
        when = end if phase is RestartPhase.FIRST_STEP and reached else ends.get(phase)
        if when is None:
            unmarked.append(phase)
            continue
        when = min(max(when, at), end)
        spans.append(PhaseSpan(phase, when - at, tuple(unmarked)))
        at, unmarked = when, []
    if not reached:
        spans.append(PhaseSpan(None, end - at, ()))
    return spans


def generation_ends(records: list[dict]) -> dict[RestartPhase, float]:
    """The latest end of each phase a generation's ``workers_stopped`` records carry."""
    ends: dict[RestartPhase, float] = {}
    for record in records:
        for phase, when in stamps_from_json(record.get("phases")).items():
            ends[phase] = max(ends.get(phase, when), when)
    return ends


def _spawned(ends: dict[RestartPhase, float], records: list[dict]) -> dict[RestartPhase, float]:
    """``ends`` with the latest worker process start as ``spawn`` where no agent marked it."""
    starts = [r["started"] for r in records if isinstance(r.get("started"), (int, float))]
    if RestartPhase.SPAWN not in ends and starts:
        return {**ends, RestartPhase.SPAWN: float(max(starts))}
    return ends


def restart_spans(begin: float, end: float, reached: bool, acted_at: float | None, stopped: list[dict],
                  following: list[dict]) -> list[PhaseSpan]:
    """The phases of one restart: ``begin`` the failure's last heartbeat, ``end`` the next
    generation's first step (``reached``) or the job's end; ``acted_at`` the event the job acted
    on; ``stopped`` and ``following`` the ``workers_stopped`` records of the generation the
    failure ended and of the next one."""
    ends = _spawned(generation_ends(following), following)
    if acted_at is not None:
        ends[RestartPhase.DETECTION] = acted_at
    stops = [float(r["time"]) for r in stopped if isinstance(r.get("time"), (int, float))]
    if stops:
        ends[RestartPhase.STOP] = max(stops)
    return split(begin, end, ends, ORDER, reached)


def start_spans(begin: float, end: float, reached: bool, records: list[dict]) -> list[PhaseSpan]:
    """The phases of the job's first start: from its first event to the first step."""
    return split(begin, end, _spawned(generation_ends(records), records), START_PHASES, reached)


def load_facts(records: list[dict]) -> tuple[str | None, int | None]:
    """(tier, checkpoint bytes) a generation loaded: the lowest rank's tier, the largest size a
    node saw (each node sizes the checkpoint it read)."""
    if not records:
        return None, None
    lead = min(records, key=lambda r: r.get("rank") if isinstance(r.get("rank"), int) else float("inf"))
    tier = lead.get("loaded_from") if lead.get("loaded_from") in tuple(LoadTier) else None
    sizes = [r["loaded_bytes"] for r in records if isinstance(r.get("loaded_bytes"), int)]
    return tier, max(sizes) if sizes else None


def summed(spans_per_restart: list[list[PhaseSpan]]) -> dict[str, float]:
    """Seconds per phase over several restarts (a merged span counts under its own phase)."""
    totals: dict[str, float] = {}
    for spans in spans_per_restart:
        for span in spans:
            totals[span.name] = totals.get(span.name, 0.0) + span.seconds
    return totals


def cost_parts(spans: list[PhaseSpan]) -> dict[str, float]:
    """A restart's seconds as ``eft simulate`` takes them: detection, restart, load."""
    parts = {"detection": 0.0, "restart": 0.0, "load": 0.0}
    for span in spans:
        if span.phase is not None:
            parts[COST_OF[span.phase]] += span.seconds
    return parts
