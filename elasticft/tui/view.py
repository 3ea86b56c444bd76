"""What ``eft top`` shows, as plain data: a pure function of a ``RunState`` and the time.

The run's state word is derived from the keys, first rule that holds wins:

* **stopped** — no node record is live (none at all, or all marked exited);
* **checkpointing** — ``ckpt/request`` is open: neither acknowledged (``ckpt/ack/<id>``)
  nor skipped (``ckpt/filtered/<id>``), and younger than the request timeout;
* **restarting** — a node was lost (a ``node_lost`` event, or a loss this viewer saw)
  after the current ``layout`` was written;
* **rendezvous** — no ``layout`` yet, or a ``node_joined`` event is newer than it
  (a node waits for the next round);
* **training** — otherwise.

"Newer" compares etcd revisions, never clocks. Only the planner writes ``layout``,
so a job without Megatron model arguments stays "rendezvous" (the detail says so).
A node is **lost** when its record is gone and either this viewer saw it deleted
without a clean exit (``membership.apply_node_events``) or the event log's last word
on it is a ``node_lost`` newer than its ``node_joined``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from elasticft.contract.events import EventKind, describe
from elasticft.contract.memory import MemPart, NodeParts
from elasticft.contract.records import NodeState
from elasticft.health.trend import temperature_slope
from elasticft.memckpt.index import memory_summary
from elasticft.tui.state import RunState

SORTS = ("risk", "node")
LOW_RISK = 0.5  # below this a GPU is green; from here to the threshold, yellow


@dataclass(frozen=True)
class ViewSettings:
    threshold: float = 0.8  # RiskConfig's default (eft top passes --threshold)
    stale_after: float = 30.0  # seconds after which a health sample is dimmed
    sort: str = "risk"
    request_timeout: float = 300.0  # as the agents' --eft-ckpt-request-timeout
    events: int = 8  # newest events shown


@dataclass
class GpuRow:
    node: str
    gpu: int
    risk: float
    level: str  # ok (< 0.5), warn (< threshold), high (>= threshold)
    temperature_c: float | None
    trend_c_per_min: float | None  # from the samples this viewer saw; None until two
    memory_used_mib: float | None
    memory_total_mib: float | None
    power_w: float | None
    power_limit_w: float | None
    utilization_pct: float | None
    ecc_corrected: int | None
    ecc_uncorrected: int | None
    xids: list[int]
    dominant: str | None
    critical: str | None
    age_s: float | None
    stale: bool


@dataclass
class LostRow:
    node: str
    host: str | None
    gpus: int | None
    lost_for_s: float | None
    reported_by: str | None  # the agent whose event said so; None when this viewer saw it
    last_risk: float | None  # the highest risk among its last samples, when known
    last_risk_gpu: int | None


@dataclass
class Header:
    run_id: str
    state: str
    detail: str
    live_nodes: int
    lost_nodes: int
    world_size: int | None
    tp: int | None
    pp: int | None
    dp: int | None
    used: int | None
    spare: list[int]
    layout_age_s: float | None  # since the current layout's event
    restarts: int
    uptime_s: float | None
    threshold: float
    watch_error: str | None
    job_restarts: JobRestarts | None = None  # the job-wide restart record (None: no record yet)
    spare_nodes: list[str] = field(default_factory=list)  # live nodes waiting as spares (records say ``spare``)


@dataclass
class JobRestarts:
    """The job-wide restart counts (``restarts``): what the restart rules will end the job at."""

    charged: int  # restart cycles charged this launch
    limit: int | None  # --eft-max-job-restarts in force
    no_progress: int  # cycles in a row without progress
    no_progress_limit: int | None  # --eft-max-no-progress-restarts in force (0: off)
    ended: str | None  # the verdict that ended the job (no_progress, restart_budget_exhausted)


@dataclass
class EventRow:
    time: float | None
    age_s: float | None
    kind: str
    source: str | None
    text: str


@dataclass
class View:
    exists: bool
    header: Header
    lost: list[LostRow]  # shown before the GPUs
    gpus: list[GpuRow]  # in the chosen order
    checkpoints: dict = field(default_factory=dict)  # request, last_ack, latest (None each when absent)
    events: list[EventRow] = field(default_factory=list)  # newest first
    sort: str = "risk"  # risk: riskiest first; node: grouped by node, GPUs in index order

    def to_dict(self) -> dict:
        return asdict(self)


def risk_level(risk: float, threshold: float) -> str:
    if risk >= threshold:
        return "high"
    return "ok" if risk < LOW_RISK else "warn"


def _number(value) -> float | None:
    """A number from a record, None for anything else (records come from other versions too)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _age(now: float, then) -> float | None:
    then = _number(then)
    return None if then is None else max(0.0, now - then)


def _gpu_row(key, record: dict, state: RunState, now: float, settings: ViewSettings) -> GpuRow:
    sample = record.get("sample")
    sample = sample if isinstance(sample, dict) else {}
    risk = min(1.0, max(0.0, _number(record.get("score")) or 0.0))
    age = _age(now, record.get("timestamp"))
    xids = {x for x in sample.get("xids") or [] if _count(x) is not None} | state.xids_seen.get(key, set())
    text = lambda value: None if value is None else str(value)
    return GpuRow(
        node=key[0], gpu=key[1], risk=risk, level=risk_level(risk, settings.threshold),
        temperature_c=_number(sample.get("temperature_c")),
        trend_c_per_min=temperature_slope(state.temperatures.get(key, [])),
        memory_used_mib=_number(sample.get("memory_used_mib")), memory_total_mib=_number(sample.get("memory_total_mib")),
        power_w=_number(sample.get("power_w")), power_limit_w=_number(sample.get("power_limit_w")),
        utilization_pct=_number(sample.get("utilization_pct")),
        ecc_corrected=_count(sample.get("ecc_corrected")), ecc_uncorrected=_count(sample.get("ecc_uncorrected")),
        xids=sorted(xids), dominant=text(record.get("dominant")), critical=text(record.get("critical")),
        age_s=age, stale=age is None or age > settings.stale_after,
    )


def _events(state: RunState) -> list[tuple[int, dict]]:
    """(revision, event) for every well-formed event, in the order etcd stored them."""
    out = [(r.revision, r.value) for r in state.events if isinstance(r.value, dict) and isinstance(r.value.get("kind"), str)]
    return sorted(out, key=lambda pair: pair[0])


def _lost_rows(state: RunState, events: list[tuple[int, dict]], now: float) -> tuple[list[LostRow], int | None]:
    """Lost nodes, and the revision of the newest loss (None when there is none)."""
    live = set(state.nodes)
    joined: dict[str, tuple[int, dict]] = {}
    lost: dict[str, tuple[int, dict]] = {}
    for revision, event in events:
        if event["kind"] == EventKind.NODE_JOINED and event.get("source"):
            joined[event["source"]] = (revision, event)
        elif event["kind"] == EventKind.NODE_LOST:
            for node in map(str, event.get("nodes") or []):
                lost.setdefault(node, (revision, event))  # the first agent to report it
                if joined.get(node, (-1,))[0] > lost[node][0]:
                    lost[node] = (revision, event)
    rows: dict[str, LostRow] = {}
    newest = None
    for node, (revision, event) in lost.items():
        if node in live or joined.get(node, (-1,))[0] > revision:
            continue
        join = joined.get(node, (0, {}))[1]
        rows[node] = LostRow(node, join.get("host"), _count(join.get("gpus")), _age(now, event.get("time")),
                             event.get("source"), None, None)
        newest = max(newest or 0, revision)
    for node, seen in state.lost_seen.items():
        if node in live:
            continue
        health = seen.last_health
        worst = max(health, key=lambda g: _number(health[g].get("score")) or 0.0) if health else None
        earlier = rows.get(node)
        rows[node] = LostRow(
            node, seen.record.host, len(seen.record.gpus) if seen.record.gpus else (earlier.gpus if earlier else None),
            earlier.lost_for_s if earlier else _age(now, seen.seen_at),
            earlier.reported_by if earlier else None,
            _number(health[worst].get("score")) if worst is not None else None, worst,
        )
        if seen.record.state is not NodeState.SPARE:  # a spare's loss restarts no one
            newest = max(newest or 0, seen.revision)
    return [rows[n] for n in sorted(rows)], newest


def _checkpoints(state: RunState, now: float, settings: ViewSettings) -> dict:
    request = None
    if state.ckpt_request is not None and isinstance(state.ckpt_request.value, dict):
        raw = state.ckpt_request.value
        age = _age(now, raw.get("time"))
        status = "open"
        if raw.get("id") in state.acks:
            status = "saved"
        elif raw.get("id") in state.filtered:
            status = "skipped"
        elif age is not None and age > settings.request_timeout:
            status = "expired"
        request = {k: raw.get(k) for k in ("id", "reason", "requester", "risk", "exit")}
        request.update(age_s=age, status=status)
        if status == "skipped":
            request["why"] = state.filtered[raw["id"]].get("why")
    acks = sorted(state.acks.values(), key=lambda a: _number(a.get("time")) or 0.0)
    last_ack = None
    if acks:
        a = acks[-1]
        last_ack = {k: a.get(k) for k in ("request_id", "iteration", "seconds", "path")}
        last_ack["age_s"] = _age(now, a.get("time"))
    latest = None
    if state.latest is not None:
        latest = {k: state.latest.get(k) for k in ("iteration", "path", "seconds")}
        latest["age_s"] = _age(now, state.latest.get("time"))
    memory = memory_summary(_parts(state.memory_parts), set(state.nodes))
    if memory is not None:
        memory["age_s"] = _age(now, memory.pop("time"))
    return {"request": request, "last_ack": last_ack, "latest": latest, "memory": memory}


def _parts(raw: list[dict]) -> list[MemPart]:
    """Every part of the nodes' records (``contract.memory.NodeParts``)."""
    parts = []
    for value in raw:
        try:
            parts.extend(NodeParts.from_json(json.dumps(value)).parts)
        except (TypeError, ValueError, KeyError):
            continue  # a record of another version: not shown
    return parts


def _restarts(events: list[tuple[int, dict]]) -> int:
    """Rounds after the first layout, or the agents' own count of restarts after losses."""
    layouts = sum(1 for _, e in events if e["kind"] == EventKind.LAYOUT)
    counted = [e.get("restarts") for _, e in events if e["kind"] == EventKind.NODE_LOST]
    return max([layouts - 1, 0] + [c for c in counted if isinstance(c, int)])


def _job_restarts(record: dict | None) -> JobRestarts | None:
    if record is None:
        return None
    ended = record.get("ended")
    return JobRestarts(charged=_count(record.get("charged")) or 0, limit=_count(record.get("job_restarts_limit")),
                       no_progress=_count(record.get("no_progress")) or 0,
                       no_progress_limit=_count(record.get("no_progress_limit")),
                       ended=ended if isinstance(ended, str) else None)


def _layout_age(state: RunState, events: list[tuple[int, dict]], now: float) -> float | None:
    if state.layout is None:
        return None
    # The leader writes the layout key, then its event: the first layout event after the key.
    published = [e for r, e in events if e["kind"] == EventKind.LAYOUT and r > state.layout.revision]
    return _age(now, published[0].get("time")) if published else None


def _state(state: RunState, events, newest_loss, checkpoints) -> tuple[str, str]:
    live = [r for r in state.nodes.values() if r.state is not NodeState.EXITED]
    layout_revision = state.layout.revision if state.layout is not None else None
    request = checkpoints["request"]
    if not live:
        return "stopped", "no live node"
    if request is not None and request["status"] == "open":
        return "checkpointing", f"{request['reason']} save {request['id']} asked by {request['requester']}"
    if layout_revision is not None and newest_loss is not None and newest_loss > layout_revision:
        return "restarting", "a node was lost after the current layout; waiting for the next round"
    if layout_revision is None:
        return "rendezvous", "no layout published yet (a job without the planner never publishes one)"
    waiting = [str(e.get("source")) for r, e in events
               if e["kind"] == EventKind.NODE_JOINED and r > layout_revision and e.get("source") in state.nodes
               and state.nodes[e["source"]].state is not NodeState.SPARE]  # a spare waits by design
    if waiting:
        return "rendezvous", f"{', '.join(waiting)} joined; waiting for the next round"
    return "training", "every live node is in the current layout; no checkpoint request open"


def build_view(state: RunState, now: float, settings: ViewSettings = ViewSettings()) -> View:
    events = _events(state)
    lost, newest_loss = _lost_rows(state, events, now)
    gpus = [_gpu_row(key, record, state, now, settings) for key, record in state.health.items()]
    if settings.sort == "node":
        gpus.sort(key=lambda r: (r.node, r.gpu))
    else:
        gpus.sort(key=lambda r: (-r.risk, r.node, r.gpu))
    checkpoints = _checkpoints(state, now, settings)
    word, detail = _state(state, events, newest_loss, checkpoints)
    layout = state.layout.value if state.layout is not None and isinstance(state.layout.value, dict) else {}
    header = Header(
        run_id=state.run_id, state=word, detail=detail,
        live_nodes=sum(1 for r in state.nodes.values() if r.state is not NodeState.EXITED), lost_nodes=len(lost),
        world_size=layout.get("world_size"), tp=layout.get("tp"), pp=layout.get("pp"), dp=layout.get("dp"),
        used=layout.get("used"), spare=layout["spare"] if isinstance(layout.get("spare"), list) else [],
        layout_age_s=_layout_age(state, events, now),
        restarts=_restarts(events), uptime_s=_age(now, state.started), threshold=settings.threshold,
        job_restarts=_job_restarts(state.restarts),
        spare_nodes=sorted(n + (f" [{r.segment}]" if r.segment else "")  # the domain a spare stands in for
                           for n, r in state.nodes.items() if r.state is NodeState.SPARE),
        watch_error=state.watch_error,
    )
    shown = events[-settings.events:] if settings.events > 0 else []
    rows = [EventRow(_number(e.get("time")), _age(now, e.get("time")), e["kind"], e.get("source"), describe(e))
            for _, e in reversed(shown)]
    return View(state.exists, header, lost, gpus, checkpoints, rows, settings.sort)


def fit(view: View, limit: int | None) -> tuple[list[LostRow], list[GpuRow], int]:
    """The rows to draw in ``limit`` lines: lost nodes, then the riskiest GPUs; and how many are left out.

    The chosen GPUs keep the view's order (by risk, or grouped by node).
    """
    if limit is None or limit >= len(view.lost) + len(view.gpus):
        return view.lost, view.gpus, 0
    lost = view.lost[:limit]
    room = max(0, limit - len(lost))
    riskiest = sorted(view.gpus, key=lambda r: (-r.risk, r.node, r.gpu))[:room]
    keep = {(r.node, r.gpu) for r in riskiest}
    gpus = [r for r in view.gpus if (r.node, r.gpu) in keep]
    return lost, gpus, len(view.lost) + len(view.gpus) - len(lost) - len(gpus)
