"""The agent's side of the job's outcome (``contract.outcome``): written once, at its end.

An agent that ends knows how its own part ended; whether that is the job's end is the
rule in ``contract.outcome.decide_outcome``: rank 0's node for a training that finished
(or saved and stopped for a requeue), any node for the restart rule's verdict. The
record is what the batch script's ``eft outcome`` exits with, so a lost node's killed task
does not make srun's 137 the job's status. A write etcd refuses costs a warning: the
batch script then falls back to srun's status, which never says 0 for an unfinished job.
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState

from elasticft.agent.context import AgentContext
from elasticft.contract.exit_codes import ExitCode
from elasticft.contract.outcome import JobOutcome, decide_outcome
from elasticft.contract.restarts import Ending, RestartRecord
from elasticft.store import EtcdClient, StoreError

log = logging.getLogger(__name__)


def record_outcome(ctx: AgentContext | None, group: WorkerGroup, clean: bool,
                   stop_reason: str | None) -> ExitCode | None:
    """At the agent's end: write the job's outcome if this agent decides it; the status it
    decided (the job as a whole ended: ``job_end.close_before_leaving``), else None.

    ``clean``: the agent ended without an exception and was not excluded from the job;
    ``stop_reason``: its workers' save-and-exit reason (None: they did not save and stop).
    """
    if ctx is None:
        return None
    finished = clean and group.state == WorkerState.SUCCEEDED
    status = None
    try:
        ending = None if finished else _ending(ctx)
        status = decide_outcome(group_rank0=group.group_rank == 0, finished=finished, stop_reason=stop_reason,
                                ending=ending)
        if status is None:
            return None
        outcome = JobOutcome(status, ctx.node.record.attempt, ctx.node_id)
        if write_once(ctx.client, ctx.keys.outcome, outcome):
            log.info("job outcome: %s, exit status %d", outcome.describe(), int(status))
    except StoreError as exc:
        log.warning("could not record the job's outcome in etcd (%s): the batch script falls back to "
                    "srun's exit status", exc)
    return status


def _ending(ctx: AgentContext) -> Ending | None:
    """The restart rule's verdict on this launch (``restarts``), None without one."""
    current = ctx.client.get(ctx.keys.restarts)
    if current is None:
        return None
    try:
        return RestartRecord.from_json(current.value).ended
    except (ValueError, TypeError, KeyError) as exc:
        log.debug("ignoring a malformed %s: %s", ctx.keys.restarts, exc)
        return None


def write_once(client: EtcdClient, key: str, outcome: JobOutcome) -> bool:
    """Write ``outcome`` unless the key holds one of the same attempt (the first end decided in
    an attempt stands); a record of another attempt, or a malformed one, is replaced.
    True if this call wrote it. Raises StoreError."""
    current = client.get(key)
    while True:
        if current is not None and _attempt_of(current.value) == outcome.attempt:
            return False
        swapped, current = client.compare_and_swap(key, current.mod_revision if current else None, outcome.to_json())
        if swapped:
            return True


def _attempt_of(raw: bytes) -> str | None:
    try:
        return JobOutcome.from_json(raw).attempt
    except (ValueError, TypeError, KeyError):
        return None
