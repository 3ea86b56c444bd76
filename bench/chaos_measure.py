"""What one chaos row observed, read from the job's stamped lines and its checkpoints.

* recovered: the job made ``AFTER_SAVES`` saves after the fault ended and after its last
  start of the workers, within the recovery timeout;
* world size after: the world of the workers' last start;
* iterations re-done: at each start of the workers after the fault began, the last
  iteration printed before it minus the step the loop resumed from, summed (a start
  before the fault, e.g. the second node joining late, costs nothing here);
* longest stall: the longest time between two iteration lines, from the last one before
  the fault to the end of the row;
* checkpoints kept: each start after the fault resumed from the newest committed save
  (the last save line before it, skipping the ones the fault itself destroyed, e.g. the
  corrupted one), and at the end the tracker names a complete checkpoint that loads;
* registration: at the end every running agent has its record under ``nodes/`` in etcd
  (one whose lease expired while it was frozen or cut off must not train on unseen), and
  no record names an agent that is gone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

from bench.chaos_job import ChaosJob
from elasticft.contract.keys import RunKeys
from elasticft.contract.records import NodeRecord, NodeState
from elasticft.store import StoreError, StoreOptions, connect


@dataclass
class Outcome:
    row: str
    recovered: bool = False
    world_after: int | None = None
    redone: int | None = None
    stall: float | None = None
    checkpoints_kept: bool = False
    restarts: int = 0  # starts of the workers after the fault began (a relaunch counts)
    seconds: float = 0.0  # the row's wall time
    problems: list[str] = field(default_factory=list)  # what the fault saw go wrong (e.g. an orphan)
    skipped: str = ""  # why the row did not run
    detail: str = ""  # what exactly the fault did


def redone(job: ChaosJob, fault_started: float) -> int:
    total = 0
    steps = job.steps()
    for line, _world, resumed in job.starts(after=fault_started):
        before = [step for step_line, step in steps if step_line.time < line.time]
        if before:
            total += max(0, before[-1] - resumed)
    return total


def longest_stall(job: ChaosJob, fault_started: float, ended: float) -> float:
    times = [line.time for line, _ in job.steps()]
    before = [t for t in times if t < fault_started]
    window = before[-1:] + [t for t in times if t >= fault_started] + [ended]
    return max(b - a for a, b in pairwise(window)) if len(window) > 1 else ended - fault_started


def checkpoints_kept(job: ChaosJob, fault_started: float, destroyed: set[int]) -> tuple[bool, list[str]]:
    """(kept, what was not): every resume after the fault from the newest committed save."""
    missing = []
    saves = job.saves()
    for line, _world, resumed in job.starts(after=fault_started):
        committed = [step for save_line, step in saves if save_line.time < line.time and step not in destroyed]
        if committed and resumed < committed[-1]:
            missing.append(f"resumed from step {resumed}, not from the committed save of step {committed[-1]}")
    tracked = job.tracked_iteration()
    if tracked is None or not job.loads(tracked):
        missing.append(f"at the end the tracker names {tracked}, which is not a complete checkpoint that loads")
    return not missing, missing


def registration_problems(job: ChaosJob) -> list[str]:
    """Running agents without a record in etcd, and records of agents that are gone."""
    client = connect(StoreOptions(job.endpoint, timeout=5.0), check=False)
    try:  # a request that finds its member dead goes on to the next one
        kvs = client.get_prefix(RunKeys(job.run_id).nodes)[0]
    except StoreError as err:
        return [f"could not read the node records: {err}"]
    finally:
        client.close()
    records = [NodeRecord.from_json(kv.value) for kv in kvs]
    registered = {r.pid: r for r in records if r.state == NodeState.RUNNING}
    running = {job.nodes[i].proc.pid: i for i in job.running()}
    problems = [f"node{i} (agent pid {pid}) trains without a record under nodes/ in etcd"
                for pid, i in running.items() if pid not in registered]
    problems += [f"a record of node {r.node_id} (pid {pid}) outlives its agent"
                 for pid, r in registered.items() if pid not in running]
    return problems


def measure(job: ChaosJob, name: str, fault_started: float, recovered: bool, ended: float,
            destroyed: set[int]) -> Outcome:
    starts = job.starts()
    kept, lost = checkpoints_kept(job, fault_started, destroyed)
    return Outcome(
        row=name,
        recovered=recovered,
        world_after=starts[-1][1] if starts else None,
        redone=redone(job, fault_started),
        stall=longest_stall(job, fault_started, ended),
        checkpoints_kept=kept,
        restarts=len(job.starts(after=fault_started)),
        problems=lost + registration_problems(job),
    )
