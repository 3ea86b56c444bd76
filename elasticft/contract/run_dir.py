"""The run directory: how a node agent and its workers talk, through files only.

Workers never talk to etcd (thousands of them must not each hold a watch). Each agent
makes a node-local directory and names it to its workers in ``EFT_RUN_DIR``; both
sides take every name below from here, so neither spells the other's files:

* ``request.json``: the open checkpoint request, written by the agent;
* ``outbox/*.json``: rank 0's (and, for the memory tier, local rank 0's) messages to its agent
  (an ``OutboxKind`` each);
* ``mem-restore.json``, ``mem-paused``, ``mem-replicating``: the memory tier's (``elasticft.contract.memory``);
* ``numerics.json``, ``rollback.json``: the numbers check's (``elasticft.contract.numerics``);
* ``progress/<local rank>.json``: each rank's heartbeat (``elasticft.contract.progress``);
* ``inject-*``: markers of injected faults (``elasticft.contract.faults``).

Every file is written with ``write_atomically``: a reader sees the old content or the
new, never half of it. docs/checkpoint.md ("Relay") is the user's side of this.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path

REQUEST_FILE = "request.json"
OUTBOX_DIR = "outbox"
PROGRESS_DIR = "progress"
DEGRADE_MARKER = "inject-gpu-degrade"  # holds the local rank whose GPU an injected fault degrades
FIRED_PREFIX = "inject-fired-"  # + a fault's name: that fault fired already on this node


class WorkerEnv(enum.StrEnum):
    """Variables the agent sets for its workers (beside torchrun's and the ``EFT_*`` knobs)."""

    RUN_DIR = "EFT_RUN_DIR"  # the run directory; unset: not under eft-run, the hook is inert
    START_TIME = "EFT_START_TIME"  # the job's start (the first agent's clock), for exit-duration
    DEADLINE = "EFT_DEADLINE"  # unix time to save and exit by (SLURM's time limit less the margin)
    INJECT = "EFT_INJECT"  # faults to inject (``--eft-inject``)
    MEM_DIR = "EFT_MEM_CKPT_WRITE_DIR"  # where this generation's memory snapshots go (``contract.memory``)
    NODE_ID = "EFT_NODE_ID"  # the agent's node id (``--eft-node-id``): numeric faults implicate nodes by it
    # "<pid>:<unix time>": a warm interpreter that ran the worker's command cold, in its own place
    # (same pid), became that worker then; the process itself started before the failure
    BECAME_WORKER = "EFT_BECAME_WORKER"
    TRAINING_LOOP = "EFT_TRAINING_LOOP"  # whose loop eft enters (a TrainingLoop; unset: Megatron-LM's, if any)


class TrainingLoop(enum.StrEnum):
    """Whose training loop eft-run's boot directory attaches eft to (``WorkerEnv.TRAINING_LOOP``)."""

    MEGATRON_LM = "megatron_lm"  # megatron.training.pretrain (elasticft/megatron_lm)
    MEGATRON_BRIDGE = "megatron_bridge"  # megatron.bridge.training.pretrain (elasticft/megatron_bridge)


class OutboxKind(enum.StrEnum):
    """The ``type`` of a message rank 0 leaves in the outbox."""

    ACK = "ack"  # a checkpoint is complete: iteration, path, seconds, request_id, exit
    FILTERED = "filtered"  # the gap rule skipped a risk request: request_id, iteration, why
    # local rank 0: every rank finished the memory snapshot of iteration; path, seconds, stall, bytes,
    # overlapped (the copy ran beside the next iteration), copy (its seconds), waited (of the stall, the
    # seconds the update waited for the copy)
    MEM_SAVED = "mem_saved"
    RESTORED = "restored"  # local rank 0: the workers resumed; iteration (None: from scratch), source, path
    # global rank 0: a memory checkpoint did not load; iteration, why, then, and for a range no holder could
    # deliver intact, file and range ([first byte, one past the last])
    MEM_FALLBACK = "mem_fallback"
    NUMERICS = "numerics"  # a verdict of the numbers check: event (an EventKind), and its fields


def write_atomically(path: str | os.PathLike, text: str, *, durable: bool = False) -> None:
    """Write ``text`` to ``path`` through ``<stem>.tmp`` beside it and ``os.replace``.

    The tmp name keeps no suffix of ``path``, so a reader that lists ``*.json`` never
    picks up a file being written.

    ``durable`` also fsyncs the file and its directory, so that the new content
    survives a crash of the machine right after (a checkpoint tracker needs that; a
    message to a local agent does not).
    """
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
