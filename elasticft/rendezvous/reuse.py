"""A run id used again: a new attempt of a job that ended, or a second job by mistake.

A requeued SLURM job keeps its job id; a user reruns a command with the same
``--rdzv-id``; two jobs leave ``--rdzv-id`` at torchrun's default (``none``). What the
previous attempt left in etcd must not decide the new one's fate:

* its rendezvous is closed (the job ended): the new attempt would exit at once with
  "the rendezvous was closed";
* its ``started`` key would make ``--eft-exit-duration-mins`` fire at the first step;
* an open ``ckpt/request`` (an ``eft ckpt stop``, say) would stop the new workers.

``prepare_run`` runs before an agent joins. A run whose previous attempt is over (closed,
and no node holds a live lease) is reset by the first agent of the new attempt, in one
transaction guarded by the ``closed`` key's revision, so that of many agents starting
at once exactly one resets it, and none resets a run another has begun to use. Its
checkpoint history (``ckpt/ack``, ``ckpt/latest``), event log, restart record and learned
timeouts stay. A run held by live nodes of another SLURM job, or still closed while its
nodes linger past their leases' time, is refused in one line (exit 2).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from elasticft.contract.keys import RunKeys
from elasticft.contract.outcome import JobOutcome
from elasticft.contract.records import NodeRecord
from elasticft.rendezvous.backend import RendezvousConfigError
from elasticft.store import EtcdClient

log = logging.getLogger(__name__)

LINGER_POLL_SECONDS = 0.5  # how often to look whether the ended attempt's leases expired


class RunInUse(RendezvousConfigError):
    """The run id belongs to a live job: this launch must not join it."""


def _live_nodes(client: EtcdClient, keys: RunKeys) -> list[NodeRecord]:
    records = []
    for item in client.get_prefix(keys.nodes)[0]:
        try:
            records.append(NodeRecord.from_json(item.value))
        except (ValueError, TypeError):
            continue
    return records


def _describe(nodes: list[NodeRecord]) -> str:
    shown = ", ".join(f"{n.node_id} on {n.host}" + (f" (job {n.attempt})" if n.attempt else "") for n in nodes[:3])
    return shown + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")


def prepare_run(client: EtcdClient, keys: RunKeys, attempt: str, linger: float,
                clock: Callable[[], float] = time.monotonic) -> bool:
    """Make ``keys``' run ready for this launch; True if this call reset an ended attempt.

    ``attempt``: this launch's identity where known (SLURM), else "". ``linger``: how long
    to wait for an ended attempt's nodes to vanish (their leases' TTL and some).
    Raises RunInUse.
    """
    hint = "pass another --rdzv-id"
    deadline = clock() + linger
    while True:
        nodes = _live_nodes(client, keys)
        others = [n for n in nodes if attempt and n.attempt and n.attempt != attempt]
        if others:
            raise RunInUse(f"--rdzv-id {keys.run_id} is in use by another job: {_describe(others)}; {hint}")
        closed = client.get(keys.rdzv_closed)
        if closed is None:
            return False  # a run never closed: a new job, or nodes joining one that goes on
        if not nodes:
            break
        if clock() >= deadline:
            raise RunInUse(f"--rdzv-id {keys.run_id}: that job ended but {_describe(nodes)} still hold it; "
                           f"wait for them to exit, or {hint}")
        time.sleep(LINGER_POLL_SECONDS)
    reset = client.delete_if_unchanged_with(
        keys.rdzv_closed, closed.mod_revision,
        prefixes=(keys.root + "rdzv/", keys.c10d),
        keys=(keys.started, keys.ckpt_request, keys.layout),
    )
    if reset:
        log.info("run %s: its previous attempt ended; starting a new one (checkpoint history, events and "
                 "restart record kept)", keys.run_id)
    return reset


def attempt_outcome(client: EtcdClient, keys: RunKeys, attempt: str) -> JobOutcome | None:
    """How this very attempt ended, where a node recorded it (``contract/outcome.py``), else None.

    For a node that did not train to the end of its attempt: one that starts after its job
    finished (a JobSet pod replaced while the others trained on; a late srun task) has
    nothing to join, and a spare that watched the job stop follows the job's status. Only a
    named attempt (SLURM's, a JobSet's) is matched."""
    if not attempt:
        return None
    raw = client.get(keys.outcome)
    try:
        outcome = JobOutcome.from_json(raw.value) if raw is not None else None
    except (ValueError, TypeError, KeyError):
        return None
    return outcome if outcome is not None and outcome.attempt == attempt else None
