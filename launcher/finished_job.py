"""A node that did not train to its attempt's end exits with the job's outcome, not its own.

In a JobSet a lost node's pod is replaced while the others train on; when they reach the
end first (``--nnodes MIN:MAX``), the replacement starts, or reaches the rendezvous, after
the job finished. Resetting the run (``rendezvous/reuse.py``) would train again from the last
checkpoint, or wait its join timeout for MIN nodes that never come and fail, and its Job
would replace it again and again. The outcome this attempt's rank 0 node recorded says the
training is done: the node says so in one line and exits 0, and its Job completes.

A spare ends when the working nodes do, without workers of its own to tell why: when they
saved and stopped for a preemption (4), a spare that exited 0 would complete its Job and its
index would never train again. It exits with the outcome the job recorded.
"""

from __future__ import annotations

import sys
import time

from elasticft.agent.context import EtcdTarget
from elasticft.contract.exit_codes import ExitCode
from elasticft.contract.outcome import JobOutcome
from elasticft.contract.records import COMMAND_ATTEMPT
from elasticft.rendezvous.reuse import attempt_outcome
from elasticft.store import EtcdClient, StoreError, StoreUnavailable, connect

POLL_SECONDS = 0.5


def recorded_outcome(target: EtcdTarget, wait: float = 0.0, status: ExitCode | None = None) -> JobOutcome | None:
    """This attempt's outcome (of ``status`` only, when given), looked for up to ``wait``
    seconds (a round closes, a spare sees the others finish, a moment before the deciding
    node records it); None without one, without a named attempt (SLURM's, a JobSet's), or
    without etcd."""
    if not _named(target):
        return None
    try:
        client = connect(target.store)
    except StoreUnavailable:
        return None
    deadline = time.monotonic() + wait
    try:
        while True:
            outcome = _outcome(client, target, status)
            if outcome is not None or time.monotonic() >= deadline:
                return outcome
            time.sleep(POLL_SECONDS)
    except StoreError:
        return None
    finally:
        client.close()


def finished_on(client: EtcdClient, target: EtcdTarget) -> JobOutcome | None:
    """This attempt's "the training finished" outcome, read once through ``client``, or None."""
    return _outcome(client, target, ExitCode.OK) if _named(target) else None


def _named(target: EtcdTarget) -> bool:
    """Whether the attempt names a job (not torchrun's default run id's command digest)."""
    return bool(target.attempt) and not target.attempt.startswith(COMMAND_ATTEMPT)


def _outcome(client: EtcdClient, target: EtcdTarget, status: ExitCode | None) -> JobOutcome | None:
    outcome = attempt_outcome(client, target.keys, target.attempt)
    return outcome if outcome is not None and status in (None, outcome.status) else None


def finished_before_join(target: EtcdTarget, wait: float = 0.0) -> JobOutcome | None:
    """This attempt's "the training finished" outcome, or None (``recorded_outcome``)."""
    return recorded_outcome(target, wait, ExitCode.OK)


def nothing_to_do(outcome: JobOutcome, run_id: str) -> ExitCode:
    print(f"eft-run: run {run_id}: {outcome.describe()} before this node joined; nothing to do", file=sys.stderr,
          flush=True)
    return ExitCode.OK


def spare_status(target: EtcdTarget | None, wait: float) -> ExitCode:
    """The status of a spare that ended with the working nodes: the job's recorded one (0
    when none is recorded: a spare never fails a finished job)."""
    outcome = recorded_outcome(target, wait) if target is not None else None
    return outcome.status if outcome is not None else ExitCode.OK
